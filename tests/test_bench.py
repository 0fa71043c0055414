"""`bench --sweep`'s predicted columns under a pipeline: each is the worst pipeline rank's."""

from __future__ import annotations

import dataclasses

import pytest

from scale_llm.config import load_config
from scale_llm.config.plan import Launch, resolve_plan
from tests.helpers import REPO


def test_a_pipelines_composite_norm_column_is_its_worst_ranks(monkeypatch):
    """A pipeline rank computes its stages' norms at a piece's size: the composite-norm peak is
    the pipeline estimate's with the composite norm, not the whole model's at the micro-batch.
    tiny.yaml (6 blocks) at PP 2, ZBV, 4 pieces of one sequence, full checkpointing."""
    from scale_llm.analysis import bench as bench_module
    from scale_llm.analysis.memory.estimate import GiB, estimate_layout
    from scale_llm.analysis.memory.pipeline import pipeline_estimate

    sets = ["parallel.backend=fsdp", "parallel.pipeline_parallel=2", "model.tie_embeddings=false"]
    sets += ["parallel.pipeline.schedule=zero_bubble", "model.n_layers=6"]
    cfg = load_config(REPO / "yaml" / "tiny.yaml", sets)
    monkeypatch.setattr("scale_llm.components.distributed.start", lambda plan: None)
    monkeypatch.setattr(bench_module, "bench", lambda *a, **k: {})  # predictions only
    plan = resolve_plan(cfg, Launch(world_size=2))
    (row,) = bench_module.bench_sweep(cfg, plan, [4], ["full"], [False])
    p = dataclasses.replace(plan, micro_batch_size=4, grad_accum=1)
    c = load_config(REPO / "yaml" / "tiny.yaml", [*sets, "activation_checkpointing.mode=full"])
    est = pipeline_estimate(c, p, dataclasses.replace(row_layout(c, p), fused_norm=False))
    assert row["predicted_peak_composite_norm_gib"] == pytest.approx(est.gpu["peak"] / GiB)
    fused = row["predicted_peak_gib"]
    assert fused < row["predicted_peak_composite_norm_gib"] < 1.2 * fused
    # the whole model at the whole micro-batch: 78.7 MiB against the rank's 57.9
    whole = estimate_layout(c.model, c.activation_checkpointing, row_layout(c, p, False))
    assert row["predicted_peak_composite_norm_gib"] < 0.8 * whole.gpu["peak"] / GiB


def row_layout(cfg, plan, fused: bool = True):
    from scale_llm.analysis.memory.estimate import layout_of

    return dataclasses.replace(layout_of(cfg, plan), fused_norm=fused)
