"""The estimate against a whole optimizer step traced at full size on fake tensors
(`scale_llm.analysis.memory.fake`): 125m.yaml as shipped (micro-batch 32, no checkpointing),
FSDP2 at 8 ranks of a fake process group on tiny-fsdp.yaml, and FSDP2 x tensor parallelism at 4.
The trace counts every fake storage as a CPU measurement counts real ones
(`measure.LiveStorages`)."""

from __future__ import annotations

import pytest

from scale_llm.analysis.memory.fake import format_trace, trace_step
from scale_llm.config import load_config, with_changes
from scale_llm.errors import UserError
from tests.helpers import REPO


def assert_parts(r: dict, rel: float) -> None:
    """Each part alive at the traced peak within `rel` of the estimate's peak phase (64 KiB
    for a part near zero), and the step's peak within `rel` of the estimated one."""
    got, est = r["measured"], r["estimated_peak_parts"]
    for part, expected in est.items():
        assert abs(got[part] - expected) <= max(rel * got[part], 64 << 10), (part, got, est)
    peak = got["allocated_peak"]
    assert r["estimated"]["peak"] == pytest.approx(peak, rel=rel), (peak, r["estimated"])
    assert got["total"] >= 0.999 * peak  # the parts were read at that peak


def test_125m_traced_on_fake_tensors_has_the_estimated_parts():
    r = trace_step(load_config(REPO / "yaml" / "125m.yaml"), world_size=1)
    got, est = r["measured"], r["estimated"]
    assert (r["backend"], r["precision"], r["micro_batch_size"]) == ("single", "bf16", 32)
    # the peak is the loss's backward: fp32 params and AdamW's moments, every saved activation
    # (the logits the chunked loss keeps included), the logits' gradient and the loss's fp32
    # chunk in flight, and no parameter gradient yet (measured 2026-12-01: each within 0.02%)
    assert r["peak_phase"] == "loss backward"
    assert_parts(r, 0.01)
    assert got["grads"] == 0 and got["optimizer"] == pytest.approx(2 * got["params"], rel=1e-3)
    # the sum of the parts' own largest would be above the peak by a set of gradients
    parts = sum(est[k] for k in ("params", "grads", "optimizer", "activations", "temporaries"))
    assert parts > est["peak"] + 0.9 * est["grads"]
    assert "rank 0 of 1" in format_trace(r)


def test_fsdp2_at_8_fake_ranks_holds_an_eighth_of_the_states():
    cfg = with_changes(load_config(REPO / "yaml" / "tiny-fsdp.yaml"), {"train.micro_batch_size": 2})
    r = trace_step(cfg, world_size=8)
    got, est = r["measured"], r["estimated"]
    assert r["backend"] == "fsdp" and r["world_size"] == 8
    # fp32 shards of 1/8 of the parameters and of AdamW's moments
    assert got["optimizer"] == pytest.approx(est["optimizer"], rel=0.01)
    assert_parts(r, 0.05)


def test_fsdp2_x_tensor_parallel_at_4_fake_ranks_peaks_where_the_estimate_says():
    """FSDP2 2 x TP 2 with sequence parallelism, GQA: the optimizer state is 1/4 of the model's
    (the norms' 1/2), and the step's peak is the estimate's within 6% (at this size the loss's
    vocab-sharded buffers are most of it, and the estimate sits 5% above the trace; at 70B,
    yaml/70b.yaml at 64 fake ranks, the trace is 1.0% under it: docs/memory.md)."""
    cfg = with_changes(
        load_config(REPO / "yaml" / "tiny.yaml"),
        {
            "parallel.backend": "fsdp",
            "parallel.tensor_parallel": 2,
            "model.n_kv_heads": 2,
            "train.micro_batch_size": 2,
        },
    )
    r = trace_step(cfg, world_size=4)
    got, est = r["measured"], r["estimated"]
    assert r["backend"] == "fsdp" and r["world_size"] == 4
    assert got["optimizer"] == pytest.approx(est["optimizer"], rel=0.01)
    assert r["estimated"]["peak"] == pytest.approx(got["allocated_peak"], rel=0.06)


def test_deepspeed_is_refused_with_the_fix():
    cfg = load_config(REPO / "yaml" / "tiny-deepspeed.yaml")
    with pytest.raises(UserError, match="parallel.backend=fsdp"):
        trace_step(cfg, world_size=2)


# tiny.yaml as PP 2 x FSDP2 2, 1F1B, a micro-batch of 8 cut into 4 pieces of 2 sequences
PIPELINE = {
    "parallel.backend": "fsdp",
    "parallel.pipeline_parallel": 2,
    "model.tie_embeddings": False,
    "train.micro_batch_size": 8,
    "parallel.pipeline.microbatches": 4,
}


@pytest.mark.parametrize("rank", [0, 1])
def test_a_pipeline_rank_traced_alone_peaks_where_its_estimate_says(rank):
    """One pipeline rank's step traced alone: its stage built and sharded as the trainer
    does, torch's 1F1B schedule run with its sends done at once (their works kept as torch
    keeps them) and its receives' buffers made by the stage. The first rank holds
    2 pieces in flight at its first backward (1F1B's warm-up forwards), the last one
    (forward, backward at once) with the logits; each within 5% of its rank's estimate
    (measured 2026-12-05: rank 0 -2.9%, rank 1 -2.5%). A replay of one piece at a time
    would come a piece's activations under the first rank's peak: more than the 5%."""
    from scale_llm.analysis.memory.pipeline import in_flight

    cfg = with_changes(load_config(REPO / "yaml" / "tiny.yaml"), PIPELINE)
    r = trace_step(cfg, world_size=4, pipeline_rank=rank)
    got, est = r["measured"], r["estimated_peak_parts"]
    assert (r["pipeline_rank"], r["pipeline_stages"], r["rank"]) == (rank, [rank], 2 * rank)
    peak = got["allocated_peak"]
    assert r["estimated"]["peak"] == pytest.approx(peak, rel=0.05), (peak, r["estimated"])
    assert got["activations"] == pytest.approx(est["activations"], rel=0.05), (got, est)
    pieces = in_flight("1f1b", 2, 1, 4, rank)
    assert pieces == 2 - rank
    one_piece = est["activations"] / pieces
    if pieces > 1:  # the pieces in flight are what the trace must see
        assert one_piece > 0.1 * peak
    assert f"pipeline rank {rank} (" in format_trace(r)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_pipeline_x_tensor_parallel_rank_peaks_where_its_estimate_says(rank):
    """PP 2 x TP 2. Tensor parallelism is applied to the whole model on the meta device before
    the split, which makes new (meta) shards inside the fake mode: they hold no memory, so the
    first rank's traced parameters are its stage's (5.1 MB counting every block's, 3.6 est.).
    The last stage gathers the whole vocabulary's logits for the loss (torch's stages cannot
    run the vocabulary-parallel loss backward). Each rank within 5% (measured 2026-12-05:
    -0.9% and -1.2%; -15% and -22% counting the other stage's shards and sharded logits)."""
    cfg = with_changes(
        load_config(REPO / "yaml" / "tiny.yaml"),
        {**PIPELINE, "parallel.tensor_parallel": 2, "model.n_kv_heads": 2},
    )
    r = trace_step(cfg, world_size=4, pipeline_rank=rank)
    got, est = r["measured"], r["estimated_peak_parts"]
    if rank == 0:
        assert got["params"] <= est["params"], (got, est)
    assert r["estimated"]["peak"] == pytest.approx(got["allocated_peak"], rel=0.05)


def test_a_pipeline_ranks_trace_keeps_its_sends_as_torchs_works_do(monkeypatch):
    """torch 2.13's interleaved 1F1B waits every send when the step ends, and a send's work
    (gloo's, NCCL's) keeps the tensor it sends as long as the schedule keeps the work; the
    fake trace's works do too. Rank 1 (stages 1 and 3) peaks with seven sends held (stage 1's
    outputs of pieces 0 and 1, the gradients of B3.0-B3.2 and B1.0-B1.1), a piece's bf16
    residual stream each (2 x 256 x 192), which the estimate counts: within 5% of it
    (measured 2026-12-05: +2.1%; +5.6% with works holding nothing, as the trace had them)."""
    from scale_llm.analysis.memory import fake

    changes = {**PIPELINE, "parallel.pipeline.schedule": "interleaved_1f1b"}
    cfg = with_changes(load_config(REPO / "yaml" / "tiny.yaml"), changes)
    r = trace_step(cfg, world_size=4, pipeline_rank=1)
    peak = r["measured"]["allocated_peak"]
    assert r["estimated"]["peak"] == pytest.approx(peak, rel=0.05), (peak, r["estimated"])

    class Forgotten(fake._HeldSend):  # a work that keeps nothing
        def __init__(self, op) -> None:
            self.tensor = None

    monkeypatch.setattr(fake, "_HeldSend", Forgotten)
    bare = trace_step(cfg, world_size=4, pipeline_rank=1)["measured"]["allocated_peak"]
    assert peak - bare == 7 * 2 * 256 * 192 * 2


def test_a_pipeline_trace_defaults_to_the_worst_rank():
    cfg = with_changes(
        load_config(REPO / "yaml" / "tiny.yaml"),
        {**PIPELINE, "parallel.pipeline.schedule": "gpipe"},  # (every piece in flight)
    )
    r = trace_step(cfg, world_size=4)
    assert r["pipeline_rank"] == r["worst_pipeline_rank"]
    assert "the estimate's worst" in format_trace(r)
    assert r["estimated"]["peak"] == pytest.approx(r["measured"]["allocated_peak"], rel=0.05)
