"""The human report with its hints, and the plan that fits a memory budget."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from itertools import product
from operator import attrgetter
from typing import Any

from scale_llm.analysis.memory.estimate import (
    OVERHEAD_FRACTION,
    PARTS,
    Estimate,
    format_offload_traffic,
    gib,
)
from scale_llm.analysis.memory.gpu import estimate
from scale_llm.config import Config, validate, with_changes
from scale_llm.config.plan import RunPlan, launch_problems, target_plan
from scale_llm.errors import UserError

_DESCRIPTIONS = {
    "params": "parameter storage (fp32 master weights, 16-bit copies, shards or gathered blocks)",
    "grads": "gradients",
    "optimizer": "AdamW moments (and DeepSpeed's fp32 master weights)",
    "activations": "saved for backward at their largest (incl. the logits the loss keeps, "
    "a recomputed block, autocast weight copies)",
    "temporaries": "largest set in flight: the logits' gradient and the loss's fp32 chunk, or "
    "a block's backward",
    "peak": "the largest sum alive at once over the step (the parts above do not peak together)",
    "overhead": f"allocator allowance: {OVERHEAD_FRACTION:.0%} of the peak",
}


def format_overrides(changes: dict[str, Any]) -> str:
    shown = {k: str(v).lower() if isinstance(v, bool) else v for k, v in changes.items()}
    return " ".join(f"--set {k}={v}" for k, v in shown.items())


def hints(cfg: Config, plan: RunPlan) -> list[tuple[str, float]]:
    """(flags, predicted total) for the usual ways to save memory from this config."""
    ac, p, world = cfg.activation_checkpointing, cfg.parallel, plan.world_size
    options: list[tuple[dict[str, Any], str]] = []  # (changes, flags: "" for their --set flags)
    if ac.mode != "full":
        options.append(({"activation_checkpointing.mode": "full"}, "--grad-checkpointing"))
    if ac.mode in ("none", "every_k"):
        options.append(({"activation_checkpointing.mode": "selective"}, ""))
    if plan.micro_batch_size > 1:
        mb = plan.micro_batch_size // 2
        accum = plan.grad_accum * plan.micro_batch_size // mb
        same = mb * accum == plan.micro_batch_size * plan.grad_accum
        if same and mb % plan.pp_microbatches == 0:  # (a pipeline's pieces stay whole)
            changes = {"train.micro_batch_size": mb, "train.grad_accum": accum}
            options.append((changes, f"--batch_size {mb} --grad-accum {accum}"))
    if p.backend in ("auto", "single", "ddp") and world > 1:
        options.append(({"parallel.backend": "fsdp"}, ""))
    if p.backend == "deepspeed" and p.deepspeed.zero_stage < 3:
        options.append(({"parallel.deepspeed.zero_stage": p.deepspeed.zero_stage + 1}, ""))
    # (no hint the config refuses: selective under a V schedule, a batch a pipeline cannot cut)
    out = []
    for changes, flags in options:
        if validate(changed := with_changes(cfg, changes)):
            continue
        try:  # (one the launch refuses: static_graph with grad_accum, a replicate_degree)
            out.append((flags or format_overrides(changes), estimate(changed, world).total))
        except UserError:
            continue
    return out


def format_report(est: Estimate, cfg: Config, plan: RunPlan, source: str) -> str:
    m, lay, ac = est.model, est.layout, est.ac
    lines = [
        f"memory estimate for {source}: {est.params / 1e6:.1f}M parameters; {lay.describe()}",
        f"  micro_batch {lay.micro_batch} x seq_len {m.seq_len}, attention {m.attention}, "
        f"activation_checkpointing {ac.mode}" + (f" (k={ac.k})" if ac.mode == "every_k" else ""),
        "per GPU:",
    ]
    for key in (*PARTS, "peak", "overhead"):
        at = f": at the {est.peak_phase}" if key == "peak" else ""
        lines.append(f"  {key:<12} {gib(est.gpu[key]):>12}   {_DESCRIPTIONS[key]}{at}")
    lines.append(f"  {'total':<12} {gib(est.total):>12}")
    if est.pipeline_ranks:  # (the figures above are the worst rank's)
        peaks = ", ".join(f"{r}: {gib(e.gpu['peak'])}" for r, e in enumerate(est.pipeline_ranks))
        lines.append(f"the worst pipeline rank's: {est.pipeline_rank} (each rank's peak: {peaks})")
    if cpu := ", ".join(f"{k} {gib(v)}" for k, v in est.cpu.items() if v):
        lines.append(f"per rank in CPU memory (offloaded): {cpu}")
    built = "the whole fp32 model, built on the CPU before it moves to the GPU"
    if lay.backend == "fsdp":
        built = "its fp32 shards, filled one whole parameter at a time"
    lines.append(f"per rank in host memory at start-up: {gib(est.startup_host)} ({built})")
    if traffic := format_offload_traffic(est):
        lines.append(traffic)
    options = [(flags, total) for flags, total in hints(cfg, plan) if total < est.total]
    if options:
        lines.append("to reduce:")
        for flags, total in sorted(options, key=lambda o: o[1]):
            lines.append(f"  {flags:<48} total {gib(total)} ({gib(total - est.total)})")
    return "\n".join(lines)


MAX_WORLD = 1024  # the largest world searched for the smallest one a layout resolves on


def _resolves(cfg: Config, world: int) -> bool:
    try:
        target_plan(cfg, world)
    except UserError:
        return False
    return True


def world_for_estimate(cfg: Config, config: str | None) -> tuple[int, str | None]:
    """The world size `estimate` predicts for when neither --world-size nor $WORLD_SIZE says:
    parallel.world_size, else 1; and a line saying so (None for 1 without sharding). A layout
    that needs more than one GPU and states no world is a UserError naming the command."""
    name = config or "the default config"
    if (documented := cfg.parallel.world_size) is not None:
        return documented, (
            f"world size {documented}: the layout {name} is written for (parallel.world_size); "
            f"--world-size N for N GPUs"
        )
    if _resolves(cfg, 1):
        if cfg.parallel.backend not in ("fsdp", "deepspeed"):
            return 1, None
        return 1, (  # a sharding backend: per-GPU memory depends on N
            f"world size 1 (the default), though parallel.backend={cfg.parallel.backend} "
            f"shards over the GPUs; --world-size N for N GPUs"
        )
    smallest = next((w for w in range(2, MAX_WORLD + 1) if _resolves(cfg, w)), None)
    if smallest is None:
        target_plan(cfg, 1)  # no world fixes it: the plan's own error
    command = " ".join(["scale-llm estimate", *([config] if config else []), "--world-size"])
    raise UserError(
        f"{name} is laid out for more than one GPU (the smallest world it resolves on is "
        f"{smallest}); give the GPUs the run will use: {command} {smallest}"
    )


# Rough throughput cost of each choice (1.0 = free); the plan picks the cheapest layout that fits.
_AC_COST = {"none": 1.0, "selective": 1.1, "every_k": 1.17, "full": 1.33}  # recompute share
_MICRO_BATCH_COST = {1: 1.25, 2: 1.1}  # small micro-batches leave a GPU underused (else 1.0)


def _shard_options(cfg: Config) -> list[tuple[dict[str, Any], float]]:
    """Backend settings from least to most memory-saving, with their rough cost."""
    b = cfg.parallel.backend
    kept = {"parallel.backend": "fsdp", "parallel.fsdp.reshard_after_forward": False}
    resharded = {**kept, "parallel.fsdp.reshard_after_forward": True}
    fsdp = [(kept, 1.02), (resharded, 1.1), ({**resharded, "parallel.fsdp.cpu_offload": True}, 1.6)]

    def zero(stage: int, optimizer: str = "none", param: str = "none") -> dict[str, Any]:
        # each layout says its offload, or the base config's would leak into e.g. ZeRO-0
        keys = ("zero_stage", "offload_optimizer", "offload_param")
        ds = {f"parallel.deepspeed.{k}": v for k, v in zip(keys, (stage, optimizer, param))}
        return {"parallel.backend": "deepspeed", **ds}

    ds = [(zero(s), c) for s, c in ((0, 1.0), (1, 1.0), (2, 1.02), (3, 1.1))]
    ds += [(zero(2, "cpu"), 1.5), (zero(3, "cpu"), 1.6)]
    last = (zero(3, "cpu", "cpu"), 2.0)
    if b == "deepspeed":
        return [*ds, last]
    if cfg.parallel.pipeline_parallel > 1:  # (a pipeline's stages are sharded by FSDP2 only)
        return fsdp
    if b == "fsdp":
        return [*fsdp, last]
    return [({"parallel.backend": b}, 1.0), *fsdp, last]


def _tried(options: list[Plan]) -> str:
    """The most memory-saving layout among `options` (the candidates the config accepts)."""
    changes = [o.changes for o in options]
    if any(c.get("parallel.deepspeed.offload_param") == "cpu" for c in changes):
        return "even with DeepSpeed ZeRO-3, optimizer and parameter offload"
    if any(c.get("parallel.fsdp.cpu_offload") for c in changes):
        return "even with FSDP2 and CPU offload"
    return "with every layout the config accepts"


@dataclass
class Plan:
    changes: dict[str, Any]
    estimate: Estimate
    cost: float


def fit(cfg: Config, target: RunPlan | int, budget: int, keep_backend: bool = False) -> Plan:
    """The cheapest layout (by the rough cost model above) whose estimate fits in `budget`,
    keeping micro_batch x grad_accum. `keep_backend` (a launched run: its process group
    exists) varies only checkpointing and micro-batch."""
    plan = target_plan(cfg, target) if isinstance(target, int) else target
    per_rank = plan.micro_batch_size * plan.grad_accum
    pieces = plan.pp_microbatches  # (a pipeline cuts each micro-batch into that many pieces)
    small = [d for d in range(1, math.isqrt(per_rank) + 1) if per_rank % d == 0]
    divisors = sorted({*small, *(per_rank // d for d in small)}, reverse=True)
    micro_batches = [d for d in divisors if d % pieces == 0]
    shards = [({}, 1.0)] if keep_backend else _shard_options(cfg)
    options: list[Plan] = []
    refused: list[UserError] = []
    grid = product(shards, _AC_COST.items(), micro_batches)
    for (shard, shard_cost), (mode, ac_cost), mb in grid:
        batch = {"train.micro_batch_size": mb, "train.grad_accum": per_rank // mb}
        changes = {**shard, "activation_checkpointing.mode": mode, **batch}
        if mode == "every_k":
            changes["activation_checkpointing.k"] = 2
        if validate(proposed := with_changes(cfg, changes)):  # (e.g. selective, V schedule)
            continue
        if problems := launch_problems(proposed, plan.world_size, plan.device.type == "cuda"):
            refused.append(UserError("; ".join(problems)))  # (static_graph with grad_accum)
            continue
        planned = plan.world_size  # (a hypothetical layout: planned afresh)
        if "parallel.backend" not in shard:  # a launched run: its own plan, this batch split
            planned = dataclasses.replace(plan, micro_batch_size=mb, grad_accum=per_rank // mb)
        try:
            est = estimate(proposed, planned)
        except UserError as e:  # a layout this machine cannot run (CPU offload on a CPU)
            refused.append(e)
            continue
        options.append(Plan(changes, est, shard_cost * ac_cost * _MICRO_BATCH_COST.get(mb, 1.0)))
    if not options and refused:
        raise refused[0]
    fitting = [o for o in options if o.estimate.total <= budget]
    if not fitting:
        smallest = min(options, key=lambda o: o.estimate.total)
        tried = f"with backend {plan.backend} as launched" if keep_backend else _tried(options)
        sharding = ", a sharding backend (`scale-llm estimate CONFIG --fit SIZE` proposes one)"
        raise UserError(
            f"nothing fits in {gib(budget)} per GPU, {tried}, full activation checkpointing "
            f"and micro-batch {min(micro_batches)}: the smallest total reachable is "
            f"{gib(smallest.estimate.total)} ({format_overrides(smallest.changes)}). "
            f"Use more GPUs{sharding if keep_backend else ''}, a shorter model.seq_len or a "
            f"smaller model"
        )
    # the batch split as the plan resolved it (grad_accum derived from a global batch size)
    now = {"train.micro_batch_size": plan.micro_batch_size, "train.grad_accum": plan.grad_accum}
    same = lambda key, v: (now[key] if key in now else attrgetter(key)(cfg)) == v  # noqa: E731
    derived = {"train.grad_accum"} if cfg.train.global_batch_size is not None else set()
    best = min(fitting, key=lambda o: (o.cost, sum(not same(*kv) for kv in o.changes.items())))
    best.changes = {  # (a tie above: the config's own values)
        key: v for key, v in best.changes.items() if not same(key, v) and key not in derived
    }
    return best
