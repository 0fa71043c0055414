"""A whole optimizer step traced at full size on fake tensors, next to the estimate for the GPUs.

`scale-llm estimate CONFIG --fake [--world-size N]` builds the model and backend as the trainer
does, but under `FakeTensorMode`: every tensor has its shape, dtype and device and no storage,
so a 7B model on one rank of 8 costs a minute of Python and no memory. It runs two optimizer
steps (the second tracked, so AdamW's state exists) under PyTorch's MemTracker (single) or
FSDPMemTracker (FSDP2, rank 0 of a fake process group of N ranks, whose collectives only
produce outputs of the right shape), and reports the bytes of each category at the step's peak
and each category's own maximum, next to `estimate(cfg, N)`: the plan of a bf16 CUDA run of N
GPUs, what `scale-llm estimate` prints.

The tensors are fake *CPU* tensors. On a CPU-only build of torch (2.13) fake CUDA tensors trace
the forward pass (once a no-op CUDA device guard is registered; `_ensureCUDADeviceGuardSet`
installs one only on CUDA builds without a GPU), but their backward fails inside the autograd
engine, which asks for the accelerator's current stream ("Cannot access accelerator device when
none is available"). So the trace keeps what a CUDA run decides (bf16 autocast, the fused AdamW
that CUDA runs use, FSDP2's mixed precision, the checkpointing mode, the chunked loss) and runs
the CPU's kernels: CPU autocast and CPU flash attention, whose saved tensors equal the CUDA
ones for this model's ops (docs/memory.md says where they may not).

Left as they are: compiled blocks (`train.compile`) run eager, as a fake run cannot compile;
grad_accum is traced as 1 (the same peak: micro-steps are alike). What no fake run sees (CUDA
context, allocator caching, library workspaces, NCCL buffers) is listed in `ALLOWANCES`, apart
from the traced figure. DeepSpeed builds its engine with real collectives and flat buffers it
fills in place: not traced here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from scale_llm.components.optim import build_optimizer
from scale_llm.config import Config, with_changes
from scale_llm.errors import UserError
from scale_llm.memory.estimate import estimate
from scale_llm.model import build_model, materialize
from scale_llm.parallel.backend import Backend, build_backend
from scale_llm.parallel.step import optimizer_step
from scale_llm.plan import RunPlan, target_plan

# MemTracker's and FSDPMemTracker's reference types -> the estimate's parts
CATEGORIES = {  # MemTracker's reference types -> the estimate's parts
    "Parameter": "params",
    "Gradient": "grads",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "optimizer",  # only what measure_step registers: DeepSpeed's fp32 master partitions
}

FAKE_CATEGORIES = {
    **CATEGORIES,
    "Buffer": "activations",  # the rotary tables (the estimate counts them with activations)
    "Inputs": "activations",  # token ids and targets
    "Sharded Param": "params",
    "Unsharded Param": "params",
    "All Gather": "params",  # the gathered block's flat buffer, before it is copied out
    "Sharded Grad": "grads",
    "Unsharded Grad": "grads",
    "Reduce Scatter": "grads",  # the flat gradient buffer a block's reduce-scatter reads
    "OptState": "optimizer",
}
PARTS = ("params", "grads", "optimizer", "activations", "temporaries")

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
    """{"measured": {part: bytes at the peak, "total": peak}, "category_maxima": {...},
    "estimated": {...}} of one optimizer step of `cfg` on rank 0 of `world_size` GPUs, traced
    on fake tensors; the result has measure_step's shape."""
    here = _traced_config(cfg, world_size)
    target = target_plan(here, world_size)  # what the estimate is for: bf16 CUDA GPUs
    plan = dataclasses.replace(target, device=torch.device("cpu"))  # what the trace runs
    if plan.backend not in ("single", "fsdp"):
        raise UserError(
            f"estimate --fake traces parallel.backend single (world 1) and fsdp, not "
            f"{plan.backend}; use --world-size 1 or --set parallel.backend=fsdp"
        )
    from torch._subclasses.fake_tensor import FakeTensorMode

    with _fake_process_group(plan):
        backend = build_backend(here, plan)
        model = build_model(here.model)  # on meta, outside the mode: materialized inside it
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = _setup(backend, model, plan)
            measured, maxima = _tracked_step(backend, model, plan, here)
    est = estimate(with_changes(here, {"train.device": "cuda"}), target)
    return {
        "backend": plan.backend,
        "precision": plan.precision,
        "activation_checkpointing": here.activation_checkpointing.mode,
        "micro_batch_size": plan.micro_batch_size,
        "world_size": world_size,
        "measured": measured,
        "category_maxima": maxima,
        "estimated": {k: int(v) for k, v in est.gpu.items()},
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
        # rank 0's full CPU copy of the weights, broadcast into the shards: values only
        backend._load_full_weights = lambda module, initial: None
        wrapped = backend.setup(model)
    else:
        # Backend.wrap draws the weights on the CPU and moves them to the device; moving swaps
        # each fake parameter, which the fake mode's weak references forbid: draw them in place
        torch.manual_seed(backend.cfg.run.seed)
        backend.module = backend.model = wrapped = materialize(model, plan.device)
        backend.transform_blocks(model)
    backend.optimizer = build_optimizer(wrapped, backend.cfg.train, fused=True)
    return wrapped


def _tracked_step(
    backend: Backend, model: torch.nn.Module, plan: RunPlan, cfg: Config
) -> tuple[dict[str, int], dict[str, int]]:
    """Two optimizer steps, the second under the tracker: (bytes at its peak, each part's own
    maximum), on the traced device."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    m = cfg.model

    def batches():
        shape = (plan.micro_batch_size, m.seq_len + 1)
        tokens = torch.randint(0, m.vocab_size, shape, device=plan.device)
        return [(tokens[:, :-1], tokens[:, 1:])]

    optimizer_step(backend, model, batches())  # the optimizer state exists from here on
    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(model, backend.optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(model, backend.optimizer)
    with tracker:
        optimizer_step(backend, model, batches())
    peak = tracker.get_tracker_snapshot("peak")
    measured = _parts(peak.get(plan.device, {}))
    measured["total"] = sum(measured.values())
    maxima = {k: v for k, v in measured.items() if k != "total"}
    for stats in tracker.memory_tracking.values():
        for states in getattr(stats, "snapshots", {}).values():
            for per_device in states:
                for name, nbytes in _parts(per_device.get(plan.device, {})).items():
                    maxima[name] = max(maxima[name], nbytes)
    return measured, maxima


def _parts(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot by the estimate's parts; a reference type this module does not know
    counts as temporaries (so the total is everything the tracker saw)."""
    out = dict.fromkeys(PARTS, 0)
    for kind, nbytes in snapshot.items():
        name = getattr(kind, "value", str(kind))
        if name != "Total":
            out[FAKE_CATEGORIES.get(name, "temporaries")] += int(nbytes)
    return out


def format_trace(r: dict[str, Any]) -> str:
    """The trace next to the estimate, as format_measurement prints a CPU measurement."""
    lines = [
        f"traced on fake tensors: one optimizer step, {r['backend']}, {r['precision']}, "
        f"checkpointing {r['activation_checkpointing']}, micro-batch {r['micro_batch_size']}, "
        f"rank 0 of {r['world_size']} (bytes at the step's peak, next to the estimate per GPU)"
    ]
    lines.append(f"  {'':<12} {'at the peak':>12} {'own maximum':>13}   estimate")
    est = r["estimated"]
    shown_est = {**est, "total": est["peak"]}
    for part in (*PARTS, "total"):
        got = r["measured"].get(part, 0) / GiB
        own = r["category_maxima"].get(part)
        own_text = "-" if own is None else f"{own / GiB:9.3f} GiB"
        note = "   (estimate: the peak, before the allocator allowance)" if part == "total" else ""
        lines.append(
            f"  {part:<12} {got:8.3f} GiB {own_text:>13}   {shown_est[part] / GiB:8.3f} GiB{note}"
        )
    lines.append("not seen by the trace (add on top):")
    for a in r["allowances"]:
        high = "?" if a["high"] is None else f"{a['high'] / GiB:.2f}"
        lines.append(f"  {a['name']:<36} {a['low'] / GiB:.2f}-{high} GiB  {a['why']}")
    return "\n".join(lines)
