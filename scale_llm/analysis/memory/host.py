"""Host memory: the estimate against what this host has free, checked before anything is
allocated (a model too large for the host swaps, or is killed by the kernel's OOM killer, with
no message): a CPU run's whole step, a GPU run's start-up (the model is built on the host
first). Train and bench call it alike."""

from __future__ import annotations

import os

from scale_llm.analysis.memory.estimate import GiB
from scale_llm.analysis.memory.gpu import estimate
from scale_llm.components.hardware import host_available_bytes
from scale_llm.config import Config
from scale_llm.config.plan import RunPlan
from scale_llm.errors import UserError, short


def host_memory_problem(
    cfg: Config, plan: RunPlan, models: int = 1, staging: int | None = None
) -> str | None:
    """Why `cfg` would not fit in this host's free memory on the CPU (None: it fits, it runs on
    a GPU, or the free memory is unknown). `models`: copies of the model this process holds;
    `staging`: host copies for background checkpoint writes (default: checkpoint.async_mode's)."""
    available = host_available_bytes()
    if available is None:
        return None
    if plan.device.type != "cpu":
        return startup_problem(cfg, plan, available)
    if staging is None:
        staging = 0 if cfg.checkpoint.async_mode == "disabled" else 1
    est = estimate(cfg, plan)
    copies_bytes = staging * checkpoint_state_bytes(cfg, plan, est.params)
    per_rank = (est.gpu["total"] + sum(est.cpu.values())) * models + copies_bytes
    need = per_rank * plan.world_size  # CPU ranks share this host
    if need <= available:
        return None
    m = cfg.model
    copies = f", {models} models at once" if models > 1 else ""
    if staging:
        copies += (
            f", {staging} host {'copy' if staging == 1 else 'copies'} of the model and "
            f"optimizer state for background checkpoint writes "
            f"({copies_bytes * plan.world_size / GiB:,.1f} GiB; checkpoint.async_mode)"
        )
    return (
        f"this run needs about {need / GiB:,.1f} GiB of host memory (`scale-llm estimate` "
        f"with these settings: {est.params / 1e6:,.0f}M parameters, d_model {m.d_model}, "
        f"{m.n_layers} layers, micro-batch {plan.micro_batch_size} x seq_len {m.seq_len}, "
        f"{plan.world_size} process(es){copies}) but {available / GiB:,.1f} GiB is available; "
        f"shrink the model or train.micro_batch_size, or run on a GPU"
    )


def checkpoint_state_bytes(cfg: Config, plan: RunPlan, params: int) -> float:
    """Bytes of one rank's model and optimizer state as a checkpoint holds them: fp32 weights
    and AdamW's two fp32 moments (12 bytes a parameter), split over FSDP's shards."""
    shards = 1
    if plan.backend == "fsdp":
        shards = max(1, plan.world_size // cfg.parallel.fsdp.replicate_degree)
    return 12.0 * params / shards


def check_host_memory(
    cfg: Config, plan: RunPlan, models: int = 1, staging: int | None = None
) -> None:
    """Stop with the estimate, before the model is built, when a CPU run cannot fit the host."""
    problem = host_memory_problem(cfg, plan, models, staging)
    if problem:
        raise UserError(problem)


def startup_problem(cfg: Config, plan: RunPlan, available: int) -> str | None:
    """Why the ranks of this host cannot build the model in its memory (a GPU run: the model
    is built on the host first, whole or one parameter at a time; `estimate` says how much)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "1") or "1"  # (torchrun's ranks per node)
    if not (local.isascii() and local.isdigit() and int(local) >= 1):
        raise UserError(
            f"LOCAL_WORLD_SIZE={short(local, 40)} is not a number of processes on this host: "
            f"unset it, or start the run with the scripts in launch/ (torchrun sets it)"
        )
    local = int(local)
    need = estimate(cfg, plan).startup_host * local
    if need <= available:
        return None
    fix = "use more nodes (fewer ranks a host) or a host with more memory"
    if plan.backend != "fsdp":
        fix = "parallel.backend=fsdp builds each rank's shard, one parameter at a time"
    return (
        f"building the model needs about {need / GiB:,.1f} GiB of this host's memory ({local} "
        f"rank(s) here, {need / local / GiB:,.1f} GiB each: `scale-llm estimate`) but "
        f"{available / GiB:,.1f} GiB is available; {fix}"
    )
