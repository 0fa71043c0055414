"""A whole optimizer step traced at full size on fake tensors, next to the estimate for the GPUs.

`estimate CONFIG --fake [--world-size N]` builds the model and backend as the trainer does under
`FakeTensorMode` (no storage: a 7B model costs seconds) and runs `measure.measured_steps` (single,
or FSDP2 as rank 0 of a fake process group). Under pipeline parallelism it is one pipeline rank's
first rank (`--pipeline-rank R`, default the worst), its stages' schedule run alone (`_alone`).
Fake CPU tensors (a CPU torch cannot take fake CUDA ones through a backward) with a CUDA run's
choices; compiled blocks run eager, grad_accum is 1, DeepSpeed is not traced (docs/memory.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from scale_llm.analysis.memory.gpu import estimate
from scale_llm.analysis.memory.measure import LiveStorages, in_phase, measured_steps, parts_table
from scale_llm.components.optim import build_optimizer
from scale_llm.config import Config, with_changes
from scale_llm.config.plan import RunPlan, target_plan
from scale_llm.errors import UserError
from scale_llm.model import build_model, materialize
from scale_llm.parallel.backend import Backend, build_backend
from scale_llm.parallel.pipeline import stage_owner

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


MAX_FAKE_WORLD = 1024  # ranks --fake traces rank 0 of (at 1,000: within 0.7% of the estimate)


def fake_plan(
    cfg: Config, world_size: int, pipeline_rank: int | None
) -> tuple[Config, RunPlan, RunPlan]:
    """(the config traced, the GPUs' plan the estimate is for, the plan the trace runs on the
    CPU); a layout --fake cannot trace refused (before any other work of the command)."""
    if world_size > MAX_FAKE_WORLD:  # (its fake process group: time grows with every rank)
        raise UserError(
            f"estimate --fake --world-size {world_size:,}: the trace shards over a fake process "
            f"group of every rank, whose time grows with them (42 s at 8,192 on 2 CPU cores, "
            f"minutes past it); trace at most {MAX_FAKE_WORLD:,} ranks, or leave --fake out "
            f"(the estimate alone takes any world size)"
        )
    here = _traced_config(cfg, world_size)
    target = target_plan(here, world_size)  # what the estimate is for: bf16 CUDA GPUs
    plan = dataclasses.replace(target, device=torch.device("cpu"))  # what the trace runs
    if plan.backend not in ("single", "fsdp"):
        raise UserError(
            f"estimate --fake traces parallel.backend single (world 1) and fsdp, not "
            f"{plan.backend}; use --world-size 1 or --set parallel.backend=fsdp"
        )
    _check_rank(pipeline_rank, plan)
    return here, target, plan


def trace_step(
    cfg: Config, world_size: int = 1, pipeline_rank: int | None = None
) -> dict[str, Any]:
    """One optimizer step of `cfg` on rank 0 of `world_size` GPUs traced on fake tensors, in
    `measure_step`'s shape (with the allowances), next to the estimate for those GPUs. Under
    pipeline parallelism the rank is the first of pipeline rank `pipeline_rank` (default: the
    one the estimate names worst), its schedule run without the other stages (`_alone`)."""
    here, target, plan = fake_plan(cfg, world_size, pipeline_rank)
    # the trace runs the CPU's kernels, which save what CUDA's do (RMSNorm: its input, rstd)
    est, worst = estimate(with_changes(here, {"train.device": "cuda"}), target), None
    if plan.pp_degree > 1:
        worst = est.pipeline_rank
        rank = worst if pipeline_rank is None else pipeline_rank
        est = est.pipeline_ranks[rank]
        plan = dataclasses.replace(plan, rank=rank * (world_size // plan.pp_degree))
    measured = _traced(here, plan)
    return {
        "backend": plan.backend,
        "precision": plan.precision,
        "activation_checkpointing": here.activation_checkpointing.mode,
        "micro_batch_size": plan.micro_batch_size,
        "world_size": world_size,
        "rank": plan.rank,
        **({} if worst is None else _pipeline_facts(here, plan, worst)),
        "measured": measured,
        "estimated": {k: int(v) for k, v in est.gpu.items()},
        "estimated_peak_parts": {k: int(v) for k, v in est.peak_parts.items()},
        "peak_phase": est.peak_phase,
        "allowances": [
            {"name": n, "low": lo, "high": hi, "why": why} for n, lo, hi, why in ALLOWANCES
        ],
    }


def _traced(here: Config, plan: RunPlan) -> dict[str, int]:
    """`measured_steps` of `here` run as `plan` on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def batches():
        shape = (plan.micro_batch_size, here.model.seq_len + 1)
        tokens = torch.randint(0, here.model.vocab_size, shape, device=plan.device)
        return [(tokens[:, :-1], tokens[:, 1:])]

    with _fake_process_group(plan), _fake_pipeline_sends():
        backend = build_backend(here, plan)
        model = build_model(here.model)  # on meta, outside the mode: materialized inside it
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode, LiveStorages(fake=True) as storages:  # before the weights are drawn
            model = _setup(backend, model, plan)
            if plan.pp_degree > 1:
                _alone(backend, plan, storages)
            return measured_steps(storages, backend, model, batches)


def _check_rank(rank: int | None, plan: RunPlan) -> None:
    if rank is not None and plan.pp_degree == 1:
        raise UserError(
            f"--pipeline-rank {rank} picks a rank of a pipeline, and this layout "
            f"has none (parallel.pipeline_parallel=1); leave --pipeline-rank out"
        )
    if rank is not None and not 0 <= rank < plan.pp_degree:
        raise UserError(
            f"--pipeline-rank {rank} is not a rank of this pipeline "
            f"(parallel.pipeline_parallel={plan.pp_degree}); use 0 to {plan.pp_degree - 1}"
        )


def _pipeline_facts(cfg: Config, plan: RunPlan, worst: int) -> dict[str, Any]:
    """Which pipeline rank was traced, its stages, and the rank the estimate names worst."""
    schedule = cfg.parallel.pipeline.schedule
    stages = plan.pp_degree * plan.pp_stages_per_rank
    mine = [s for s in range(stages) if stage_owner(s, plan, schedule) == plan.pp_rank]
    return {
        "pipeline_rank": plan.pp_rank,
        "worst_pipeline_rank": worst,
        "pipeline_stages": mine,
        "pipeline_schedule": schedule,
        "pipeline_microbatches": plan.pp_microbatches,
    }


def _traced_config(cfg: Config, world_size: int) -> Config:
    changes = {"train.compile": False, "train.grad_accum": 1, "train.global_batch_size": None}
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

    dist.init_process_group("fake", store=FakeStore(), rank=plan.rank, world_size=plan.world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor's sharding decisions are cached by mesh shape, and hold this group's meshes:
        # a later trace (another layout, another pipeline rank) would run on destroyed groups
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()


def _setup(backend: Backend, model: torch.nn.Module, plan: RunPlan) -> torch.nn.Module:
    """backend.setup(model), but for the steps a fake run cannot take as they are, and with
    the fused AdamW a CUDA run builds."""
    if hasattr(backend, "device_mesh"):  # FSDP2
        # the mesh is a small real tensor of ranks that FakeTensorMode cannot read back
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            mesh = backend.device_mesh()
        backend.device_mesh = lambda: mesh
        # each rank's fill of its shards from whole parameters: values only
        backend._fill_shards = lambda module, initial, whole=None: None
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


class _HeldSend:
    """A point-to-point op's work as gloo's and NCCL's are: a send's keeps the tensor it sends
    alive for as long as the schedule keeps the work, waited or not (torch 2.13's
    `_PipelineScheduleRuntime` and GPipe keep every send's until the step ends, 1F1B one at a
    time). A receive's holds nothing more: its buffer is the stage's."""

    def __init__(self, op: Any) -> None:
        self.tensor = op.tensor if op.op is torch.distributed.isend else None

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _fake_pipeline_sends() -> contextlib.AbstractContextManager:
    """torch's schedules with every send and receive done at once: each goes through
    `_batch_p2p`, whose works the schedule keeps (`_HeldSend`: a send's tensor stays alive
    where the real one would), and a receive's buffer is the fake tensor the stage made for it
    already."""
    from torch.distributed.pipelining import schedules

    return mock.patch.object(
        schedules, "_batch_p2p", lambda ops, desc=None: [_HeldSend(op) for op in ops]
    )


def _alone(backend: Backend, plan: RunPlan, storages: LiveStorages) -> None:
    """This pipeline rank's schedule runs alone: its stages told the shapes they receive and
    send (what torch's stages otherwise learn from their neighbours), and the storages' phase
    set around each stage's forward and backward (the schedule calls them, not the model)."""
    from torch.distributed.pipelining._utils import InferenceMode, _StageMeta, extract_tensor_metas

    schedule = backend.schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        stage._user_meta = _StageMeta(
            inputs=extract_tensor_metas(_stage_tensors(backend, plan, stage.is_first)),
            outputs=extract_tensor_metas(_stage_tensors(backend, plan, stage.is_last)),
        )
        stage.submod.register_forward_pre_hook(lambda *_: setattr(storages, "phase", "forward"))
        stage.submod.register_forward_hook(lambda *_: setattr(storages, "phase", "other"))
        for name in ("backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, in_phase(storages, "backward", getattr(stage, name)))

    def static(stages: list, *_: Any) -> None:  # (in place of the neighbours' vote)
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = static


def _stage_tensors(backend: Backend, plan: RunPlan, end: bool) -> tuple[torch.Tensor]:
    """What a stage receives or sends: the residual stream of one piece, (piece, T, d_model)
    (T / tp under sequence parallelism) in the compute dtype; at the pipeline's ends the
    tokens or logits, whose shapes the schedule does not read."""
    m, piece = backend.cfg.model, plan.micro_batch_size // plan.pp_microbatches
    seq = m.seq_len // plan.tp_degree if backend.cfg.parallel.sequence_parallel else m.seq_len
    dtype = backend.mp_policy().param_dtype or torch.float32
    with torch._subclasses.fake_tensor.unset_fake_temporarily():  # (metadata: not counted)
        if end:
            return (torch.empty(piece, m.seq_len, dtype=torch.long, device="meta"),)
        return (torch.empty(piece, seq, m.d_model, dtype=dtype, device="meta").requires_grad_(),)


def _real_mesh_concatenation() -> contextlib.AbstractContextManager:
    """FSDP2 joins its data-parallel mesh to a parameter's tensor-parallel one, which indexes
    the ranks' small real tensor: done outside the fake mode, as the mesh itself was."""
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = DeviceMesh._concatenate

    def outside_fake(meshes):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            return concatenate(meshes)

    return mock.patch.object(DeviceMesh, "_concatenate", staticmethod(outside_fake))


def format_trace(r: dict[str, Any]) -> str:
    """The trace next to the estimate, as format_measurement prints a CPU measurement."""
    lines = [
        f"traced on fake tensors: one optimizer step, {r['backend']}, {r['precision']}, "
        f"checkpointing {r['activation_checkpointing']}, micro-batch {r['micro_batch_size']}, "
        f"{_which_rank(r)} (what is alive at the step's peak, next to the estimate of its "
        f"peak, {r['peak_phase']})",
        *parts_table(r, "; the estimate before the allocator allowance"),
        "not seen by the trace (add on top):",
    ]
    for a in r["allowances"]:
        high = "?" if a["high"] is None else f"{a['high'] / GiB:.2f}"
        lines.append(f"  {a['name']:<36} {a['low'] / GiB:.2f}-{high} GiB  {a['why']}")
    return "\n".join(lines)


def _which_rank(r: dict[str, Any]) -> str:
    if "pipeline_rank" not in r:
        return f"rank {r['rank']} of {r['world_size']}"
    stages = ", ".join(map(str, r["pipeline_stages"]))
    worst = "the estimate's worst; " if r["pipeline_rank"] == r["worst_pipeline_rank"] else ""
    return (
        f"pipeline rank {r['pipeline_rank']} ({worst}stages {stages}; {r['pipeline_schedule']}, "
        f"{r['pipeline_microbatches']} pieces a schedule run), rank {r['rank']} of "
        f"{r['world_size']}"
    )
