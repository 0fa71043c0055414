"""Memory: the activation prediction against bytes really saved for backward, the per-backend
state accounting, the fit plan, and the command line."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scale_llm.analysis.memory import (
    Numerics,
    ParamCounts,
    ds_reduce_buckets,
    estimate,
    fit,
    measure_saved_bytes,
    parse_bytes,
    saved_activation_bytes,
    zero3_gathered_params,
)
from scale_llm.config import ModelConfig, load_config, with_changes
from scale_llm.config.parallel import ActivationCheckpointingConfig as AC
from scale_llm.errors import UserError
from scale_llm.model import build_model
from scale_llm.parallel.activation_checkpointing import apply_activation_checkpointing
from scale_llm.parallel.compile import compile_blocks

REPO = Path(__file__).resolve().parents[1]
MODES = ["none", "full", "every_k", "selective"]
NUMERICS = {  # (fused_norm: the CPU's RMSNorm saves what CUDA's fused kernel does)
    "fp32": Numerics(4, 4, False, fused_norm=True),
    "autocast-bf16": Numerics(2, 4, True, fused_norm=True),  # single / DDP
    "bf16-module": Numerics(2, 2, False, fused_norm=True),  # FSDP mixed precision, DeepSpeed bf16
}
SHAPES = {
    "tiny": dict(vocab_size=512, d_model=64, n_layers=3, n_heads=4, seq_len=32),
    "gqa": dict(vocab_size=2048, d_model=192, n_layers=3, n_heads=6, n_kv_heads=2, seq_len=48),
    "untied": dict(
        vocab_size=4096, d_model=256, n_layers=2, n_heads=8, seq_len=40, tie_embeddings=False
    ),
}


def counted(cfg: ModelConfig, ac: AC, batch: int, numerics: str, base=None) -> int:
    torch.manual_seed(0)
    if base is not None:  # reuse the weights of a large model: no second init
        model = build_model(cfg)
        model.load_state_dict(base.state_dict(), assign=True)
    else:
        model = build_model(cfg, "cpu")
    if numerics == "bf16-module":
        model = model.to(torch.bfloat16)
    apply_activation_checkpointing(model, ac)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if numerics == "autocast-bf16" else None
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1))
    return measure_saved_bytes(model, tokens, autocast)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_predicted_activations_match_counted_bytes(shape, attention):
    # every precision on the small shape; the autocast path (the common one) on the others
    numerics_list = list(NUMERICS) if shape == "tiny" else ["autocast-bf16"]
    for mode, numerics, batch in itertools.product(MODES, numerics_list, [1, 2]):
        cfg, ac = ModelConfig(**SHAPES[shape], attention=attention), AC(mode=mode)
        got = counted(cfg, ac, batch, numerics)
        predicted = saved_activation_bytes(cfg, ac, batch, NUMERICS[numerics])
        assert abs(predicted / got - 1) < 0.05, (mode, numerics, batch, got, predicted)


def test_compiled_blocks_save_no_more_than_the_estimate():
    """train.compile: inductor's partitioner saves less than eager (it recomputes cheap ops);
    the eager prediction stays an upper bound, and is exact where only block inputs are kept.
    Measured: none saves 9.6% less compiled here in fp32, 9.0% in bf16 (15% before the CPU's
    RMSNorm saved what CUDA's does), full checkpointing the same within 0.8% (the compiled loss
    keeps slightly more)."""
    import torch._dynamo

    cfg = ModelConfig(vocab_size=2048, d_model=128, n_layers=2, n_heads=4, seq_len=64)
    for mode, numerics in [("none", "fp32"), ("full", "fp32"), ("none", "autocast-bf16")]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model(cfg, "cpu")
        apply_activation_checkpointing(model, AC(mode=mode))
        compile_blocks(model)
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16) if numerics == "autocast-bf16" else None
        )
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
        got = measure_saved_bytes(model, tokens, autocast, compiled=True)
        predicted = saved_activation_bytes(cfg, AC(mode=mode), 2, NUMERICS[numerics])
        print(f"\ncompiled {mode} {numerics}: saved {got}, eager prediction {predicted}")
        if mode == "full":
            assert abs(got / predicted - 1) < 0.01, (mode, got, predicted)
        else:
            assert 0.6 * predicted < got < predicted, (mode, numerics, got, predicted)


@pytest.fixture(scope="module")
def model_400m_dims():
    """400m.yaml's widths (d_model 1024, 16 heads, vocab 32000, untied), 2 blocks, short seq."""
    cfg = ModelConfig(
        vocab_size=32000, d_model=1024, n_layers=2, n_heads=16, seq_len=64, tie_embeddings=False
    )
    return cfg, build_model(cfg, "cpu")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", MODES)
def test_prediction_at_400m_dimensions(model_400m_dims, attention, mode):
    base_cfg, base = model_400m_dims
    cfg, ac = ModelConfig(**{**base_cfg.__dict__, "attention": attention}), AC(mode=mode)
    for batch in (1, 2) if attention == "sdpa" else (1,):
        got = counted(cfg, ac, batch, "autocast-bf16", base)
        predicted = saved_activation_bytes(cfg, ac, batch, NUMERICS["autocast-bf16"])
        assert abs(predicted / got - 1) < 0.05, (batch, got, predicted)


def test_checkpointing_modes_order_the_savings():
    cfg = ModelConfig(**SHAPES["tiny"])
    saved = {}
    for mode in MODES:
        saved[mode] = counted(cfg, AC(mode=mode), 2, "fp32")
    assert saved["none"] > saved["every_k"] > saved["full"]
    assert saved["none"] > saved["selective"] > saved["full"]


def cfg_with(*overrides: str):
    return load_config(REPO / "yaml" / "400m.yaml", list(overrides))


def test_state_bytes_per_backend():
    P = estimate(cfg_with(), 2).params
    ddp_est = estimate(cfg_with(), 2)
    ddp = ddp_est.gpu
    # fp32 params + grads (DDP's bucket views, kept between steps) + 2 moments
    assert ddp_est.layout.grad_accum > 1
    assert ddp["params"] + ddp["grads"] + ddp["optimizer"] == 16 * P
    no_view = estimate(cfg_with("parallel.ddp.gradient_as_bucket_view=false"), 2).gpu
    assert no_view["grads"] == 2 * ddp["grads"]  # buckets and .grad
    fsdp = estimate(cfg_with("parallel.backend=fsdp"), 8).gpu
    assert fsdp["optimizer"] == 8 * P / 8
    zero = {
        s: estimate(cfg_with("parallel.backend=deepspeed", f"parallel.deepspeed.zero_stage={s}"), 8)
        for s in range(4)
    }
    totals = [
        zero[s].gpu["params"] + zero[s].gpu["grads"] + zero[s].gpu["optimizer"] for s in range(4)
    ]
    assert totals[0] == 16 * P  # 2 (bf16 params) + 2 (grads) + 12 (fp32 master + moments)
    # ZeRO-1 reduces into gradient partitions through the same buckets as ZeRO-2, but with
    # grad_accum > 1 it accumulates whole 16-bit gradients between micro-steps (measured with
    # DeepSpeed 0.19 on 2 gloo ranks)
    # ZeRO-2 in bf16 also sums the micro-steps in an fp32 partition (the generated config's
    # data_types.grad_accum_dtype; ZeRO-1 sums in its whole 16-bit gradients)
    assert zero[1].layout.grad_accum > 1 and totals[1] == totals[2] + 2 * P - 4 * P / 8
    buckets = 2 * 2 * 50_000_000  # two bf16 reduce buckets of reduce_bucket_size elements
    assert totals[2] == 2 * P + (2 + 4 + 4 + 12) * P / 8 + buckets
    # ZeRO-3: one bucket (fp32: the generated config's communication_data_type), an fp32
    # gradient partition (its grad_accum_dtype) and the 16-bit parameters held gathered
    held = zero3_gathered_params(ParamCounts.of(zero[3].model), zero[3].layout)
    assert totals[3] == pytest.approx((2 + 4 + 4 + 12) * P / 8 + held + buckets, rel=1e-9)
    assert totals[0] > totals[2]
    off = estimate(
        cfg_with(
            "parallel.backend=deepspeed",
            "parallel.deepspeed.zero_stage=3",
            "parallel.deepspeed.offload_optimizer=cpu",
            "parallel.deepspeed.offload_param=cpu",
        ),
        8,
    )
    assert off.gpu["optimizer"] == 0 and off.cpu["optimizer"] == 12 * P / 8
    assert off.total < zero[3].total


def test_checkpointing_and_micro_batch_move_the_total():
    base = estimate(cfg_with("activation_checkpointing.mode=none"), 2)
    full = estimate(cfg_with("activation_checkpointing.mode=full"), 2)
    half = estimate(cfg_with("activation_checkpointing.mode=none", "train.micro_batch_size=4"), 2)
    assert full.gpu["activations"] < base.gpu["activations"] / 5
    assert half.gpu["activations"] < base.gpu["activations"]
    assert base.gpu["params"] == full.gpu["params"]


def test_fit_prefers_cheap_layouts_and_keeps_the_batch():
    cfg = cfg_with("activation_checkpointing.mode=full")
    t = cfg.train
    roomy = fit(cfg, 2, parse_bytes("80GiB"))
    assert roomy.changes.get("activation_checkpointing.mode") == "none"  # no recompute needed
    mb = roomy.changes.get("train.micro_batch_size", t.micro_batch_size)
    assert mb * roomy.changes.get("train.grad_accum", t.grad_accum) == (
        t.micro_batch_size * t.grad_accum
    )
    tight = fit(cfg, 2, parse_bytes("6GiB"))
    assert tight.estimate.total <= parse_bytes("6GiB")
    assert tight.changes  # something had to change
    # on a CPU: the FSDP2 CPU-offload layouts are skipped, not the whole fit refused
    on_cpu = fit(cfg_with("train.device=cpu"), 1, parse_bytes("80GiB"))
    assert on_cpu.estimate.total <= parse_bytes("80GiB")
    assert not on_cpu.changes.get("parallel.fsdp.cpu_offload")
    # a config that fits is kept (the largest micro-batch of a tie moved 125m from 23 to 43 GiB)
    shipped = load_config(REPO / "yaml" / "125m.yaml")
    assert fit(shipped, 1, parse_bytes("80GiB")).changes == {}
    # accepted counts: the micro-batch divisors of 2^26 (a loop over every number took 41 s)
    many = fit(with_changes(shipped, {"train.grad_accum": 2**26}), 1, parse_bytes("80GiB"))
    assert many.changes == {}
    # what the launch refuses is neither proposed nor a hint that ends the command (a static
    # graph with grad_accum: `train --fit` proposed it, then exited 2; `estimate` failed on it)
    from scale_llm.analysis.memory.plan import hints
    from scale_llm.config.plan import target_plan

    static = cfg_with("parallel.ddp.static_graph=true", "train.grad_accum=1")
    launched = target_plan(static, 2)
    tight = fit(static, launched, parse_bytes("12GiB"), keep_backend=True)
    assert tight.changes.get("train.grad_accum", 1) == 1, tight.changes
    assert [flags for flags, _ in hints(static, launched)] == [
        "--grad-checkpointing",
        "--set activation_checkpointing.mode=selective",
        "--set parallel.backend=fsdp",
    ]


def test_impossible_fit_names_the_smallest_total():
    with pytest.raises(UserError, match=r"nothing fits in 0.25 GiB.*smallest total reachable is"):
        fit(cfg_with(), 2, parse_bytes("256MiB"))
    with pytest.raises(UserError) as e:  # it tried them: no advice to try them
        fit(cfg_with(), 2, parse_bytes("256MiB"))
    assert "a sharding backend" not in str(e.value)


def test_memory_units():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("512mib") == 512 * 2**20
    assert parse_bytes("1000B") == 1000 and parse_bytes("5000000") == 5_000_000
    with pytest.raises(UserError, match="has no unit"):  # (--fit 80: 80 bytes)
        parse_bytes("1000")
    assert parse_bytes("500000", bare=True) == 500_000  # (export --max-shard-size: bytes)
    with pytest.raises(UserError, match="KiB, MiB, GiB, TiB"):
        parse_bytes("80 gigs")


def estimate_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "scale_llm", "estimate", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_estimate_measure_with_fake_refuses_an_untraceable_layout_before_measuring(
    monkeypatch, capsys
):
    """`--measure --fake` of a layout --fake cannot trace (DDP on 2 GPUs): refused first; the
    measure built, ran and measured a step before (minutes on a large model)."""
    from scale_llm import analysis, cli

    def measured(*_):
        raise AssertionError("--measure ran before --fake's refusal")

    monkeypatch.setattr(analysis.memory, "measure_activations", measured)
    tiny = ["--set", "model.n_layers=2", "--set", "model.d_model=64", "--set", "model.n_heads=4"]
    assert cli.main(["estimate", *tiny, "--measure", "--fake", "--world-size", "2"]) == 2
    assert "estimate --fake traces parallel.backend single" in capsys.readouterr().err
    # a budget nothing fits: said before --measure's work too (it measured first: 36 s, 4 GB)
    assert cli.main(["estimate", *tiny, "--measure", "--fit", "1MiB"]) == 2
    assert "nothing fits in" in capsys.readouterr().err


def test_estimate_command_json_and_fit(tmp_path):
    proc = estimate_cli(
        tmp_path, str(REPO / "yaml" / "400m.yaml"), "--world-size", "2", "--json", "--fit", "24GiB"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["params"] > 390e6
    assert {"params", "grads", "optimizer", "activations", "total"} <= out["bytes_per_gpu"].keys()
    assert out["fit"]["bytes_per_gpu"]["total"] <= 24 * 2**30
    assert out["fit"]["host_bytes_per_rank"] == 0
    # an offloading layout says what each rank then holds in host memory (70B on 2 GPUs: the
    # proposal fit the GPUs and left out about 0.5 TiB a rank of offloaded state)
    from scale_llm import cli

    args = [str(REPO / "yaml" / "70b.yaml"), "--world-size", "2", "--fit", "80GiB"]
    with contextlib.redirect_stdout(io.StringIO()) as text:
        assert cli.main(["estimate", *args]) == 0
    fits = next(line for line in text.getvalue().splitlines() if line.startswith("fits in"))
    assert re.search(r"; and \d+\.\d\d GiB of host memory per rank, offloaded$", fits), fits
    bad = estimate_cli(tmp_path, "--fit", "12 parsecs")
    assert bad.returncode == 2 and "'12 parsecs' is not understood" in bad.stderr


def test_fit_never_pins_a_grad_accum_the_global_batch_derives(capsys):
    """With train.global_batch_size set, the config's grad_accum is derived per world: --fit
    printed `--set train.grad_accum=N` (the value it already had, compared with the unset key),
    which then contradicted the global batch at any other world size."""
    from scale_llm import cli

    assert cli.main(["estimate", str(REPO / "yaml" / "70b.yaml"), "--fit", "60GiB"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("(no change needed)")
    seven = [str(REPO / "yaml" / "7b.yaml"), "--world-size", "8"]
    assert cli.main(["estimate", *seven, "--fit", "20GiB"]) == 0
    flags = capsys.readouterr().out.rstrip().splitlines()[-1].split()
    assert flags and "train.grad_accum" not in " ".join(flags)
    assert cli.main(["estimate", *seven[:1], "--world-size", "16", *flags]) == 0
    capsys.readouterr()
    # --measure of a tensor-parallel layout in one process: its refusal named the launch, not
    # the flag that asked for one
    assert cli.main(["estimate", str(REPO / "yaml" / "70b.yaml"), "--measure"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --measure runs the config's step in this process") and (
        "Leave --measure out" in err
    )


def test_estimate_measure_prints_the_step_next_to_the_estimate(capsys):
    """`estimate --measure` on a small real run: the activation count, then the whole step by
    part at the peak / the estimate's peak phase / each part's own largest, the peak's phase
    named, in text and JSON. (In this process; the JSON one counts activations eager: its
    assertions are the step's, and one inductor compile is enough.)"""
    from scale_llm import cli

    small = [a for s in SMALL_ARGS for a in ("--set", s)]
    assert cli.main(["estimate", *small, "--measure"]) == 0
    text = capsys.readouterr().out
    assert "the forward pass saved" in text
    assert "at the peak    estimated  own largest (est.)" in text
    assert "next to the estimate of its peak, loss forward)" in text
    eager = ["--set", "train.compile=false"]
    assert cli.main(["estimate", *small, *eager, "--measure", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    step = out["measured_step_cpu"]
    assert abs(step["measured"]["allocated_peak"] / step["estimated"]["peak"] - 1) < 0.02
    assert step["estimated_peak_parts"].keys() <= step["measured"].keys()
    assert out["peak_phase"] in out["phases"]


def test_human_report_ends_with_hints(tmp_path):
    proc = estimate_cli(
        tmp_path, str(REPO / "yaml" / "400m.yaml"), "--set", "activation_checkpointing.mode=none"
    )
    assert proc.returncode == 0, proc.stderr
    assert "total" in proc.stdout and "to reduce:" in proc.stdout
    t = cfg_with().train
    half = f"--batch_size {t.micro_batch_size // 2} --grad-accum {t.grad_accum * 2}"
    assert "--grad-checkpointing" in proc.stdout and half in proc.stdout


def test_roofline_counts_every_matmul_and_a_causal_flash_attention():
    from scale_llm.analysis.roofline import count_micro_step, roofline

    cfg = load_config(None, SMALL_ARGS)
    m, B, T = cfg.model, 3, cfg.model.seq_len
    flops, moved = count_micro_step(cfg, B)
    model = build_model(m)
    matmul_params = (model.flops_per_token() - 12 * m.n_layers * m.d_model * T) // 6
    assert flops["matmul"] == 6 * matmul_params * B * T  # forward + both backward matmuls
    causal_fwd = 2 * B * m.n_heads * T * T * (m.d_model // m.n_heads) * m.n_layers
    assert flops["attention"] == 3.5 * causal_fwd  # forward + 2.5x in backward
    assert moved["matmul"] > 0 and moved["element-wise and copies"] > 0
    recompute = load_config(None, [*SMALL_ARGS, "activation_checkpointing.mode=full"])
    assert count_micro_step(recompute, B)[0]["matmul"] > flops["matmul"]  # recompute counted
    r = roofline(cfg, B, 2)
    assert r["matmul_bound_ms"] < r["eager_ms"] and 0 < r["mfu_eager"] < r["mfu_matmul_bound"]


SMALL_ARGS = ["model.vocab_size=512", "model.d_model=64", "model.n_layers=2"]


@pytest.mark.parametrize("name", ["400m", "1b", "125m"])
def test_model_states_agree_with_deepspeeds_own_estimators(name, monkeypatch, capsys):
    """DeepSpeed's estimate_zero{2,3}_model_states_mem_needs (arithmetic on the parameter count)
    next to ours for the shipped configs at 2 and 8 GPUs, bf16, no offload. ZeRO-2: the same
    2P + 18P/N, besides the fp32 accumulation partition (4P/N) DeepSpeed's arithmetic leaves
    out. ZeRO-3: DeepSpeed's 18P/N + 4 B x its largest layer; ours is 18P/N, the fp32 gradient
    partition (4P/N) and the 16-bit parameters its coordinator holds gathered
    (`zero3_gathered_params`, measured on 2 ranks) instead of the largest layer."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    del deepspeed
    base = load_config(REPO / "yaml" / f"{name}.yaml", ["parallel.backend=deepspeed"])
    m = base.model
    largest = m.vocab_size * m.d_model  # the embedding (or the untied head)
    for world in (2, 8):
        ours = {}
        for stage in (2, 3):
            cfg = load_config(
                REPO / "yaml" / f"{name}.yaml",
                ["parallel.backend=deepspeed", f"parallel.deepspeed.zero_stage={stage}"],
            )
            est = estimate(cfg, world)  # DeepSpeed's estimators leave out the reduce buckets
            states = sum(est.gpu[k] for k in ("params", "grads", "optimizer"))
            ours[stage] = states - ds_reduce_buckets(est.layout)
            if stage == 2:  # ... and the fp32 accumulation partition (grad_accum_dtype fp32)
                ours[stage] -= 4 * est.params / world
        P = est.params
        _, ds2 = estimate_zero2_model_states_mem_needs(P, world, 1, cpu_offload=False)
        _, ds3, _ = estimate_zero3_model_states_mem_needs(P, largest, world, 1, cpu_offload=False)
        print(
            f"\n{name} world {world}: ZeRO-2 ours {ours[2] / 2**30:.2f} GiB, DeepSpeed "
            f"{ds2 / 2**30:.2f} GiB; ZeRO-3 ours {ours[3] / 2**30:.2f} GiB, DeepSpeed "
            f"{ds3 / 2**30:.2f} GiB"
        )
        assert ours[2] == pytest.approx(ds2, rel=1e-6)
        lay = est.layout
        held = zero3_gathered_params(ParamCounts.of(m), lay)
        # (its gradient partition in fp32: grad_accum_dtype)
        assert ours[3] == pytest.approx(ds3 - 4 * largest + 4 * P / world + held, rel=1e-6)


def test_train_fit_keeps_the_global_batch_and_the_backend(data_dir, tmp_path):
    from scale_llm.cli import fit_at_launch
    from tests.helpers import make_config, plan_for

    cfg = make_config(data_dir, tmp_path, "train.micro_batch_size=8", "train.grad_accum=2")
    plan = plan_for(cfg)
    roomy = estimate(cfg, plan).total
    smaller, new_plan = fit_at_launch(cfg, plan, f"{int(roomy * 0.7)}B")
    assert new_plan.sequences_per_step == plan.sequences_per_step == 16
    assert new_plan.backend == plan.backend and new_plan.precision == plan.precision
    assert estimate(smaller, new_plan).total <= roomy * 0.7
    assert (new_plan.micro_batch_size, smaller.activation_checkpointing.mode) != (8, "none")
    roomy_cfg, roomy_plan = fit_at_launch(cfg, plan, f"{int(roomy * 2)}B")
    assert roomy_plan.sequences_per_step == 16  # room to spare: the largest micro-batch, and
    assert roomy_cfg.activation_checkpointing.mode == "none"  # no recomputation


def assert_parts_at_the_peak(r: dict, name: str = "") -> None:
    """Each category alive at the measured peak within 3% of the estimate's peak phase (64 KiB
    for a category near zero), the step's peak within 2% of the estimated one, and the parts
    classified at that peak."""
    got, est = r["measured"], r["estimated_peak_parts"]
    peak = got["allocated_peak"]
    assert got["total"] >= 0.999 * peak, (name, got)  # classified at the peak
    for part, expected in est.items():
        assert abs(got[part] - expected) <= max(0.03 * got[part], 64 << 10), (name, part, got, est)
    assert r["estimated"]["peak"] == pytest.approx(peak, rel=0.02), (name, got, r["estimated"])


@pytest.mark.parametrize(
    ("precision", "ac", "micro", "phase"),
    [
        ("fp32", "none", 4, "loss forward"),
        ("fp32", "full", 1, "block 0 backward"),  # (fused AdamW steps in place)
        ("bf16", "selective", 2, "loss forward"),
    ],
)
def test_a_measured_step_has_the_estimated_parts_and_peak(precision, ac, micro, phase):
    """One real optimizer step (single backend, CPU), every storage counted from before the
    model was built: the estimate's peak phase is `phase`, and what is alive at the step's peak,
    by category, is what that phase holds (`assert_parts_at_the_peak`); each part's own largest
    is at least that; and the old total, a sum of per-part maxima, would be above the peak."""
    from scale_llm.analysis.memory.measure import measure_step
    from scale_llm.config import load_config
    from tests.measure_world import SHAPE  # the shape the 2-rank cases measure

    overrides = [
        *SHAPE,
        f"train.precision={precision}",
        f"activation_checkpointing.mode={ac}",
        f"train.micro_batch_size={micro}",
    ]
    r = measure_step(load_config(None, overrides))
    assert_parts_at_the_peak(r)
    got, est = r["measured"], r["estimated"]
    assert r["peak_phase"] == phase
    assert got["params"] > 0 and got["optimizer"] == pytest.approx(2 * got["params"], rel=0.01)
    assert got["activations"] > got["temporaries"] > 0
    assert all(est[k] >= r["estimated_peak_parts"][k] for k in r["estimated_peak_parts"])
    parts = sum(est[k] for k in ("params", "grads", "optimizer", "activations", "temporaries"))
    assert parts > est["peak"]


# 2 gloo ranks, one spawned world for all: every backend in fp32 without checkpointing and with
# full checkpointing and accumulation, and in bf16 (at half the micro-batch) under one of the
# three bf16 settings of docs/memory.md's table, each setting met by two backends: 18 cases.
# bf16 is emulated, ~8x slower than fp32, on CPUs without AVX-512 BF16. Measured 2026-12-01
# (commit 8f6c3a8, 36 cases): every peak within 0.25% of the estimate, every part at it within 2.2%
# (the largest: ZeRO-3's parameters; benchmarks/cpu-2core-avx512-memory-model.md)
WORLD_BACKENDS = [
    ["parallel.backend=ddp"],
    ["parallel.backend=fsdp"],
    ["parallel.backend=fsdp", "parallel.fsdp.reshard_after_forward=false"],
    ["parallel.backend=deepspeed", "parallel.deepspeed.zero_stage=1"],
    ["parallel.backend=deepspeed", "parallel.deepspeed.zero_stage=2"],
    ["parallel.backend=deepspeed", "parallel.deepspeed.zero_stage=3"],
]
FP32_SETTINGS = [
    ["train.precision=fp32"],
    ["train.precision=fp32", "activation_checkpointing.mode=full", "train.grad_accum=2"],
]
BF16_MICRO = "train.micro_batch_size=2"  # half the compute: bf16 is emulated on most CPUs
# the bf16 setting of each backend, in WORLD_BACKENDS' order. DeepSpeed's peak inside a
# checkpointed block's backward at micro-batch 2 falls on a moment that varies (a fresh-clone run
# once measured ZeRO-2 bf16 full, ga 2, 2.7 MiB above its usual peak): its full-checkpointing
# cases run in fp32 at micro-batch 4, where the estimate's moment holds
_NONE = ["train.precision=bf16", BF16_MICRO]
_FULL = [
    "train.precision=bf16",
    BF16_MICRO,
    "activation_checkpointing.mode=full",
    "train.grad_accum=2",
]
_SELECTIVE = ["train.precision=bf16", BF16_MICRO, "activation_checkpointing.mode=selective"]
BF16_SETTINGS = [_FULL, _SELECTIVE, _FULL, _NONE, _SELECTIVE, _NONE]
WORLD_CASES = [
    (b + c, 0.02)
    for b, bf16 in zip(WORLD_BACKENDS, BF16_SETTINGS, strict=True)
    for c in [*FP32_SETTINGS, bf16]
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, request) -> dict[str, list[dict]]:
    """tests/measure_world.py's results on 2 gloo ranks, {test: its cases' results}, for the
    cases of the selected tests below (every backend's; tensor parallelism's), all measured in
    one launch."""
    from tests.helpers import env, wanted

    tests = {
        "test_every_backend_at_two_ranks_peaks_where_the_estimate_says": [
            {"set": s, "tol": tol} for s, tol in WORLD_CASES
        ],
        "test_tensor_parallel_at_two_ranks_peaks_where_the_estimate_says": [
            {"set": s} for s in TP_CASES
        ],
        "test_every_pipeline_rank_peaks_where_its_estimate_says": [{"set": s} for s in PP_CASES],
    }
    read = wanted(request, {test: [test] for test in tests})
    cases = [
        {**case, "test": test} for test, some in tests.items() if test in read for case in some
    ]
    tmp = tmp_path_factory.mktemp("two_ranks")
    out = tmp / "measured.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(REPO / "tests" / "measure_world.py"), str(out), json.dumps(cases)]
    # 36 cases (2026-12-01) took 1 min 42 s on a CPU with native bf16 (AVX-512 BF16) and 15 min
    # where bf16 is emulated (AVX2 only): the limit only stops a hang
    proc = subprocess.run(cmd, cwd=tmp, env=env(), capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert [r["set"] for r in results] == [c["set"] for c in cases]
    return {test: [r for r in results if r["test"] == test] for test in tests}


def test_every_backend_at_two_ranks_peaks_where_the_estimate_says(two_ranks):
    """Each backend's step measured on 2 gloo ranks (rank 0's figures; 18 cases): the step's
    peak of every storage (DeepSpeed's flat buffers made at its engine's construction included)
    is the estimate's phase-aware peak within the case's tolerance, and what is alive at it, by
    category (parameters, gradients and optimizer state in every form the backend holds them,
    activations, temporaries), is what the estimate's peak phase holds, each within 3%."""
    results = two_ranks["test_every_backend_at_two_ranks_peaks_where_the_estimate_says"]
    assert [r["set"] for r in results] == [s for s, _ in WORLD_CASES]
    for r in results:
        got, est, name = r["measured"], r["estimated"], " ".join(r["set"])
        peak = got["allocated_peak"]
        print(f"\n{name}: peak {peak / 2**20:.1f} MiB, estimated {est['peak'] / 2**20:.1f}")
        assert peak == pytest.approx(est["peak"], rel=r["tol"]), name
        assert_parts_at_the_peak(r, name)
        assert got["optimizer"] == pytest.approx(est["optimizer"], rel=0.01), name


def test_tensor_parallel_states_and_the_70b_layout():
    """Under tensor parallelism a rank holds 1/tp of every matmul weight, of the embedding and
    of the head (the norms whole), and FSDP2 shards that over world / tp ranks; sequence
    parallelism saves less. yaml/70b.yaml fits an 80 GB GPU at 64 ranks with headroom."""
    from scale_llm.config import with_changes

    cfg = load_config(REPO / "yaml" / "70b.yaml")
    tp = cfg.parallel.tensor_parallel
    whole, local = ParamCounts.of(cfg.model), ParamCounts.of(cfg.model, tp)
    m = cfg.model
    norms = m.d_model * (2 * m.n_layers + 1)
    assert local.total == pytest.approx((whole.total - norms) / tp + norms, abs=1)
    est = estimate(cfg, 64)
    assert est.params == whole.total and 68.9e9 < whole.total < 69.0e9  # Llama-2-70B
    assert est.gpu["optimizer"] == pytest.approx(8 * local.total / (64 // tp), rel=1e-9)
    assert est.total == pytest.approx(50.45 * 2**30, abs=0.01 * 2**30)  # the YAML's comment
    assert est.total < 80e9 * 0.75
    no_sp = estimate(with_changes(cfg, {"parallel.sequence_parallel": False}), 64)
    assert no_sp.gpu["activations"] > est.gpu["activations"]


def test_hsdp_under_tensor_parallelism_shards_over_the_shard_dimension():
    """HSDP x TP: each replica holds a whole sharded copy, so a rank's fp32 states are its 1/tp
    of the model over the mesh's shard dimension (world / tp / replicate), not world / tp."""
    from scale_llm.config import with_changes

    cfg = with_changes(
        load_config(REPO / "yaml" / "70b.yaml"),
        {"parallel.tensor_parallel": 8, "parallel.fsdp.replicate_degree": 2},
    )
    local = ParamCounts.of(cfg.model, 8).total
    est = estimate(cfg, 64)
    assert est.layout.shards == 4
    assert est.gpu["optimizer"] == pytest.approx(8 * local / 4, rel=1e-9)
    flat = estimate(with_changes(cfg, {"parallel.fsdp.replicate_degree": 1}), 64)
    assert flat.gpu["optimizer"] == pytest.approx(est.gpu["optimizer"] / 2, rel=1e-9)


# FSDP2 x TP on 2 gloo ranks (tensor parallel 2, a data-parallel degree of 1), fp32: measured
# the peak within 0.1% (no checkpointing) and 5.0% (full, estimate above) of the
# estimate; bf16 cases measured alike (0.3-2.7%) are left out for time
TP_CASES = [
    ["parallel.backend=fsdp", "parallel.tensor_parallel=2", "train.precision=fp32"],
    [
        "parallel.backend=fsdp",
        "parallel.tensor_parallel=2",
        "train.precision=fp32",
        "activation_checkpointing.mode=full",
        "train.grad_accum=2",
    ],
]


def test_tensor_parallel_at_two_ranks_peaks_where_the_estimate_says(two_ranks):
    """A step of TP 2 with sequence parallelism, measured per rank: the peak is the estimate's
    (it never under-predicts by more than 1%, over-predicts by at most 6%), the optimizer state
    half the model's, and the activations at the peak no more than the estimate's."""
    results = two_ranks["test_tensor_parallel_at_two_ranks_peaks_where_the_estimate_says"]
    assert [r["set"] for r in results] == TP_CASES
    for r in results:
        got, est, name = r["measured"], r["estimated"], " ".join(r["set"])
        peak = got["allocated_peak"]
        assert 0.99 * peak <= est["peak"] <= 1.06 * peak, (name, peak, est["peak"])
        assert got["optimizer"] == pytest.approx(est["optimizer"], rel=0.01), name
        assert got["activations"] <= 1.01 * est["activations"], name


# PP 2 on 2 gloo ranks, fp32, both pipeline ranks measured (MiB, measured / estimated): 1F1B
# with 2 pieces 80.6 / 84.4 and 73.9 / 76.6; full checkpointing with 4 pieces 52.1 / 52.8 and
# 52.9 / 53.6; GPipe with 4 pieces 80.4 / 82.6 and 89.9 / 90.1; ZBV (rank 0: the first and the
# last stage) 86.6 / 87.4 and 64.1 / 66.1; interleaved 1F1B 76.6 / 77.6 and 70.4 / 70.4 (their
# sends kept until the step ends, the head's backward beside the logits: docs/memory.md)
PP = ["parallel.backend=fsdp", "parallel.pipeline_parallel=2", "model.tie_embeddings=false"]
PIECES4 = "parallel.pipeline.microbatches=4"
PP_CASES = [
    [*PP, "train.precision=fp32"],
    [*PP, "train.precision=fp32", "activation_checkpointing.mode=full", PIECES4],
    [*PP, "train.precision=fp32", "parallel.pipeline.schedule=gpipe", PIECES4],
    [*PP, "train.precision=fp32", "parallel.pipeline.schedule=zero_bubble", PIECES4],
    [*PP, "train.precision=fp32", "parallel.pipeline.schedule=interleaved_1f1b", PIECES4],
]


def test_every_pipeline_rank_peaks_where_its_estimate_says(two_ranks):
    """A step of PP 2, measured on both pipeline ranks: each rank's estimate (its stages'
    blocks, the embedding on the first, the head and loss on the last, its schedule's pieces
    in flight, torch's receive buffers, the sends kept until the step ends) is its measured
    peak within 5%, and the layout's estimate names the rank that peaks highest; the
    optimizer state is the rank's own (measured with the embedding's and the head's gradients
    beside it, which the count files there)."""
    results = two_ranks["test_every_pipeline_rank_peaks_where_its_estimate_says"]
    assert [r["set"] for r in results] == PP_CASES
    for r in results:
        name, ranks = " ".join(r["set"]), r["ranks"]
        assert [x["pipeline_rank"] for x in ranks] == [0, 1], name
        peaks = [x["measured"]["allocated_peak"] for x in ranks]
        for x, peak in zip(ranks, peaks, strict=True):
            est = x["estimated"]
            print(
                f"{name} rank {x['pipeline_rank']}: {peak / 2**20:.2f} MiB measured, "
                f"{est['peak'] / 2**20:.2f} estimated"
            )
            assert est["peak"] == pytest.approx(peak, rel=0.05), (name, x["pipeline_rank"])
            got = x["measured"]["optimizer"]
            root_grads = 2 * 4 * 2048 * 256 + (64 << 10)  # the root's fp32 gradients (+ steps)
            assert 0 <= got - est["optimizer"] <= root_grads, name
        assert r["worst_pipeline_rank"] == peaks.index(max(peaks)), name


def test_a_gpu_run_is_refused_when_its_host_cannot_build_the_model(monkeypatch):
    """A GPU run builds the model on the host first: DDP the whole fp32 model per rank, FSDP2
    each rank's shards and one parameter at a time. Eight DDP ranks of yaml/7b.yaml need 8 x
    25 GiB of the host; FSDP2 about 4 GiB each; the estimate says both."""
    import dataclasses

    from scale_llm.analysis.memory import host
    from scale_llm.config.plan import target_plan

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(host, "host_available_bytes", lambda: 64 * 2**30)
    fsdp = load_config(REPO / "yaml" / "7b.yaml")
    ddp = load_config(REPO / "yaml" / "7b.yaml", ["parallel.backend=ddp"])
    assert host.host_memory_problem(fsdp, target_plan(fsdp, 8)) is None
    problem = host.host_memory_problem(ddp, dataclasses.replace(target_plan(ddp, 8)))
    assert problem.startswith("building the model needs about 200.8 GiB of this host's memory (8")
    assert "parallel.backend=fsdp builds each rank's shard" in problem
    assert estimate(fsdp, 8).startup_host < 5 * 2**30 < 25 * 2**30 < estimate(ddp, 8).startup_host


def test_deepspeed_counts_are_read_as_its_config_model_reads_them():
    """ "auto" is DeepSpeed's default, a name without `stage3_` its alias, a whole float a count;
    a fraction, a string or a bucket of 0 is none (DeepSpeed's model refuses them at start)."""
    from scale_llm.analysis.memory.estimate import _elements
    from scale_llm.errors import UserError

    key = "stage3_max_live_parameters"
    assert _elements({key: "auto"}, key, 1e9) == 10**9
    assert _elements({"max_live_parameters": 7}, key, 1e9) == 7
    assert _elements({key: 2e8}, key, 1e9) == 2 * 10**8
    for value in (1.5, "many", True, float("inf")):
        with pytest.raises(UserError, match=f"{key}=.* is not a count of elements"):
            _elements({key: value}, key, 1e9)
    with pytest.raises(UserError, match="give a whole number >= 1"):
        _elements({"reduce_bucket_size": 0}, "reduce_bucket_size", 5e8, least=1)


def test_a_document_masks_dense_mask_is_counted():
    """On the CPU (and on a GPU in fp32) SDPA gets the document mask as (B, 1, T, T) bools, and
    each block saves a copy in the compute dtype (4 B T^2 bytes in fp32); checkpoints keep the
    bools once. The estimate left both out: 6% under here, 26% at seq_len 2048."""
    from types import SimpleNamespace

    from scale_llm.analysis.memory.estimate import _dense_mask

    shape = dict(vocab_size=512, d_model=64, n_layers=3, n_heads=4, seq_len=128)
    cfg = ModelConfig(**shape, attention_mask="document")
    for mode, numerics, batch in itertools.product(MODES, list(NUMERICS), [1, 2]):
        got = counted(cfg, AC(mode=mode), batch, numerics)
        num = dataclasses.replace(NUMERICS[numerics], dense_mask=True)
        predicted = saved_activation_bytes(cfg, AC(mode=mode), batch, num)
        assert abs(predicted / got - 1) < 0.01, (mode, numerics, batch, got, predicted)
    on = lambda device, precision: SimpleNamespace(  # noqa: E731
        device=torch.device(device), precision=precision
    )
    assert _dense_mask(cfg, on("cpu", "bf16")) and _dense_mask(cfg, on("cuda", "fp32"))
    assert not _dense_mask(cfg, on("cuda", "bf16"))  # (FlashAttention's varlen kernel)
    assert not _dense_mask(ModelConfig(**shape), on("cpu", "fp32"))  # (causal: no mask)
