"""The estimate against a whole optimizer step traced at full size on fake tensors
(`scale_llm.memory.fake`): 125m.yaml as shipped (micro-batch 32, no checkpointing), and FSDP2 at
8 ranks of a fake process group on tiny-fsdp.yaml."""

from __future__ import annotations

import pytest

from scale_llm.config import load_config, with_changes
from scale_llm.memory.fake import format_trace, trace_step


def _close(got: int, want: float, rel: float) -> bool:
    return abs(got - want) <= rel * want


def test_125m_traced_on_fake_tensors_has_the_estimated_parts():
    r = trace_step(load_config("yaml/125m.yaml"), world_size=1)
    got, own, est = r["measured"], r["category_maxima"], r["estimated"]
    assert (r["backend"], r["precision"], r["micro_batch_size"]) == ("single", "bf16", 32)
    # model states: fp32 params, fp32 grads (after the backward), AdamW's two moments
    for part in ("params", "grads", "optimizer"):
        assert _close(own[part], est[part], 0.01), (part, own[part], est[part])
    assert got["grads"] == 0  # the peak is at the start of backward, before any gradient
    # what the forward keeps (incl. the logits the chunked loss keeps), and the loss's backward
    # (the logits' gradient and its fp32 chunks) in flight at the peak
    assert _close(got["activations"], est["activations"], 0.01), (got, est)
    assert _close(got["temporaries"], est["temporaries"], 0.02), (got, est)
    # the estimate's peak (the loss's backward, the largest of the step's phases) is the traced
    # peak within 2%; the sum of the parts' own maxima would be above it by a set of gradients
    assert _close(est["peak"], got["total"], 0.02), (got["total"], est["peak"])
    assert r["peak_phase"] == "loss backward"
    assert "rank 0 of 1" in format_trace(r)


def test_fsdp2_at_8_fake_ranks_holds_an_eighth_of_the_states():
    cfg = with_changes(load_config("yaml/tiny-fsdp.yaml"), {"train.micro_batch_size": 2})
    r = trace_step(cfg, world_size=8)
    got, own, est = r["measured"], r["category_maxima"], r["estimated"]
    assert r["backend"] == "fsdp" and r["world_size"] == 8
    assert _close(own["optimizer"], est["optimizer"], 0.01), (own["optimizer"], est["optimizer"])
    # fp32 shards plus the gathered bf16 root and block and the next all-gather output (params,
    # exact); the largest unit's unsharded gradients (an upper bound: +8.6% here)
    assert _close(own["params"], est["params"], 0.01), (own["params"], est["params"])
    assert own["grads"] <= est["grads"] <= 1.1 * own["grads"], (own["grads"], est["grads"])
    assert _close(own["activations"], est["activations"], 0.01), (own, est)
    assert _close(est["peak"], got["total"], 0.05), (got["total"], est["peak"])  # +1.9% here


def test_deepspeed_is_refused_with_the_fix():
    cfg = load_config("yaml/tiny-deepspeed.yaml")
    with pytest.raises(Exception, match="parallel.backend=fsdp"):
        trace_step(cfg, world_size=2)
