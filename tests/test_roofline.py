"""The roofline's prediction at achieved rates: the arithmetic on a hand-computed case, the order
of its ranges, the two MFU conventions, and the figure docs/performance.md states for 400m."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from scale_llm.analysis.roofline import (
    DEVICES,
    FUSED_ROW,
    RATES,
    Spread,
    _Counter,
    achieved,
    attention_rate,
    intensity,
    matmul_rate,
    roofline,
)
from scale_llm.config import load_config

REPO = Path(__file__).resolve().parents[1]
T = 1e12


def test_rates_are_the_published_figures_interpolated_by_shape():
    # a 16,384-row GEMM of two d_model=1024 operands: 16384*1024*1024 / (2*16384*1024 + 1024^2)
    assert intensity(16384, 1024, 1024) == pytest.approx(17179869184 / 34603008)
    # on an anchor: XLA's figures as they are (b=4: 673.8; b=2: 598.2 TFLOP/s)
    assert matmul_rate("H100-SXM", 16384, 1024, 1024) == Spread(598.2 * T, 673.8 * T, 673.8 * T)
    # between two anchors: linear in log intensity, here between (1024, 1024) and (1024, 2048)
    lo, hi, at = (intensity(16384, 1024, k) for k in (1024, 2048, 1448))
    share = math.log(at / lo) / math.log(hi / lo)
    point = 673.8 + share * ((720.5 + 687.9) / 2 - 673.8)
    assert matmul_rate("H100-SXM", 16384, 1024, 1448).point == pytest.approx(point * T)
    assert 0.4 < share < 0.6
    # beyond the table: flat at its ends
    assert matmul_rate("H100-SXM", 64, 64, 64) == matmul_rate("H100-SXM", 16384, 512, 512)
    # attention at head_dim 64, 1k tokens: FlashAttention-2's 192; cuDNN's forward 288 and
    # backward 348 weighted 1 : 2.5 by their FLOPs
    rate = attention_rate("H100-SXM", 64, 1024)
    assert (rate.low, rate.point) == (192 * T, 192 * T)
    assert rate.high == pytest.approx(3.5 / (1 / 288 + 2.5 / 348) * T)
    assert attention_rate("A100-80GB", 64, 1024) == Spread(119 * T, 119 * T, 119 * T)
    assert set(RATES) == set(DEVICES)


def test_the_prediction_adds_up_a_hand_computed_step():
    """One GEMM shape twice per micro-step, fused traffic of 1 ms, attention of 1 ms and an
    optimizer of 1 ms at the H100's point rates, over 3 micro-steps."""
    cfg = load_config(None, ["model.d_model=1024", "model.n_heads=16", "model.seq_len=1024"])
    counter = _Counter()
    counter.gemms[(16384, 1024, 1024)] = 2
    counter.fused_bytes = 2.97e9  # 1 ms at Azure's Triad 2.97 TB/s
    rows = {"attention": {"flops": 192e9}, "optimizer (AdamW)": {"bytes": 2.97e9}}
    a = achieved(cfg, counter, rows, 3, "H100-SXM", (1e12, 0.9e12))
    gemm_ms = 2 * 16384 * 1024 * 1024 / 673.8e12 * 1e3  # 0.050994 ms each
    assert a["classes"]["matmul"]["point"] == pytest.approx(3 * 2 * gemm_ms)
    assert a["classes"][FUSED_ROW]["point"] == pytest.approx(3.0)
    assert a["classes"]["attention"]["point"] == pytest.approx(1.0)
    assert a["classes"]["optimizer (AdamW)"]["point"] == pytest.approx(1.0)
    total = 6 * gemm_ms + 3 + 1 + 1  # 5.30597 ms
    assert a["ms"]["point"] == pytest.approx(total) == pytest.approx(5.30597, rel=1e-5)
    assert a["mfu"]["point"] == pytest.approx(1e12 / (total / 1e3) / 989e12)
    assert a["mfu_causal"]["point"] == pytest.approx(0.9e12 / (total / 1e3) / 989e12)
    # at the low rates: XLA's 598.2, FlashAttention-2's 192 again, Azure's Copy 2.90 TB/s
    slow = 6 * 2 * 16384 * 1024**2 / 598.2e12 * 1e3 + 3 * 2.97 / 2.90 + 1 + 2.97 / 2.90
    assert a["ms"]["low"] == pytest.approx(slow)


@pytest.fixture(scope="module")
def predictions():
    cfg = load_config(REPO / "yaml" / "400m.yaml", [])
    plan = (cfg.train.micro_batch_size, cfg.train.grad_accum)
    return {device: roofline(cfg, *plan, device) for device in ("H100-SXM", "H200")}


def test_ranges_are_ordered_and_the_causal_mfu_is_the_smaller(predictions):
    for r in predictions.values():
        a = r["achieved"]
        for ms in [a["ms"], *a["classes"].values()]:  # high rates: the fast end
            assert ms["high"] <= ms["point"] <= ms["low"]
        for mfu in (a["mfu"], a["mfu_causal"]):
            assert 0 < mfu["low"] <= mfu["point"] <= mfu["high"] < 1
        for way in ("low", "point", "high"):
            assert a["mfu_causal"][way] < a["mfu"][way]
        assert r["mfu_causal_eager"] < r["mfu_eager"]
        assert r["mfu_causal_matmul_bound"] < r["mfu_matmul_bound"]
        # the prediction sits between the two bounds
        assert r["matmul_bound_ms"] < a["ms"]["high"] <= a["ms"]["low"] < r["eager_ms"]


def test_the_doc_states_the_400m_prediction_the_code_makes(predictions):
    """docs/performance.md's table for 400m, row by row, as the command prints it (whole ms and
    percent): both bounds with their MFU in both conventions, the predicted step and its MFU,
    point and range, in both conventions."""
    doc = (REPO / "docs" / "performance.md").read_text()
    names = {"H100-SXM": "H100 SXM", "H200": "H200"}
    for device, r in predictions.items():
        row = re.search(rf"^\| {names[device]} \| (.+) \|$", doc, re.MULTILINE)
        assert row, f"no prediction row for {names[device]} in docs/performance.md"
        a = r["achieved"]
        stated = {
            "bounds": [
                tuple(map(int, m)) for m in re.findall(r"(\d+) ms, (\d+)% / (\d+)%", row[1])
            ],
            "step": [tuple(map(int, m)) for m in re.findall(r"(\d+) ms \((\d+)-(\d+)\)", row[1])],
            "mfu": [tuple(map(int, m)) for m in re.findall(r"(\d+)% \((\d+)-(\d+)%\)", row[1])],
        }
        pct = lambda x: round(100 * x)  # noqa: E731
        made = {
            "bounds": [
                (round(r["eager_ms"]), pct(r["mfu_eager"]), pct(r["mfu_causal_eager"])),
                (
                    round(r["matmul_bound_ms"]),
                    pct(r["mfu_matmul_bound"]),
                    pct(r["mfu_causal_matmul_bound"]),
                ),
            ],
            "step": [(round(a["ms"]["point"]), round(a["ms"]["high"]), round(a["ms"]["low"]))],
            "mfu": [
                tuple(pct(mfu[way]) for way in ("point", "low", "high"))
                for mfu in (a["mfu"], a["mfu_causal"])
            ],
        }
        assert stated == made, f"{names[device]}: the doc says {stated}, the code {made}"


def test_parallel_traffic_of_the_70b_layout():
    """70b.yaml on 64 GPUs: tensor parallelism's 8 collectives per block of the (8, 4096, 8192)
    bf16 activations and 4 more for the recomputed forward, 1/2 of each sent, every micro-step;
    FSDP2's 16-bit gathers (forward and backward) and fp32 reduce-scatter of one rank's 1/2 of
    the model over 32 ranks; one reduction per step without reduce_every_micro_step."""
    from scale_llm.analysis.memory import ParamCounts
    from scale_llm.analysis.roofline import parallel_traffic
    from scale_llm.config import with_changes

    cfg = load_config(REPO / "yaml" / "70b.yaml")
    assert cfg.parallel.tensor_parallel == 2 and cfg.activation_checkpointing.mode == "full"
    r = parallel_traffic(cfg, 64, 8, 2)
    assert r["tp_bytes"] == 2 * 12 * 80 * 2 * 8 * 4096 * 8192 / 2
    local = ParamCounts.of(cfg.model, 2).total
    assert r["fsdp_bytes"] == pytest.approx(2 * 8 * local * 31 / 32)
    once = with_changes(cfg, {"parallel.fsdp.reduce_every_micro_step": False})
    assert parallel_traffic(once, 64, 8, 2)["fsdp_bytes"] == pytest.approx(
        (2 * 4 + 4) * local * 31 / 32
    )
    assert parallel_traffic(cfg, 2, 1, 1)["fsdp_bytes"] == 0  # tp ranks only: no FSDP2


def test_a_tensor_parallel_rank_multiplies_all_tokens_by_a_slice_of_the_wider_side():
    from scale_llm.analysis.roofline import tp_shape

    assert tp_shape((4096, 28672, 8192), 8, 4096) == (4096, 3584, 8192)  # SwiGLU up, column
    assert tp_shape((4096, 8192, 28672), 8, 4096) == (4096, 8192, 3584)  # down, row-wise
    assert tp_shape((28672, 8192, 4096), 8, 4096) == (3584, 8192, 4096)  # its weight gradient
    assert tp_shape((4096, 8192, 8192), 1, 4096) == (4096, 8192, 8192)


def test_tensor_parallel_collectives_are_exposed_and_fsdp_only_beyond_the_compute():
    from scale_llm.analysis.roofline import FSDP_ROW, TP_ROW, _split_over_tp

    classes = {
        "matmul": {"low": 900.0, "point": 800.0, "high": 700.0},  # already one rank's
        "attention": {"low": 400.0, "point": 400.0, "high": 200.0},
        "optimizer (AdamW)": {"low": 64.0, "point": 64.0, "high": 64.0},
    }
    traffic = {"tp_ms": 50.0, "fsdp_ms": 1000.0}
    out = _split_over_tp(classes, traffic, tp=4, shards=16)
    assert out["attention"]["point"] == 100.0 and out["optimizer (AdamW)"]["point"] == 1.0
    assert out[TP_ROW]["point"] == 50.0
    assert out[FSDP_ROW] == {"low": 0.0, "point": 99.0, "high": 249.0}  # 1000 - compute
    hidden = _split_over_tp(classes, {"tp_ms": 0.0, "fsdp_ms": 500.0}, tp=4, shards=16)
    assert hidden[FSDP_ROW]["point"] == 0.0
