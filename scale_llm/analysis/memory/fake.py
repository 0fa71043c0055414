"""A whole optimizer step traced at full size on fake tensors, next to the estimate for the GPUs.

`estimate CONFIG --fake [--world-size N]` builds the model and backend as the trainer does under
`FakeTensorMode` (no storage: a 7B model costs seconds) and runs `measure.measured_steps` (single,
or FSDP2 as rank 0 of a fake process group) under `measure.LiveStorages`. The tensors are fake
CPU tensors (a CPU torch cannot take fake CUDA ones through a backward) with a CUDA run's
choices; compiled blocks run eager, grad_accum is 1, DeepSpeed is not traced (docs/memory.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from scale_llm.analysis.memory.estimate import estimate_layout, layout_of
from scale_llm.analysis.memory.measure import LiveStorages, measured_steps, parts_table
from scale_llm.components.optim import build_optimizer
from scale_llm.config import Config, with_changes
from scale_llm.config.plan import RunPlan, target_plan
from scale_llm.errors import UserError
from scale_llm.model import build_model, materialize
from scale_llm.parallel.backend import Backend, build_backend

GiB = 1 << 30
# What a fake trace cannot see, per GPU, as (name, low, high bytes, why). Not added to the
# traced figure: a budget adds them on top.
ALLOWANCES = (
    (
        "CUDA context",
        GiB // 2,
        GiB,
        "driver, kernels and cuBLAS handles; outside torch.cuda.max_memory_allocated, inside "
        "nvidia-smi and the GPU's capacity",
    ),
    (
        "allocator caching and fragmentation",
        0,
        None,
        "the caching allocator reserves whole segments; reserved exceeds allocated by a few "
        "% to 10-20% in long runs (expandable_segments:True keeps it low)",
    ),
    (
        "library workspaces",
        32 << 20,
        160 << 20,
        "cuBLAS/cuBLASLt workspaces (32 MiB per stream on Hopper) and the flash-attention "
        "backward's fp32 dq accumulator (4 B x tokens x d_model per block being computed)",
    ),
    (
        "NCCL buffers",
        0,
        GiB,
        "communicator buffers of multi-GPU runs (NCCL_BUFFSIZE x channels x peers), outside "
        "the allocator",
    ),
)


def trace_step(cfg: Config, world_size: int = 1) -> dict[str, Any]:
    """One optimizer step of `cfg` on rank 0 of `world_size` GPUs traced on fake tensors, in
    `measure_step`'s shape (with the allowances), next to the estimate for those GPUs."""
    here = _traced_config(cfg, world_size)
    target = target_plan(here, world_size)  # what the estimate is for: bf16 CUDA GPUs
    plan = dataclasses.replace(target, device=torch.device("cpu"))  # what the trace runs
    if plan.backend not in ("single", "fsdp"):
        raise UserError(
            f"estimate --fake traces parallel.backend single (world 1) and fsdp, not "
            f"{plan.backend}; use --world-size 1 or --set parallel.backend=fsdp"
        )
    if plan.pp_degree > 1:  # (its schedule sends to and waits for the other stages' ranks)
        raise UserError(
            f"estimate --fake traces one rank's step alone, and a pipeline's needs its other "
            f"stages (parallel.pipeline_parallel={plan.pp_degree}); leave out --fake (the "
            f"estimate is the worst pipeline rank's), or trace the layout without it: --set "
            f"parallel.pipeline_parallel=1"
        )
    from torch._subclasses.fake_tensor import FakeTensorMode

    def batches():
        shape = (plan.micro_batch_size, here.model.seq_len + 1)
        tokens = torch.randint(0, here.model.vocab_size, shape, device=plan.device)
        return [(tokens[:, :-1], tokens[:, 1:])]

    with _fake_process_group(plan):
        backend = build_backend(here, plan)
        model = build_model(here.model)  # on meta, outside the mode: materialized inside it
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode, LiveStorages(fake=True) as storages:  # before the weights are drawn
            model = _setup(backend, model, plan)
            measured = measured_steps(storages, backend, model, batches)
    on_cuda = with_changes(here, {"train.device": "cuda"})
    lay = layout_of(on_cuda, target)
    # the trace runs the CPU's kernels, which save what CUDA's do (RMSNorm: its input and rstd)
    est = estimate_layout(on_cuda.model, on_cuda.activation_checkpointing, lay)
    return {
        "backend": plan.backend,
        "precision": plan.precision,
        "activation_checkpointing": here.activation_checkpointing.mode,
        "micro_batch_size": plan.micro_batch_size,
        "world_size": world_size,
        "measured": measured,
        "estimated": {k: int(v) for k, v in est.gpu.items()},
        "estimated_peak_parts": {k: int(v) for k, v in est.peak_parts.items()},
        "peak_phase": est.peak_phase,
        "allowances": [
            {"name": n, "low": lo, "high": hi, "why": why} for n, lo, hi, why in ALLOWANCES
        ],
    }


def _traced_config(cfg: Config, world_size: int) -> Config:
    changes: dict[str, Any] = {"train.compile": False, "train.grad_accum": 1}
    if cfg.train.global_batch_size is not None:
        changes["train.global_batch_size"] = None
    if world_size == 1:
        changes["parallel.backend"] = "single"
    return with_changes(cfg, changes)


@contextlib.contextmanager
def _fake_process_group(plan: RunPlan) -> Iterator[None]:
    """A process group of `plan.world_size` ranks in this one process: torch's fake backend,
    whose collectives return at once (the data is fake anyway)."""
    import torch.distributed as dist

    if plan.backend == "single":
        yield
        return
    if dist.is_initialized():
        raise UserError("estimate --fake runs outside a process group; start it without torchrun")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _setup(backend: Backend, model: torch.nn.Module, plan: RunPlan) -> torch.nn.Module:
    """backend.setup(model), but for the steps a fake run cannot take as they are, and with
    the fused AdamW a CUDA run builds."""
    if hasattr(backend, "device_mesh"):  # FSDP2
        # the mesh is a small real tensor of ranks that FakeTensorMode cannot read back
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            mesh = backend.device_mesh()
        backend.device_mesh = lambda: mesh
        # each rank's fill of its shards from whole parameters: values only
        backend._fill_shards = lambda module, initial: None
        with _real_mesh_concatenation():  # (FSDP2 over tensor-parallel parameters)
            wrapped = backend.setup(model)
    else:
        # Backend.wrap draws the weights on the CPU and moves them to the device; moving swaps
        # each fake parameter, which the fake mode's weak references forbid: draw them in place
        torch.manual_seed(backend.cfg.run.seed)
        backend.module = backend.model = wrapped = materialize(model, plan.device)
        backend.transform_blocks(model)
    backend.optimizer = build_optimizer(wrapped, backend.cfg.train)
    return wrapped


@contextlib.contextmanager
def _real_mesh_concatenation() -> Iterator[None]:
    """FSDP2 joins its data-parallel mesh to a parameter's tensor-parallel one, which indexes
    the ranks' small real tensor: done outside the fake mode, as the mesh itself was."""
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = DeviceMesh._concatenate

    def outside_fake(meshes):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            return concatenate(meshes)

    DeviceMesh._concatenate = staticmethod(outside_fake)
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(concatenate)


def format_trace(r: dict[str, Any]) -> str:
    """The trace next to the estimate, as format_measurement prints a CPU measurement."""
    lines = [
        f"traced on fake tensors: one optimizer step, {r['backend']}, {r['precision']}, "
        f"checkpointing {r['activation_checkpointing']}, micro-batch {r['micro_batch_size']}, "
        f"rank 0 of {r['world_size']} (what is alive at the step's peak, next to the estimate "
        f"of its peak, {r['peak_phase']})",
        *parts_table(r, "; the estimate before the allocator allowance"),
    ]
    lines.append("not seen by the trace (add on top):")
    for a in r["allowances"]:
        high = "?" if a["high"] is None else f"{a['high'] / GiB:.2f}"
        lines.append(f"  {a['name']:<36} {a['low'] / GiB:.2f}-{high} GiB  {a['why']}")
    return "\n".join(lines)
