"""Per-GPU memory of a pipeline-parallel layout: every pipeline rank's, and the worst one.

A rank holds its stages' blocks (looped: stages r, r + pp, ...; the V schedules: r and
2 pp - 1 - r), the embedding if it holds the first stage, the final norm, head and loss if it
holds the last, all sharded by FSDP2 over the stage's data-parallel ranks; and the saved
activations of every piece its schedule has run forward but not yet backward (1F1B: pp - r on
rank r, so the first rank has the most; GPipe and looped BFS: all of them; the last stage's
pieces keep their logits too). Each rank's estimate is the base estimator's on a model of that
rank's blocks at one piece's size, plus the other in-flight pieces; the layout's is the worst.
"""

from __future__ import annotations

import dataclasses

from scale_llm.analysis.memory.activations import (
    head_activation_bytes,
    kept_per_block,
    numerics_for,
    resident_input_bytes,
)
from scale_llm.analysis.memory.estimate import (
    OVERHEAD_FRACTION,
    Estimate,
    Layout,
    ParamCounts,
    estimate_layout,
)
from scale_llm.config import Config
from scale_llm.config.parallel import V_SCHEDULES
from scale_llm.config.plan import RunPlan
from scale_llm.parallel.pipeline import stage_blocks, stage_owner


def in_flight(schedule: str, pp: int, chunks: int, microbatches: int, rank: int = 0) -> int:
    """Chunk-pieces whose saved activations pipeline rank `rank` holds at once at most: the
    forwards its schedule runs before that rank's first backward, plus that one (torch
    2.13's orders: Schedule1F1B, the interleaved schedules' _get_warmup_ops, ZBV's warm-up)."""
    m = microbatches
    if schedule in ("gpipe", "looped_bfs"):
        return m * chunks  # every forward before any backward
    if schedule == "1f1b":
        return min(m, pp - rank)
    if schedule in V_SCHEDULES:  # chunk 0's 2 (pp - r) - 1, then r of both, then chunk 1's
        return min(2 * m, 3 * pp - rank - 1 + 1)
    per_round = m // max(1, m // pp)
    return min(m * chunks, (chunks - 1) * per_round + 2 * (pp - 1 - rank) + 1)


def rank_estimate(cfg: Config, plan: RunPlan, lay: Layout, rank: int) -> Estimate:
    """Pipeline rank `rank`'s estimate: its stages' states and one piece's step (the base
    estimator on a model of its blocks) with the other in-flight pieces' saved activations, at
    the larger of two moments: its first backward (the most pieces in flight, no gradients
    yet) and a later one (gradients accumulated, one piece fewer unless forwards remain)."""
    m, ac, pipe = cfg.model, cfg.activation_checkpointing, cfg.parallel.pipeline
    chunks, pieces = plan.pp_stages_per_rank, plan.pp_microbatches
    stages = plan.pp_degree * chunks
    blocks = stage_blocks(m.n_layers, stages, pipe.layers_per_stage)
    mine = [s for s in range(stages) if stage_owner(s, plan, pipe.schedule) == rank]
    first, last = 0 in mine, stages - 1 in mine
    rank_model = dataclasses.replace(m, n_layers=sum(len(blocks[s]) for s in mine))
    piece = max(1, lay.micro_batch // pieces)
    piece_lay = dataclasses.replace(lay, micro_batch=piece, holds_embedding=first, holds_head=last)
    num = numerics_for(
        lay.precision, lay.backend, lay.fused_norm, lay.tp, lay.sequence_parallel, bool(lay.fp8)
    )
    # one chunk-piece's saved activations, on average over the rank's chunks
    saved = sum(kept_per_block(rank_model, ac, piece, num))
    if last:
        saved += head_activation_bytes(m, piece, num) - resident_input_bytes(m, piece)
    waiting = saved / chunks
    most = in_flight(pipe.schedule, plan.pp_degree, chunks, pieces, rank)
    est = _with_in_flight(estimate_layout(rank_model, ac, piece_lay), (most - 1) * waiting, 0.0)
    if pieces > 1:
        # torch's stages run every backward but the last without FSDP2's reduction: each piece
        # is a micro-step accumulating whole gradients; the sharded ones are made after the last
        later = dataclasses.replace(
            piece_lay,
            grad_accum=lay.grad_accum * pieces,
            fsdp_reduce_every=lay.fsdp_reduce_every and lay.backend != "fsdp",
        )
        n = ParamCounts.of(rank_model, lay.tp, first, last).total
        sharded = 4.0 * n / lay.shards if lay.backend == "fsdp" else 0.0
        fewer = most if pieces * chunks > most else most - 1  # (a forward follows a backward)
        est_later = _with_in_flight(
            estimate_layout(rank_model, ac, later), (fewer - 1) * waiting, sharded
        )
        est = max(est, est_later, key=lambda e: e.gpu["peak"])
    est.params, est.model, est.layout = ParamCounts.of(m).total, m, lay  # (the whole micro-batch)
    return est


def _with_in_flight(est: Estimate, others: float, not_yet: float) -> Estimate:
    """`est` with `others` bytes of saved activations more until the optimizer step (every
    piece's backward has run by then) and `not_yet` gradient bytes less before it."""
    for name, parts in est.parts.items():
        if name != "optimizer step":
            parts["activations"] += others
            parts["grads"] -= not_yet
    est.phases = {name: sum(parts.values()) for name, parts in est.parts.items()}
    gpu = est.gpu
    gpu["activations"] = max(p["activations"] for p in est.parts.values())
    gpu["peak"] = max(est.phases.values())
    gpu["overhead"] = OVERHEAD_FRACTION * gpu["peak"]
    gpu["total"] = gpu["peak"] + gpu["overhead"]
    return est


def pipeline_estimate(cfg: Config, plan: RunPlan, lay: Layout) -> Estimate:
    """The worst pipeline rank's estimate, with every rank's beside it (`pipeline_ranks`)."""
    ranks = [rank_estimate(cfg, plan, lay, r) for r in range(plan.pp_degree)]
    worst = max(range(len(ranks)), key=lambda r: ranks[r].gpu["peak"])
    est = ranks[worst]
    est.pipeline_ranks, est.pipeline_rank = ranks, worst
    return est
