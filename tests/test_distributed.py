"""Backends with real 2-rank gloo process groups: parity with one process, resume, launchers.

Every run goes through the command line (torchrun or the launch/ scripts) on CPU in fp32 with the
same seed and data. The single-process run with micro-batch 8 (no checkpointing) is the
reference; each backend runs with 2 ranks x micro-batch 2 x grad_accum 2 with activation
checkpointing, so the same 8 sequences make each step. Clipping is active (max norm
0.3 is below the first steps' norms), so the losses after step 1 also check the clipped update.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scale_llm.components.checkpoint import (
    INTEGRITY,
    Checkpointer,
    integrity_record,
    write_integrity,
)
from tests.helpers import (
    BACKENDS,
    REPO,
    SPLIT,
    STEPS,
    TINY_MODEL,
    TOL,
    Payload,
    common,
    env,
    plant_in_torch_file,
    rows_of,
    run,
    sets,
    split_run,
    torchrun,
    wanted,
)

COMPILED = ["ddp", "fsdp", "zero2"]
SUM8 = ["train.micro_batch_size=1", "train.grad_accum=8"]
RESUMED = ["ddp", "fsdp", "zero2", "zero3"]
BACKGROUND = [("ddp", "async"), ("fsdp", "async_with_pinned_mem")]
MIXED = [("ddp", "bf16"), ("fsdp", "fp16"), ("zero2", "bf16")]
_7B = yaml.safe_load((REPO / "yaml" / "7b-1xh200.yaml").read_text())["parallel"]["deepspeed"]
SINGLE_H200_7B = [  # yaml/7b-1xh200.yaml's layout: ZeRO-2, optimizer state and step on the CPU
    "parallel.backend=deepspeed",
    f"parallel.deepspeed.zero_stage={_7B['zero_stage']}",
    f"parallel.deepspeed.offload_optimizer={_7B['offload_optimizer']}",
    *SPLIT,
]
OFFLOAD = ["parallel.deepspeed.offload_optimizer=cpu", "parallel.deepspeed.offload_param=cpu"]
# The runs the tests below read, by name: each is trained at most once a test session (the `runs`
# fixture), and those the selected tests read start together, in one launch, before the first
# test (`ran`); the resumes of stopped runs in a second launch. (Compiled ones last.)
RUNS = {
    **{f"{b}-split": split_run(b) for b in BACKENDS},
    **{
        f"{b}-stopped": split_run(b, f"run.name={b}-resumed", "train.exit_at_step=2")
        for b in RESUMED
    },
    **{f"{b}-{mode}": split_run(b, f"checkpoint.async_mode={mode}") for b, mode in BACKGROUND},
    **{f"{b}-{p}": split_run(b, f"train.precision={p}") for b, p in MIXED},
    "zero3-offload": split_run("zero3", *OFFLOAD),
    "zero2-offload": (2, SINGLE_H200_7B),
    "logs": (2, ["parallel.backend=ddp", "train.micro_batch_size=4", "train.max_steps=1"]),
    **{f"{b}-compiled": split_run(b, "train.compile=true") for b in COMPILED},
    # 8 micro-steps of 1 sequence on each rank a step: sums over micro-steps
    **{
        f"{b}-{p}-sum8": (2, [*BACKENDS[b], f"train.precision={p}", *SUM8])
        for b, p in (("fsdp", "bf16"), ("fsdp", "fp32"), ("zero2", "bf16"))
    },
}
NEEDS = {  # test: the runs it reads ({backend}, {mode}, {precision}: its parameters)
    "test_backend_matches_single_process": ["{backend}-split"],
    "test_compiled_backend_follows_the_reference": ["{backend}-compiled"],
    "test_resume_continues_the_same_curve": [
        "{backend}-split", "{backend}-stopped", "{backend}-resumed"
    ],
    "test_background_saves_resume_to_the_same_curve": [
        "{backend}-split", "{backend}-{mode}", "{backend}-from-{mode}"
    ],
    "test_a_planted_pickle_in_deepspeed_files_never_runs": ["zero2-split"],
    "test_deepspeed_saves_write_their_partitions_only": ["{backend}-split"],
    "test_zero3_with_cpu_offload_trains": ["zero3-offload"],
    "test_the_single_h200_7b_layout_trains_at_tiny_size": ["zero2-offload"],
    "test_mixed_precision_follows_the_fp32_curve": ["{backend}-{precision}"],
    "test_only_rank_0_logs_info": ["logs"],
    "test_deepspeed_writes_its_generated_config": ["zero2-split"],
    "test_every_rank_gets_the_communication_settings": ["ddp-split", "fsdp-split"],
    "test_deepspeed_sums_and_reduces_bf16_gradients_as_fsdp2_does": [
        "fsdp-bf16-sum8", "fsdp-fp32-sum8", "zero2-bf16-sum8"
    ],
}  # fmt: skip


def resumes(root: Path) -> dict[str, tuple[int, list[str]]]:
    """The second launch's runs: each stopped run resumed (found by `auto`), and each run with
    background saves resumed from its step 2 in a run dir of its own."""
    step2 = "checkpoints/step_00000002"
    return {
        **{f"{b}-resumed": split_run(b) for b in RESUMED},
        **{
            f"{b}-from-{mode}": split_run(
                b,
                f"checkpoint.async_mode={mode}",
                f"checkpoint.resume={root / f'{b}-{mode}' / step2}",
            )
            for b, mode in BACKGROUND
        },
    }


@pytest.fixture(scope="module")
def ran(runs, request):
    """`ran(name)`: the metrics rows by step of the run `name` (RUNS, `resumes`); what the
    test session's selected tests here read is started together first."""
    later, read = resumes(runs.root), wanted(request, NEEDS)
    runs.start({name: spec for name, spec in RUNS.items() if name in read})
    runs.start({name: spec for name, spec in later.items() if name in read})
    every = RUNS | later
    return lambda name: runs(name, every[name][0], *every[name][1])


def assert_same_curve(
    rows: dict[int, dict], ref: dict[int, dict], tol: float, grad_tol: float | None = None
) -> float:
    """Losses (and the final val loss) within `tol` absolute, grad norms within `grad_tol`
    relative (default `tol`); returns the larger of the two worst differences."""
    grad_tol = tol if grad_tol is None else grad_tol
    loss_worst = abs(rows[STEPS]["val_loss"] - ref[STEPS]["val_loss"])
    grad_worst = 0.0
    for step in range(1, STEPS + 1):
        loss_worst = max(loss_worst, abs(rows[step]["loss"] - ref[step]["loss"]))
        grad_worst = max(
            grad_worst,
            abs(rows[step]["grad_norm"] - ref[step]["grad_norm"]) / ref[step]["grad_norm"],
        )
    assert loss_worst <= tol, f"loss: max difference {loss_worst:.2e} > {tol:.0e}"
    assert grad_worst <= grad_tol, (
        f"grad norm: max relative difference {grad_worst:.2e} > {grad_tol:.0e}"
    )
    return max(loss_worst, grad_worst)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_matches_single_process(backend, ran, reference):
    """2 ranks x micro-batch 2 x grad_accum 2 with checkpointing vs one process with micro-batch
    8 without: one run checks the rank split, accumulation = big batch, checkpointing on = off
    and the clipped global norm, all against the same reference."""
    split = ran(f"{backend}-split")
    diff = assert_same_curve(split, reference, TOL)
    print(f"\nparity {backend}: max |diff| vs single = {diff:.1e}")


@pytest.mark.parametrize("backend", COMPILED)
def test_compiled_backend_follows_the_reference(backend, ran, reference):
    """train.compile on 2 ranks (per-block compile before the wrapping / sharding)."""
    rows = ran(f"{backend}-compiled")
    diff = assert_same_curve(rows, reference, 1e-4)
    print(f"\ncompiled {backend}: max |diff| vs eager single = {diff:.1e}")


@pytest.mark.parametrize("backend", RESUMED)
def test_resume_continues_the_same_curve(backend, runs, ran):
    """A run stopped after step 2's checkpoint (train.exit_at_step), launched again: the
    launch finds that checkpoint and continues the straight run's curve bit for bit."""
    straight = ran(f"{backend}-split")
    assert max(ran(f"{backend}-stopped")) == 2  # stopped after the checkpoint of step 2
    name = f"{backend}-resumed"
    resumed = ran(name)
    assert "resume: continuing from" in runs.stdout[name] and "at step 2" in runs.stdout[name]
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):  # bit-identical on CPU in fp32
        assert resumed[step]["loss"] == straight[step]["loss"], step
        assert resumed[step]["grad_norm"] == straight[step]["grad_norm"], step
    assert resumed[4]["val_loss"] == straight[4]["val_loss"]
    # the record (both ranks' files hashed as they were written) is the files' own
    for _, ckpt in Checkpointer(runs.root / name, 1).complete():
        record = json.loads((ckpt / INTEGRITY).read_text())["files"]
        assert record == integrity_record(ckpt), ckpt


@pytest.mark.parametrize(("backend", "mode"), BACKGROUND)
def test_background_saves_resume_to_the_same_curve(backend, mode, runs, ran):
    """checkpoint.async_mode on 2 ranks (the writer threads' collectives on a gloo group of
    their own): the run trains the foreground run's curve, its checkpoints hold the same model
    and optimizer bytes, and a resume from its step 2 continues that curve bit for bit."""
    straight = ran(f"{backend}-split")
    name = f"{backend}-{mode}"
    rows = ran(name)
    curve = ("loss", "grad_norm")
    assert [[rows[s][k] for k in curve] for s in range(1, STEPS + 1)] == [
        [straight[s][k] for k in curve] for s in range(1, STEPS + 1)
    ]
    step2 = runs.root / name / "checkpoints" / "step_00000002"
    for ckpt in (step2, step2.parent / "step_00000004"):
        record = json.loads((ckpt / INTEGRITY).read_text())["files"]
        other = runs.root / f"{backend}-split" / "checkpoints" / ckpt.name
        foreground = json.loads((other / INTEGRITY).read_text())["files"]
        data = sorted(k for k in record if k.endswith(".distcp"))
        assert len(data) == 2 and all(record[k] == foreground[k] for k in data), ckpt
        assert record == integrity_record(ckpt)  # the record is the files' own
    resumed = f"{backend}-from-{mode}"  # (resumed from `step2`, background saves on)
    after = ran(resumed)
    assert "at step 2" in runs.stdout[resumed]
    for step in (3, 4):
        assert [after[step][k] for k in curve] == [straight[step][k] for k in curve], step
    assert after[4]["val_loss"] == straight[4]["val_loss"]


def test_a_planted_pickle_in_deepspeed_files_never_runs(runs, ran, data_dir):
    """DeepSpeed reads its own files with weights_only=False; ours must not run a payload
    planted in them (2 ranks, exact ZeRO-2 resume path)."""
    ran("zero2-split")
    ckpt = runs.root / "zero2-split" / "checkpoints" / "step_00000002"
    hostile = runs.root / "zero2-hostile" / "step_00000002"
    shutil.copytree(ckpt, hostile)
    marker = runs.root / "pwned"
    target = plant_in_torch_file(hostile / "deepspeed" / "mp_rank_00_model_states.pt", marker)
    write_integrity(hostile)  # checksums are no signature: the attacker recomputes them
    cmd = torchrun(2, *common(data_dir, runs.root, "zero2-hostile-run"))
    cmd += sets(*BACKENDS["zero2"], *SPLIT, f"checkpoint.resume={hostile}")
    proc = subprocess.run(cmd, cwd=runs.root, env=env(), capture_output=True, text=True)
    assert proc.returncode != 0
    assert not marker.exists(), "the planted code ran"
    assert f"error: refusing to load {target}" in proc.stderr, proc.stderr[-3000:]
    # the weights' own reader (convert, generate, export, another backend) refuses a payload
    # in a partition file too
    shutil.rmtree(hostile)
    shutil.copytree(ckpt, hostile)
    target = plant_in_deepspeed_file(hostile / "deepspeed" / PARTITION_1, marker)
    write_integrity(hostile)
    cmd = [sys.executable, "-m", "scale_llm", "convert", str(hostile), "--out", "out.pt"]
    proc = subprocess.run(cmd, cwd=runs.root, env=env(), capture_output=True, text=True)
    assert proc.returncode == 2 and not marker.exists(), proc.stderr[-3000:]
    assert f"error: refusing to load {target}" in proc.stderr, proc.stderr[-3000:]


PARTITION_1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"  # rank 1's fp32 partition (fp32 run)


def plant_in_deepspeed_file(path: Path, marker: Path) -> Path:
    """plant_in_torch_file for a file holding DeepSpeed's classes (a partition file)."""
    import torch

    from scale_llm.components.serialization import deepspeed_safe_globals

    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        real = torch.load(path, weights_only=True)
    real["planted"] = Payload(marker)
    torch.save(real, path)
    return path


@pytest.mark.parametrize("backend", ["zero0", "zero1", "zero2", "zero3"])
def test_deepspeed_saves_write_their_partitions_only(backend, runs, ran, tmp_path):
    """A DeepSpeed save writes the engine's own files and no consolidated copy of the weights;
    what the other backends, generate, export and convert read from those files is DeepSpeed's
    own consolidation bit for bit (ZeRO-0: the module's state), tensor by tensor."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from scale_llm.components.checkpoint import (
        CheckpointWeights,
        read_record,
        read_trainer_state,
        saved_model_config,
    )
    from scale_llm.model import empty_state_dict

    ran(f"{backend}-split")
    ckpt = runs.root / f"{backend}-split" / "checkpoints" / "step_00000002"
    assert not (ckpt / "model.pt").exists() and "model.pt" not in read_record(ckpt)
    template = empty_state_dict(saved_model_config(read_trainer_state(ckpt)))
    ours = CheckpointWeights(ckpt, template)
    if backend == "zero0":  # our own files, just written: DeepSpeed's reader is trusted here
        theirs = torch.load(ckpt / "deepspeed" / "mp_rank_00_model_states.pt", weights_only=False)
        theirs = theirs["module"]
    else:
        theirs = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="deepspeed")
    assert sorted(ours) == sorted(theirs) == sorted(template)
    for name in template:
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], theirs[name]), name
    # convert writes the same tensors; generate samples from them
    from scale_llm.train.convert import convert

    out, _ = convert(ckpt, tmp_path / "model.pt")
    converted = torch.load(out, weights_only=True)["model"]
    assert all(torch.equal(converted[name], theirs[name]) for name in template)
    if backend == "zero3":
        cmd = [sys.executable, "-m", "scale_llm", "generate", str(ckpt.parents[1])]
        cmd += ["--checkpoint", str(ckpt), "--max-new-tokens", "2", "--prompt", "def"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]


def test_zero3_with_cpu_offload_trains(ran, reference):
    rows = ran("zero3-offload")
    # DeepSpeedCPUAdam's vectorized update rounds differently from torch.optim.AdamW
    assert_same_curve(rows, reference, 1e-4)


def test_the_single_h200_7b_layout_trains_at_tiny_size(ran, reference):
    """yaml/7b-1xh200.yaml's layout (ZeRO-2, optimizer state and step on the CPU with
    DeepSpeedCPUAdam) on the tiny model: the same curve as without offload."""
    rows = ran("zero2-offload")
    assert_same_curve(rows, reference, 1e-4)  # CPU Adam rounds differently from torch's


@pytest.mark.parametrize(("backend", "precision"), MIXED)
def test_mixed_precision_follows_the_fp32_curve(backend, precision, ran, reference):
    rows = ran(f"{backend}-{precision}")
    # 16-bit matmuls: losses within 3e-2. Grad norms move more: DeepSpeed's bf16 mode keeps
    # weights and gradients in bf16 (accumulated in bf16 under ZeRO-2), and how far that drifts
    # depends on the CPU's bf16 kernels (0.7% on one machine, 3.8% on another); a missing
    # loss/grad_accum doubles the norm, so 10% still catches that.
    diff = assert_same_curve(rows, reference, 3e-2, grad_tol=1e-1)
    print(f"\n{precision} {backend}: max |diff| vs fp32 single = {diff:.1e}")
    assert rows[STEPS]["skipped_steps"] == 0  # fp16: the GradScaler found no overflow here


def test_deepspeed_sums_and_reduces_bf16_gradients_as_fsdp2_does(runs, ran):
    """ZeRO-2 in bf16 sums the micro-steps' gradients and reduces them in fp32, as FSDP2 does
    (DeepSpeed's default for bf16: both in bf16), as its engine says, and over 8 micro-steps a
    step follows FSDP2's bf16 curve within what bf16 against fp32 shows."""
    fsdp, fp32, zero2 = (ran(f"{n}-sum8") for n in ("fsdp-bf16", "fsdp-fp32", "zero2-bf16"))
    said = "deepspeed: ZeRO-2, gradients summed in float32 and reduced in float32"
    assert said in runs.stdout["zero2-bf16-sum8"]

    def worst(a, b):
        return max(abs(a[s]["loss"] - b[s]["loss"]) for s in range(1, STEPS + 1))

    bf16_vs_fp32, deepspeed_vs_fsdp = worst(fsdp, fp32), worst(zero2, fsdp)
    print(f"\nbf16 vs fp32 {bf16_vs_fp32:.1e}; ZeRO-2 bf16 vs FSDP2 bf16 {deepspeed_vs_fsdp:.1e}")
    assert 0 < deepspeed_vs_fsdp <= bf16_vs_fp32


def test_a_step_made_nan_on_one_rank_is_skipped_by_every_rank_of_every_backend(data_dir, tmp_path):
    """Steps 2 and 4 (of 4) have a NaN loss on rank 1 only; the reduction carries it to rank 0.
    Every backend skips both steps on both ranks (DeepSpeed's ZeRO-0 in fp32, whose engine
    hands the step to the plain optimizer, applied the NaN update before), so step 3's loss is
    finite and the same on every backend; both are counted on both ranks; and the final
    checkpoint, due on the skipped step 4, is written. Then, under DDP and ZeRO-2, one rank alone
    runs out of disk in each phase of a save (rank 1 in the backend's own writes, rank 0 in the
    others): it said so, and the other stopped with a message naming it, where it used to wait
    in a collective the failing rank had left, and die with a traceback or hang."""
    cases = {b: BACKENDS[b] for b in ("ddp", "fsdp", "zero0", "zero2", "zero3")}
    settings = [
        *common(data_dir, tmp_path, "unused")[1::2],  # the values of its --set pairs
        "train.micro_batch_size=2",
        "checkpoint.every=0",
        "eval.every=0",
    ]
    out = tmp_path / "seen.json"
    script = str(REPO / "tests" / "poison_world.py")
    cmd = [*torchrun(2, "x")[:5], script, str(out), *map(json.dumps, (settings, cases, [1, 3]))]
    run(cmd, cwd=tmp_path)
    seen = json.loads(out.read_text())
    for name in ("ddp", "zero2"):  # rank 0 alone out of disk in a save: every rank stops
        phases = seen.pop(f"{name} full disk")
        assert list(phases) == ["folder", "backend", "files", "record", "publish"]
        for phase, (failed, other) in phases.items():
            where, rank = f"{name}, {phase}", 1 if phase == "backend" else 0
            assert failed[0].startswith("out of disk space while writing checkpoint"), where
            if (name, phase) == ("ddp", "backend"):  # (DCP hands every rank the error itself)
                assert other[0].startswith("out of disk space while writing"), (where, other[0])
            else:
                assert f"failed on rank {rank} (its message says" in other[0], (where, other[0])
            assert failed[1] == other[1] == [f"step_{STEPS:08d}"], where  # no .tmp, none added
    assert list(seen) == list(cases)
    step3 = seen["ddp"][0]["losses"]["3"]
    for name, ranks in seen.items():
        for rank, r in enumerate(ranks):
            where = f"{name} rank {rank}"
            assert r["skipped"] == 2, where
            assert not any(math.isfinite(r["grad_norms"][s]) for s in ("2", "4")), where
            assert math.isfinite(r["losses"]["3"]), where
            assert r["losses"]["3"] == pytest.approx(step3, abs=TOL), where
            assert r["checkpoint"] == f"step_{STEPS:08d}", where


def test_only_rank_0_logs_info(runs, ran):
    ran("logs")
    assert "[rank 0] step 1/1" in runs.stdout["logs"]
    assert "[rank 1]" not in runs.stdout["logs"]


def test_deepspeed_writes_its_generated_config(runs, ran):
    ran("zero2-split")
    ds = json.loads((runs.root / "zero2-split" / "ds_config.json").read_text())
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 8
    assert ds["gradient_clipping"] == 0.3
    assert ds["zero_optimization"]["stage"] == 2


# ----------------------------------------------------------------------------- launchers


def launcher_args(data_dir: Path, root: Path, name: str, config: str) -> list[str]:
    settings = [
        *TINY_MODEL,
        f"data.dir={data_dir}",
        f"run.dir={root}",
        f"run.name={name}",
        "train.max_steps=2",
        "train.micro_batch_size=2",
        "train.warmup_steps=1",
        "eval.every=0",
        "logging.tensorboard=false",
    ]
    return [str(REPO / "yaml" / config), *sets(*settings)]


def launch(
    script: str, args: list[str], cwd: Path, **extra_env: str
) -> subprocess.CompletedProcess:
    full_env = {**env(), "SCALE_LLM_PYTHON": sys.executable, "SKIP_PREPARE": "1", **extra_env}
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / script), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"{script}: rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc


def test_bench_sweeps_the_backends_of_one_two_rank_launch(tmp_path):
    """`bench --sweep --sweep-backend ddp,fsdp,zero2` under torchrun: one row per backend, each
    timed on the backend it names and next to that backend's own memory estimate."""
    cmd = torchrun(2, *sets(*TINY_MODEL, "train.precision=fp32", "train.device=cpu"))
    cmd[cmd.index("train")] = "bench"
    cmd += ["--sweep", "--sweep-backend", "ddp,fsdp,zero2", "--sweep-micro", "2"]
    cmd += ["--sweep-ac", "none", "--sweep-compile", "false", "--steps", "1", "--warmup", "1"]
    out = run([*cmd, "--json"], cwd=tmp_path).stdout.splitlines()
    rows = [json.loads(line) for line in out if line.startswith("{")]
    assert [r["backend"] for r in rows] == ["ddp", "fsdp", "zero2"]
    assert all(r["ms_per_step"] > 0 and r["micro_batch"] == 2 for r in rows)
    ddp, fsdp, zero2 = (r["predicted_peak_gib"] for r in rows)
    # FSDP2 shards all of the model's states; ZeRO-2 adds its reduce buckets (at this size,
    # more than the model): each row is its own backend's estimate
    assert fsdp < ddp < zero2


def test_2xh100_launcher_runs_two_cpu_processes(data_dir, corpus_dir, tmp_path):
    """The one-process default config under the 2-process launcher: backend auto -> ddp. Its
    prepare step runs (up to date here) on the same arguments as train, train's flags too."""
    args = launcher_args(data_dir, tmp_path, "l2", "tiny.yaml") + sets(
        f"data.source={corpus_dir}", "data.tokenizer_sample_bytes=500000", "data.val_fraction=0.1"
    )
    args += ["--grad-accum", "2", "--train_steps", "2", "--train.lr", "1e-2"]
    proc = launch("2xh100.sh", args, tmp_path, SKIP_PREPARE="0")
    assert "is up to date" in proc.stdout + proc.stderr
    assert "world 2" in proc.stdout and "done: 2 steps" in proc.stdout
    written = yaml.safe_load((tmp_path / "l2" / "config.yaml").read_text())
    assert written["parallel"]["backend"] == "auto"  # as the user wrote it
    assert written["train"]["grad_accum"] == 2 and written["train"]["lr"] == 1e-2
    resolved = json.loads((tmp_path / "l2" / "plan.json").read_text())
    assert resolved["backend"] == "ddp" and resolved["world_size"] == 2


def test_deepspeed_launcher(data_dir, tmp_path):
    proc = launch(
        "deepspeed.sh", launcher_args(data_dir, tmp_path, "lds", "tiny-deepspeed.yaml"), tmp_path
    )
    assert "world 2" in proc.stdout and "done: 2 steps" in proc.stdout
    console = proc.stdout + proc.stderr
    assert "no launcher seen" not in console  # DeepSpeed's launch.py is one
    # a save writes DeepSpeed's partitions only: no consolidation on rank 0, nothing it says
    assert "Processing zero checkpoint" not in console and "Reconstructed fp32" not in console
    assert not list((tmp_path / "lds" / "checkpoints").glob("step_*/model.pt"))
    # a port of its own, as torchrun --standalone takes (DeepSpeed's default was every run's)
    assert "--master_port=29500" not in console and "--master_port=" in console


def test_two_nodes_on_loopback(data_dir, tmp_path):
    """Two torchrun.sh "nodes" meet at MASTER_ADDR:MASTER_PORT. The port is free when picked but
    released before node 0's store binds it, so another process may take it meanwhile: such a
    start (both nodes fail, saying the address is in use) is retried on a new port."""
    args = launcher_args(data_dir, tmp_path, "l2n", "tiny-fsdp.yaml")
    for _ in range(3):
        outputs, codes = two_nodes(args, tmp_path, unused_port())
        if codes == [0, 0] or not any("address already in use" in o.lower() for o in outputs):
            break
        shutil.rmtree(tmp_path / "l2n", ignore_errors=True)  # this test's own run dir
    assert codes == [0, 0], outputs
    assert "world 2" in outputs[0] and "done: 2 steps" in outputs[0]


def unused_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def two_nodes(args: list[str], cwd: Path, port: str) -> tuple[list[str], list[int]]:
    common_env = {
        **env(),
        "SCALE_LLM_PYTHON": sys.executable,
        "SKIP_PREPARE": "1",
        "NNODES": "2",
        "NGPU": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    nodes = [
        subprocess.Popen(
            ["bash", str(REPO / "launch" / "torchrun.sh"), *args],
            cwd=cwd,
            env={**common_env, "NODE_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in nodes]
    return outputs, [p.returncode for p in nodes]


def test_a_stopped_launch_names_its_checkpoint_and_continues_from_it(data_dir, tmp_path):
    """SIGTERM to torchrun.sh after step 1 ended with ~25 lines of torchrun's SignalException
    traceback and exit code 1. Now the workers checkpoint, the launcher's last line names that
    checkpoint and the command that continues the run (quoted: the run name holds spaces and
    shell characters, which reach the config intact) and it exits 143; that command resumes."""
    name = "quoted $(touch pwned) 'x'"
    args = launcher_args(data_dir, tmp_path, "q", "tiny-ddp.yaml")
    args += sets(f"run.name={name}", "train.max_steps=1000", "logging.every=1")
    full_env = {**env(), "SCALE_LLM_PYTHON": sys.executable, "SKIP_PREPARE": "1"}
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), *args]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "step 1/1000" in line:
                proc.send_signal(signal.SIGTERM)
                break
        console = "".join(lines) + proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, console[-3000:]
    assert "Traceback" not in console and "SignalException" not in console, console[-3000:]
    last = console.strip().splitlines()[-1]
    stop = re.fullmatch(r"stopped by SIGTERM: checkpoint (.+) \(step (\d+) of 1000\); "
                        r"continue with: (.+)", last)  # fmt: skip
    assert stop, console[-3000:]
    checkpoint, step = Path(stop[1]), int(stop[2])
    assert checkpoint == tmp_path / name / "checkpoints" / f"step_{step:08d}"
    assert (checkpoint / "trainer.pt").is_file() and not (tmp_path / "pwned").exists()
    again = shlex.split(stop[3])
    assert again == cmd
    again += sets(f"train.max_steps={step + 1}")  # (one more step)
    proc = subprocess.run(
        again, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resume: continuing from {checkpoint} at step {step}" in proc.stdout
    assert max(rows_of(tmp_path / name)) == step + 1


@pytest.mark.parametrize(("offload", "expected"), [(False, "nccl"), (True, "cuda:nccl,cpu:gloo")])
def test_fsdp_cpu_offload_gets_gloo_next_to_nccl(offload, expected, monkeypatch):
    """FSDP2's CPU offload keeps the gradients on the CPU, so clipping's norm is reduced over CPU
    tensors: with NCCL alone the first step fails ("No backend type associated with device type
    cpu"). Such a run's process group is NCCL for CUDA and gloo for the CPU (torchtitan's way);
    the others stay NCCL alone. No GPU here: the CUDA calls are recorded, not made."""
    import torch
    import torch.distributed as dist

    from scale_llm.components import distributed
    from scale_llm.config.plan import RunPlan

    seen = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(b=backend))
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(key, "")  # records the old state: start() sets these, and the
        monkeypatch.delenv(key)  # test's end restores all of them
    plan = RunPlan(0, 0, 1, torch.device("cuda", 0), "fsdp", "bf16", 1, 1, 1, 8)
    distributed.start(plan, cpu_collectives=offload)
    assert seen == {"b": expected}


def test_fp16_loss_scale_resumes_and_an_overflow_in_one_shard_is_skipped_everywhere(
    data_dir, tmp_path
):
    """fp16, which on a GPU every backend runs and CI otherwise would not, on 2 gloo ranks:
    DDP and FSDP2 halve the loss scale on an overflow (step 1's NaN loss on rank 1) and a
    resume from step 2 continues with the saved scale and the same curve; under FSDP2 an inf
    that only rank 1's gradient shard holds (after the reduction) is seen by every rank, which
    all skip the step, leave their shards unchanged and halve their scales alike. PP 2 over
    FSDP2 does all of it too, its inf in the last stage's gradients alone."""
    cases = {
        "ddp-fp16": [*BACKENDS["ddp"], "train.precision=fp16"],
        "fsdp-fp16": [*BACKENDS["fsdp"], "train.precision=fp16"],
        "fsdp-pp2-fp16": [*BACKENDS["fsdp"], "train.precision=fp16"]  # (a stage a rank)
        + ["parallel.pipeline_parallel=2", "model.tie_embeddings=false"],
    }
    settings = [
        *common(data_dir, tmp_path, "unused")[1::2],  # the values of its --set pairs
        "train.micro_batch_size=2",
        "checkpoint.every=2",
        "eval.every=0",
    ]
    out = tmp_path / "seen.json"
    script = str(REPO / "tests" / "fp16_world.py")
    run([*torchrun(2, "x")[:5], script, str(out), *map(json.dumps, (settings, cases))], tmp_path)
    seen = json.loads(out.read_text())
    assert list(seen) == list(cases)
    for name, ranks in seen.items():
        for rank, r in enumerate(ranks):
            where = f"{name} rank {rank}"
            straight, resumed = r["straight"], r["resumed"]
            assert straight["1"]["skipped_steps"] == 1 and straight["4"]["skipped_steps"] == 1
            assert [straight[s]["loss_scale"] for s in "1234"] == [2.0**15] * 4, where
            assert r["resumed_at"] == 2, where
            for step in ("3", "4"):  # the scale came back with the checkpoint, not 2**16
                assert resumed[step]["loss_scale"] == 2.0**15, (where, step)
                assert resumed[step]["loss"] == straight[step]["loss"], (where, step)
                assert math.isfinite(resumed[step]["loss"])
        if name.startswith("fsdp"):
            for rank, r in enumerate(ranks):
                where = f"{name} rank {rank}"
                assert r["shard"] == {"changed": False}, where  # the step was skipped here too
                assert r["shard_skipped"] == 1, where
                assert r["shard_scale"] == 2.0**15, where  # (this rank's scaler, not rank 0's log)
                assert r["shard_rows"]["2"]["loss_scale"] == 2.0**15, where
                assert r["shard_rows"]["1"]["loss_scale"] == 2.0**16, where


def test_every_rank_gets_the_communication_settings(runs, ran):
    """NCCL's flight recorder and async error handling are in every rank's environment when
    its process group is made, the dumps go to the run dir's comm_trace/, and after the first
    step every rank's collectives time out in SCALE_LLM_STEP_TIMEOUT_MIN (10 min), not the
    start-up's 30."""
    for name in ("ddp-split", "fsdp-split"):
        ran(name)
        ranks = runs.comm[name]  # (the two runs share one launch: each rank's settings)
        assert len(ranks) == 2
        for settings in ranks:
            env = settings["env"]
            assert env["TORCH_FR_BUFFER_SIZE"] == "20000"
            assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
            assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
            trace = Path(env["TORCH_FR_DUMP_TEMP_FILE"])
            assert trace.name == "rank" and trace.parent.name == "comm_trace"
            assert trace.parent.is_dir()
            assert settings["timeout_s"] == 600.0
        assert (runs.root / name / "comm_trace").is_dir()


def test_zero0_in_bf16_starts_without_a_hidden_optimizer_step():
    """DeepSpeed's ZeRO-0 in bf16 (FP16_UnfusedOptimizer) built AdamW's state with one step on
    zero gradients: the fp32 masters decayed by (1 - lr * wd) = 0.995 and the step count at 1
    before training (0.08 off one process's loss in 4 steps at lr 1e-2). A world of one."""
    script = """
import torch
from scale_llm.components.distributed import start
from scale_llm.config import load_config
from scale_llm.config.plan import Launch, resolve_plan
from scale_llm.model import build_model
from scale_llm.parallel.backend import build_backend

sizes = ["model.vocab_size=512", "model.d_model=32", "model.n_layers=2", "model.n_heads=4"]
zero0 = ["parallel.backend=deepspeed", "parallel.deepspeed.zero_stage=0"]
adamw = ["train.precision=bf16", "train.device=cpu", "train.lr=0.01", "train.weight_decay=0.5"]
cfg = load_config(None, [*sizes, *zero0, *adamw])
plan = resolve_plan(cfg, Launch())
start(plan)
backend = build_backend(cfg, plan)
backend.setup(build_model(cfg.model))
wrapped = backend.model.optimizer
masters = [m for group in wrapped.fp32_groups for m in group]
weights = [w for group in wrapped.fp16_groups for w in group]
print(type(wrapped).__name__, len(wrapped.optimizer.state))
print(max((m - w.float()).abs().max().item() for m, w in zip(masters, weights)))
"""
    done = subprocess.run([sys.executable, "-c", script], env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    kind, states, drift = done.stdout.split()[-3:]
    assert (kind, states, float(drift)) == ("FP16_UnfusedOptimizer", "0", 0.0)
