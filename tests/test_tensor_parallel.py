"""Tensor parallelism (parallel.tensor_parallel) on real gloo ranks, its config checks, and the
wqkv layout it needs (rows grouped by kv head).

The model has grouped-query attention (4 query heads, 2 kv heads) so that a rank's heads of q,
k and v must line up. The references run in one process with micro-batch 8; the tensor-parallel
runs take the same 8 sequences per step as micro-batch x grad_accum x data-parallel ranks, with
activation checkpointing, so each curve checks the split, accumulation and checkpointing too.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scale_llm.components.checkpoint import (
    load_model_weights,
    read_trainer_state,
    saved_model_config,
)
from scale_llm.config import load_config
from scale_llm.config.plan import Launch, resolve_plan
from scale_llm.model import empty_state_dict
from scale_llm.model.hf import from_hf, to_hf
from scale_llm.model.transformer import fuse_qkv, split_qkv
from tests.helpers import (
    REPO,
    SINGLE,
    STEPS,
    TOL,
    Runs,
    env,
    sets,
    wanted,
)

GQA = ["model.n_kv_heads=2"]
UNTIED = ["model.tie_embeddings=false"]
LAYOUT_2D = ["parallel.backend=fsdp", "parallel.tensor_parallel=2", *UNTIED]
SAMPLE = ["eval.sample_every=4", "eval.sample_tokens=6"]  # a no-grad forward beside the eval's
TP2 = ["parallel.backend=fsdp", "parallel.tensor_parallel=2", "train.micro_batch_size=4"]
COMPILED = ["train.compile=true", *SAMPLE]
FP8 = {r: ["train.fp8.enabled=true", f"train.fp8.recipe={r}"] for r in ("tensorwise", "rowwise")}
# The runs below by launch, each launch's runs together (those the selected tests read): the
# one-process references; FSDP2 x TP on 4 ranks, stopped after step 2, compiled, and with fp8
# linears; then on 2 ranks, TP 2 alone (eager and compiled) and the 2d run resumed at TP 2.
STAGES = [
    {
        "single": (1, [*SINGLE, *SAMPLE]),
        "single-untied": (1, [*UNTIED, *SINGLE]),
        **{f"fp8-single-{recipe}": (1, [*SINGLE, *keys]) for recipe, keys in FP8.items()},
    },
    {
        "2d-stopped": (
            4,
            [*LAYOUT_2D, "parallel.sequence_parallel=false", "train.micro_batch_size=2"]
            + ["train.grad_accum=2", "activation_checkpointing.mode=selective"]
            + ["train.exit_at_step=2", "run.name=2d"],
        ),
        "2d-compiled": (
            4,
            ["parallel.backend=fsdp", "parallel.tensor_parallel=2", "train.micro_batch_size=2"]
            + ["train.grad_accum=2", "activation_checkpointing.mode=selective", *COMPILED],
        ),
        **{
            f"fp8-2d-{recipe}": (
                4,
                ["parallel.backend=fsdp", "parallel.tensor_parallel=2", "train.micro_batch_size=2"]
                + ["train.grad_accum=2", "activation_checkpointing.mode=selective", *keys],
            )
            for recipe, keys in FP8.items()
        },
    },
    {
        "tp2": (2, [*TP2, "train.grad_accum=2", "activation_checkpointing.mode=full"]),
        "2d": (2, [*LAYOUT_2D, "train.micro_batch_size=4", "train.grad_accum=2"]),
        **{
            f"tp2-compiled-{mode}": (
                2,
                [*TP2, "train.grad_accum=2", f"activation_checkpointing.mode={mode}", *COMPILED]
                + ["activation_checkpointing.k=2"],
            )
            for mode in ("full", "every_k")
        },
    },
]
NEEDS = {
    "test_tensor_parallel_alone_follows_one_process": ["single", "tp2"],
    "test_fsdp_x_tensor_parallel_resumes_at_another_degree": ["single-untied", "2d-stopped", "2d"],
    "test_compiled_tensor_parallel_blocks_follow_one_process": [
        "single", "2d-compiled", "tp2-compiled-full", "tp2-compiled-every_k"
    ],
    "test_fp8_under_fsdp_x_tensor_parallel_follows_one_process": [
        "single", "fp8-single-tensorwise", "fp8-single-rowwise", "fp8-2d-tensorwise",
        "fp8-2d-rowwise",
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory, request) -> Runs:
    """This module's runs (grouped-query attention), those the selected tests read trained."""
    runs, read = Runs(data_dir, tmp_path_factory.mktemp("tp"), *GQA), wanted(request, NEEDS)
    for stage in STAGES:
        runs.start({name: spec for name, spec in stage.items() if name in read})
    return runs


def assert_same_curve(rows: dict[int, dict], ref: dict[int, dict], steps=range(1, STEPS + 1)):
    for step in steps:
        assert abs(rows[step]["loss"] - ref[step]["loss"]) <= TOL, step
        assert abs(rows[step]["grad_norm"] / ref[step]["grad_norm"] - 1) <= TOL, step
    assert abs(rows[STEPS]["val_loss"] - ref[STEPS]["val_loss"]) <= TOL


def generated(run_dir: Path) -> str:
    """What `scale-llm generate RUN_DIR` prints for the prompt "def ", 8 tokens."""
    from scale_llm import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert (
            cli.main(["generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
        )
    return out.getvalue()


def test_tensor_parallel_alone_follows_one_process(runs):
    """TP 2 on 2 ranks (the mesh is shard 1 x tp 2), sequence parallel, tied embeddings:
    vocab-parallel embedding used again as the head, loss on the vocab shards."""
    assert_same_curve(runs.rows["tp2"], runs.rows["single"])
    plan = runs.plan["tp2"]
    assert plan["mesh"] == {"names": ["shard", "tp"], "shape": [1, 2]}
    assert plan["dp_degree"] == 1 and plan["tp_degree"] == 2 and plan["sequences_per_step"] == 8
    # generate reads the run in one process whatever it trained with: the same greedy text
    texts = [generated(runs.root / name) for name in ("tp2", "single")]
    assert texts[0] == texts[1] and len(texts[0]) > len("def ")


def test_compiled_tensor_parallel_blocks_follow_one_process(runs):
    """train.compile under tensor parallelism: TP 2 with full and every-k checkpointing (around
    the compiled block) and FSDP2 x TP 2 x 2 with selective checkpointing (inside it) follow the
    one-process curve, evaluation and the greedy sample (no-grad forwards) included."""
    ref = runs.rows["single"]
    for name in ("2d-compiled", "tp2-compiled-full", "tp2-compiled-every_k"):
        assert_same_curve(runs.rows[name], ref)
        assert runs.rows[name][STEPS]["samples_text"] == ref[STEPS]["samples_text"], name
    assert runs.plan["2d-compiled"]["mesh"] == {"names": ["shard", "tp"], "shape": [2, 2]}


def test_fsdp_x_tensor_parallel_resumes_at_another_degree(runs):
    """FSDP2 x TP on 2 x 2 ranks without sequence parallelism (the norms' weights replicated
    over tp) and with an untied head, stopped after step 2's checkpoint; that checkpoint holds
    the one-process tensors, and TP 2 on 2 ranks resumes it (optimizer state included) on the
    one-process curve."""
    ref = runs.rows["single-untied"]
    rows = runs.rows["2d-stopped"]
    assert sorted(rows) == [1, 2]
    for step in (1, 2):
        assert abs(rows[step]["loss"] - ref[step]["loss"]) <= TOL, step
        assert abs(rows[step]["grad_norm"] / ref[step]["grad_norm"] - 1) <= TOL, step
    assert runs.plan["2d-stopped"]["mesh"] == {"names": ["shard", "tp"], "shape": [2, 2]}

    step2 = runs.root / "2d" / "checkpoints" / "step_00000002"
    model = saved_model_config(read_trainer_state(step2))
    ours = load_model_weights(step2, empty_state_dict(model))
    theirs = load_model_weights(
        runs.root / "single-untied" / "checkpoints" / "step_00000002", empty_state_dict(model)
    )
    for name, tensor in theirs.items():  # (a row out of place would differ by ~0.1; Adam's
        # first steps at lr 1e-2 turn the ranks' 1e-7 rounding into measured <= 2.4e-5)
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-4, msg=name)

    console = runs.stdout["2d"]  # (launched again at TP 2 on 2 ranks)
    assert "resume: continuing from" in console and "at step 2" in console
    assert runs.plan["2d"]["mesh"] == {"names": ["shard", "tp"], "shape": [1, 2]}
    assert_same_curve(runs.rows["2d"], ref)


def test_fp8_under_fsdp_x_tensor_parallel_follows_one_process(runs):
    """train.fp8 (emulated) under FSDP2 2 x TP 2 with accumulation and selective checkpointing,
    against the same fp8 run in one process (relative loss distances over the 4 steps).
    Rowwise scales (one per row of each operand) do not depend on the layout: the curves agree
    but for the few casts whose rounding the ranks' 1e-7 summation differences flip (an e4m3
    step is 2^-3 of a value): within 1e-4, measured 1.1e-5. Tensorwise scales are one per
    micro-batch tensor (2 sequences here, not 8) and FSDP2 gathers the weights in fp8 with
    them, so the layout changes fp8's rounding itself: within 3 times the one-process fp8
    curve's own distance from fp32, measured 1.8e-3 against 3 x 1.3e-3. A layout error (a
    missing reduction, a wrong shard) moves the loss by 1e-2 or more."""

    def distance(name: str, other: str, key: str = "loss") -> float:
        a, b = runs.rows[name], runs.rows[other]
        steps = range(1, STEPS + 1) if key == "loss" else [STEPS]  # (val_loss: the last step)
        return max(abs(a[s][key] / b[s][key] - 1) for s in steps)

    assert distance("fp8-2d-rowwise", "fp8-single-rowwise") <= 1e-4
    assert distance("fp8-2d-rowwise", "fp8-single-rowwise", "val_loss") <= 1e-4
    own = distance("fp8-single-tensorwise", "single")  # fp8's rounding on this curve
    assert 0 < distance("fp8-2d-tensorwise", "fp8-single-tensorwise") <= 3 * own
    assert distance("fp8-2d-tensorwise", "fp8-single-tensorwise", "val_loss") <= 3 * own
    console = runs.stdout["fp8-2d-tensorwise"]
    assert "fp8: tensorwise scaling in 10 block linears, emulated on the CPU" in console
    assert "FSDP2 gathers fp8 weights" in console
    assert "FSDP2 gathers" not in runs.stdout["fp8-2d-rowwise"]
    assert runs.plan["fp8-2d-rowwise"]["mesh"] == {"names": ["shard", "tp"], "shape": [2, 2]}
    # the sharded fp8 run's checkpoint (weights gathered in fp8) holds the one-process fp32
    # tensors under their names: any layout, with or without fp8, loads it
    from torch.distributed.checkpoint import FileSystemReader

    dcp = runs.root / "fp8-2d-tensorwise" / "checkpoints" / "step_00000004" / "dcp"
    meta = FileSystemReader(str(dcp)).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model."): v for k, v in meta.items() if k.startswith("model.")}
    plain = empty_state_dict(saved_model_config(read_trainer_state(dcp.parent)))
    assert {k: tuple(v.size) for k, v in saved.items()} == {k: v.shape for k, v in plain.items()}
    assert {v.properties.dtype for v in saved.values()} == {torch.float32}


# ----------------------------------------------------------------------------- in one process


def test_wqkv_groups_whole_heads_and_maps_to_hugging_face_and_back():
    heads, kv, dim, d = 8, 2, 4, 16
    q, k, v = torch.randn(heads * dim, d), torch.randn(kv * dim, d), torch.randn(kv * dim, d)
    w = fuse_qkv(q, k, v, kv)
    # the first half of the rows (tensor parallel 2, rank 0) is kv head 0's group: q heads 0-3
    group = w[: w.size(0) // 2]
    assert torch.equal(group[: 4 * dim], q[: 4 * dim])
    assert torch.equal(group[4 * dim : 5 * dim], k[:dim])
    assert torch.equal(group[5 * dim :], v[:dim])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(w, heads, kv), (q, k, v)))

    cfg = load_config(None, ["model.d_model=32", "model.n_heads=8", "model.n_kv_heads=2"]).model
    state = {n: torch.randn(t.shape) for n, t in empty_state_dict(cfg).items()}
    hf = dict(to_hf(cfg, dict(state)))
    back = from_hf(cfg, hf.__getitem__)
    assert all(torch.equal(back[n], t) for n, t in state.items())


def check(*overrides: str, world: int = 4) -> str:
    """The config error of `overrides`, or '' when the config is accepted for `world` ranks."""
    from scale_llm.errors import UserError

    try:
        cfg = load_config(None, ["parallel.backend=fsdp", *overrides])
        resolve_plan(cfg, Launch(world_size=world), cuda=False)
    except UserError as e:
        return str(e)
    return ""


def test_tensor_parallel_config_errors_name_the_key_and_a_valid_value():
    assert check("parallel.tensor_parallel=2") == ""
    text = check("parallel.tensor_parallel=2", "parallel.backend=ddp")
    assert "parallel.tensor_parallel=2 needs parallel.backend=fsdp (it is ddp)" in text
    assert check("parallel.tensor_parallel=2", "train.compile=true") == ""  # compiled TP blocks
    text = check("parallel.tensor_parallel=2", world=3)
    assert (
        "parallel.tensor_parallel=2 does not divide the world size 3; use a divisor of it" in text
    )
    text = check("parallel.tensor_parallel=2", "parallel.fsdp.replicate_degree=4", world=4)
    assert "replicate_degree=4 does not divide the data-parallel degree 2" in text

    # every suggestion, applied, clears its key's error
    bad = ["model.d_model=192", "model.n_heads=6", "model.n_kv_heads=3", "model.mlp_hidden=502"]
    bad += ["model.vocab_size=2050", "model.seq_len=250"]
    tp4 = "parallel.tensor_parallel=4"
    lines = [x for x in check(tp4, *bad).splitlines() if "is not divisible by parallel" in x]
    assert [x.split("=")[0].strip(" -") for x in lines] == [
        "model.n_heads",
        "model.n_kv_heads",
        "model.mlp_hidden",
        "model.vocab_size",
        "model.seq_len",
    ]
    for line in lines:
        key = line.split("=")[0].strip(" -")
        suggestions = line.split("): ", 1)[1].split(" (")[0].split(" or ")
        assert suggestions, line
        for suggestion in suggestions:
            if suggestion.startswith("parallel.tensor_parallel="):
                after = check(suggestion, *bad)
            else:
                after = check(tp4, *[b for b in bad if not b.startswith(key + "=")], suggestion)
            left = [x for x in after.splitlines() if x.strip(" -").startswith(key + "=")]
            assert not left, (suggestion, left)


def test_a_launch_that_tensor_parallel_cannot_split_fails_before_any_process_group(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scale_llm",
            "train",
            "yaml/tiny.yaml",
            *sets("parallel.backend=ddp", "parallel.tensor_parallel=2", f"run.dir={tmp_path}"),
        ],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "parallel.tensor_parallel=2 needs parallel.backend=fsdp" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not any(Path(tmp_path).iterdir())
