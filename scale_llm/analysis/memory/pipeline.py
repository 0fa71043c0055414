"""Per-GPU memory of a pipeline-parallel layout: the worst rank's.

A rank holds its stages' blocks (`stages_per_rank` chunks of at most the largest stage's
blocks), sharded by FSDP2 over the stage's data-parallel ranks, and the saved activations of
every piece its schedule has run forward but not yet backward. The first pipeline rank has the
most in flight (1F1B: one piece per stage after it; GPipe and looped BFS: all of them). The
estimate is that rank's, counted on the safe side: its chunks are all the largest stage's size,
and the embedding, the head and one piece's loss are counted on it too (the first stage holds
the embedding, the last the head and the loss; at this scale they are a few GiB).
"""

from __future__ import annotations

import dataclasses

from scale_llm.analysis.memory.activations import (
    block_input_bytes,
    kept_per_block,
    numerics_for,
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
from scale_llm.parallel.pipeline import stage_blocks


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


def pipeline_estimate(cfg: Config, plan: RunPlan, lay: Layout) -> Estimate:
    """The first pipeline rank's estimate: its chunks' states and one piece's step (the base
    estimator on a model of its blocks), plus the other in-flight pieces' saved activations."""
    m, ac, pipe = cfg.model, cfg.activation_checkpointing, cfg.parallel.pipeline
    chunks, pieces = plan.pp_stages_per_rank, plan.pp_microbatches
    stages = plan.pp_degree * chunks
    largest = max(len(b) for b in stage_blocks(m.n_layers, stages, pipe.layers_per_stage))
    rank_model = dataclasses.replace(m, n_layers=largest * chunks)
    piece = max(1, lay.micro_batch // pieces)
    est = estimate_layout(rank_model, ac, dataclasses.replace(lay, micro_batch=piece))
    num = numerics_for(
        lay.precision, lay.backend, lay.fused_norm, lay.tp, lay.sequence_parallel, bool(lay.fp8)
    )
    chunk = dataclasses.replace(m, n_layers=largest)
    waiting = block_input_bytes(chunk, piece, num) + sum(kept_per_block(chunk, ac, piece, num))
    others = (in_flight(pipe.schedule, plan.pp_degree, chunks, pieces) - 1) * waiting
    for name, parts in est.parts.items():
        if name != "optimizer step":  # (every piece's backward has run by then)
            parts["activations"] += others
    est.phases = {name: sum(parts.values()) for name, parts in est.parts.items()}
    gpu = est.gpu
    gpu["activations"] = max(p["activations"] for p in est.parts.values())
    gpu["peak"] = max(est.phases.values())
    gpu["overhead"] = OVERHEAD_FRACTION * gpu["peak"]
    gpu["total"] = gpu["peak"] + gpu["overhead"]
    est.params, est.model, est.layout = ParamCounts.of(m).total, m, lay  # (the whole micro-batch)
    return est
