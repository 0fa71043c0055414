"""Reliability: checkpoints that move between backends and world sizes, processes killed with
SIGKILL (during a save too), torchrun restarting a dead rank, SIGTERM, the checkpoints'
integrity records. (A full disk and damaged checkpoints: tests/test_errors.py.)

Real processes are started and killed; fp32 on CPU, the tiny model of tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from scale_llm.components.checkpoint import CLAIM, Checkpointer
from scale_llm.config import with_changes
from tests.helpers import (
    BACKENDS,
    SINGLE,
    SPLIT,
    TOL,
    common,
    copy_run,
    env,
    make_config,
    plan_for,
    random_texts,
    rows_of,
    run,
    sets,
    snapshot,
    split_run,
    torchrun,
    trainer_for,
    wanted,
)

STEPS = 4
STEP2 = "checkpoints/step_00000002"
OFFLOAD = ["parallel.deepspeed.offload_optimizer=cpu", "parallel.deepspeed.offload_param=cpu"]
TP2 = ["parallel.backend=fsdp", "parallel.tensor_parallel=2"]  # (data-parallel degree 1)
# name: (ranks, overrides, the 2-rank run whose step-2 checkpoint it resumes); the sources are
# the test session's straight runs (tests/test_distributed.py reads them too)
MOVES = {
    "ddp-to-fsdp": (2, [*BACKENDS["fsdp"], *SPLIT], "ddp"),
    "ddp-to-single": (1, SINGLE, "ddp"),
    "fsdp-2-to-1": (
        1,
        [*BACKENDS["fsdp"], "train.micro_batch_size=4", "train.grad_accum=2"],
        "fsdp",
    ),
    "zero2-to-ddp": (2, [*BACKENDS["ddp"], *SPLIT], "zero2"),
    "zero2-to-fsdp": (2, [*BACKENDS["fsdp"], *SPLIT], "zero2"),
    "zero3-to-fsdp": (2, [*BACKENDS["fsdp"], *SPLIT], "zero3"),
    "zero2-to-single": (1, SINGLE, "zero2"),
    "zero2-to-tp": (2, [*TP2, "train.micro_batch_size=4", "train.grad_accum=2"], "zero2"),
    "ddp-to-zero3": (2, [*BACKENDS["zero3"], *SPLIT], "ddp"),
    "fsdp-to-zero2": (2, [*BACKENDS["zero2"], *SPLIT], "fsdp"),
    "zero0-to-fsdp": (2, [*BACKENDS["fsdp"], *SPLIT], "zero0"),
    "zero3-to-zero2": (2, [*BACKENDS["zero2"], *SPLIT], "zero3"),
    "zero2-to-zero2-bf16": (2, [*BACKENDS["zero2"], *SPLIT, "train.precision=bf16"], "zero2"),
    "zero3-offload-to-fsdp": (2, [*BACKENDS["fsdp"], *SPLIT], "zero3-offload"),
    "ddp-to-zero3-offload": (2, [*BACKENDS["zero3"], *OFFLOAD, *SPLIT], "ddp"),
    "fsdp-to-zero2-offload": (
        2,
        [*BACKENDS["zero2"], "parallel.deepspeed.offload_optimizer=cpu", *SPLIT],
        "fsdp",
    ),
    "zero2-to-zero2-offload": (
        2,
        [*BACKENDS["zero2"], "parallel.deepspeed.offload_optimizer=cpu", *SPLIT],
        "zero2",
    ),
}
SOURCES = {"zero3-offload": split_run("zero3", *OFFLOAD)}  # (as tests/test_distributed.py's)


def source(backend: str) -> tuple[str, tuple[int, list[str]]]:
    """A move's source run: its name and spec (a 2-rank split run of `backend` by default)."""
    if backend in SOURCES:
        return backend, SOURCES[backend]
    return f"{backend}-split", split_run(backend)


NEEDS = {  # test: the moves it makes
    "test_dcp_checkpoints_move_between_backends_and_world_sizes": [
        "ddp-to-fsdp", "ddp-to-single", "fsdp-2-to-1"
    ],
    "test_dcp_runs_continue_exactly_under_deepspeed": [
        "fsdp-to-zero2", "ddp-to-zero3", "zero3-to-zero2"
    ],
    "test_zero0_moves_its_weights_only": ["zero0-to-fsdp"],
    "test_a_deepspeed_run_continues_in_another_precision": ["zero2-to-zero2-bf16"],
    "test_offloaded_optimizer_state_moves_too": [
        "zero3-offload-to-fsdp", "ddp-to-zero3-offload", "fsdp-to-zero2-offload",
        "zero2-to-zero2-offload",
    ],
    "test_deepspeed_runs_continue_exactly_on_the_other_backends": [
        "zero2-to-fsdp", "zero3-to-fsdp", "zero2-to-ddp", "zero2-to-single", "zero2-to-tp"
    ],
}  # fmt: skip


def train_cmd(nproc: int, *args: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "scale_llm", "train", *args]
    return torchrun(nproc, *args)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reliability")


@pytest.fixture(scope="module")
def moved(runs, request):
    """`moved(name)`: (console, metrics rows) of the move `name` (MOVES): its source's step-2
    checkpoint resumed. The selected tests' sources train first, together, then their moves
    (one launch per world size)."""
    moves = [m for m in MOVES if m in wanted(request, NEEDS)]
    runs.start(dict(source(MOVES[m][2]) for m in moves))

    def spec(name: str) -> tuple[int, list[str]]:
        nproc, overrides, src = MOVES[name]
        ckpt = runs.root / source(src)[0] / STEP2
        assert ckpt.is_dir(), ckpt  # (keep_last 2 keeps it beside step 4's)
        return nproc, [*overrides, f"checkpoint.resume={ckpt}"]

    runs.start({m: spec(m) for m in moves})

    def get(name: str) -> tuple[str, dict[int, dict]]:
        nproc, overrides = spec(name)
        rows = runs(name, nproc, *overrides)
        assert "at step 2" in runs.stdout[name]
        return runs.stdout[name], rows

    get.root = runs.root
    return get


def same_steps(rows: dict, ref: dict, steps, tol: float = TOL) -> None:
    for step in steps:
        assert abs(rows[step]["loss"] - ref[step]["loss"]) <= tol, (step, rows[step], ref[step])


# ----------------------------------------------------------------------------- portability


def test_dcp_checkpoints_move_between_backends_and_world_sizes(moved, reference):
    """DDP (2 ranks) -> FSDP (2 ranks), -> one process, and FSDP (2 ranks) -> FSDP (1 rank):
    model and optimizer restored, so the curve continues as if never stopped."""
    for name in ("ddp-to-fsdp", "ddp-to-single", "fsdp-2-to-1"):
        _, rows = moved(name)
        same_steps(rows, reference, range(3, STEPS + 1))


def test_deepspeed_runs_continue_exactly_on_the_other_backends(moved, reference):
    """ZeRO-2 and ZeRO-3 stopped at step 2 and continued under FSDP2, TP, DDP and one process: the
    fp32 weights, Adam's moments and step come from the partitions one parameter at a time, so
    the next steps follow the uninterrupted run."""
    for name in (
        "zero2-to-fsdp",
        "zero3-to-fsdp",
        "zero2-to-ddp",
        "zero2-to-single",
        "zero2-to-tp",
    ):
        console, rows = moved(name)
        assert "weights only" not in console, name
        same_steps(rows, reference, range(3, STEPS + 1))
        for step in range(3, STEPS + 1):
            assert abs(rows[step]["grad_norm"] - reference[step]["grad_norm"]) <= TOL, name


def test_dcp_runs_continue_exactly_under_deepspeed(moved, reference):
    """FSDP2 and DDP stopped at step 2 and continued under ZeRO-2 and ZeRO-3, and ZeRO-3 under
    ZeRO-2: each parameter's fp32 weights, Adam's moments and step are handed to DeepSpeed's
    setters, which keep each rank's partition, so the next steps follow the uninterrupted run."""
    for name in ("fsdp-to-zero2", "ddp-to-zero3", "zero3-to-zero2"):
        console, rows = moved(name)
        assert "weights only" not in console, name
        same_steps(rows, reference, range(3, STEPS + 1))


def test_offloaded_optimizer_state_moves_too(moved, reference):
    """ZeRO-3 with its optimizer and parameters on the CPU continued under FSDP2 and the other
    way, and FSDP2 under ZeRO-2 with DeepSpeed's CPU Adam (its step an int): the same curve
    within CPU Adam's rounding (1e-4, as the offloaded runs themselves). ZeRO-2 continued with
    its optimizer offloaded: DeepSpeed's own loader handed torch AdamW's state to CPU Adam
    (KeyError: 'bias_correction' at the first step, after the run dir was rewritten)."""
    moves = ("zero3-offload-to-fsdp", "ddp-to-zero3-offload", "fsdp-to-zero2-offload")
    for name in (*moves, "zero2-to-zero2-offload"):
        console, rows = moved(name)
        assert "weights only" not in console, name
        same_steps(rows, reference, range(3, STEPS + 1), tol=1e-4)


def test_zero0_moves_its_weights_only(moved, reference):
    """ZeRO-0 keeps no partitions: its fp32 weights move exactly (the loss of step 3, computed
    with them, matches); the optimizer moments start again, as the log says."""
    console, rows = moved("zero0-to-fsdp")
    assert "loading its model weights only" in console
    same_steps(rows, reference, [3])


def test_a_deepspeed_run_continues_in_another_precision(moved, reference):
    """ZeRO-2 in fp32 continued under ZeRO-2 in bf16 (`train.precision: auto` on another
    machine): DeepSpeed's own loader looked for the optimizer files of bf16 (KeyError or
    FileNotFoundError after the preflight said ok). They are read one parameter at a time, as
    across backends: step 3, computed in bf16 from the restored weights, stays near the curve."""
    console, rows = moved("zero2-to-zero2-bf16")
    assert "weights only" not in console
    same_steps(rows, reference, [3], tol=5e-2)
    # generate's stdout is its text alone: DeepSpeed's logger, made at its import by the
    # checkpoint's reader, wrote its accelerator line there first (DS_ACCELERATOR unset)
    run = str(moved.root / "zero2-split")
    argv = [sys.executable, "-m", "scale_llm", "generate", run, "--max-new-tokens", "2"]
    plain = {k: v for k, v in env().items() if k != "DS_ACCELERATOR"}
    said = subprocess.run([*argv, "--prompt", "def"], env=plain, capture_output=True)
    assert said.returncode == 0 and said.stdout.decode().startswith("def"), said
    assert "accelerator" in said.stderr.decode().lower()  # (said, where logs go)


def test_convert_writes_one_portable_file(runs, data_dir, root):
    import torch

    from scale_llm.components.checkpoint import load_model_weights
    from scale_llm.model import empty_state_dict
    from scale_llm.train.convert import convert

    nproc, overrides = split_run("ddp")
    runs("ddp-split", nproc, *overrides)
    ddp = runs.root / "ddp-split" / "checkpoints" / "step_00000004"  # the run's latest
    out, n = convert(runs.root / "ddp-split", root / "ddp-model.pt")
    blob = torch.load(out, weights_only=True)
    assert blob["step"] == 4 and blob["config"]["parallel"]["backend"] == "ddp"
    assert blob["qkv_layout"] == "grouped"
    cfg = make_config(data_dir, root)
    direct = load_model_weights(ddp, empty_state_dict(cfg.model))
    assert blob["model"].keys() == direct.keys()
    assert all(torch.equal(blob["model"][k], direct[k]) for k in direct)
    assert n == sum(v.numel() for v in direct.values())


# ----------------------------------------------------------------------------- crashes


def test_sigkill_during_a_save_keeps_the_previous_checkpoint(data_dir, root, reference):
    name = "killed-mid-save"
    args = [*common(data_dir, root, name), *sets(*SINGLE)]
    fault_env = {**env(), "SCALE_LLM_FAULT": "mid_save:4"}
    proc = subprocess.run(
        train_cmd(1, *args), cwd=root, env=fault_env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    ckpts = root / name / "checkpoints"
    assert (ckpts / ".tmp-step_00000004").is_dir()  # the save really was cut short
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000002"]
    proc = run(train_cmd(1, *args), cwd=root)  # relaunch: resumes from the last good one
    assert "at step 2" in proc.stdout
    rows = rows_of(root / name)
    same_steps(rows, reference, range(3, STEPS + 1), tol=0.0)  # bit-identical
    assert not (ckpts / ".tmp-step_00000004").exists()  # the torn save was cleaned up


def test_sigkill_during_a_background_save_keeps_the_previous_checkpoint(data_dir, root, reference):
    """checkpoint.async_mode=async with keep_last=1, a checkpoint every step: the process is
    killed from the writer thread while step 3's files are being written. Step 3 is neither
    adopted nor counted (step 2 was not pruned for it), the relaunch resumes from step 2 and
    continues bit-identically, and the torn save is cleaned up."""
    name = "killed-mid-async-save"
    background = ["checkpoint.async_mode=async", "checkpoint.every=1", "checkpoint.keep_last=1"]
    args = [*common(data_dir, root, name), *sets(*SINGLE, *background)]
    fault_env = {**env(), "SCALE_LLM_FAULT": "mid_save:3"}
    proc = subprocess.run(
        train_cmd(1, *args), cwd=root, env=fault_env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "writing" in proc.stdout and "in the background" in proc.stdout
    ckpts = root / name / "checkpoints"
    assert (ckpts / ".tmp-step_00000003" / "dcp" / "__0_0.distcp").is_file()  # cut short
    assert not (ckpts / ".tmp-step_00000003" / "integrity.json").exists()
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000002"]
    assert Checkpointer(root / name, 1).latest_good() == ckpts / "step_00000002"
    proc = run(train_cmd(1, *args), cwd=root)  # relaunch: resumes from the last good one
    assert "at step 2" in proc.stdout
    same_steps(rows_of(root / name), reference, range(3, STEPS + 1), tol=0.0)  # bit-identical
    kept = sorted(p.name for p in ckpts.iterdir())
    assert kept == [CLAIM, "step_00000004"]  # keep_last=1, no .tmp


def test_a_background_save_holds_its_step_while_training_goes_on(data_dir, tmp_path):
    """The step waits only for the copy to host memory: with the write held in its thread,
    `save` returns and the model takes another step. The checkpoint holds the weights of the
    step it was taken at, appears only once written, and keep_last=1 keeps the previous one
    until then; the kept copy (async_with_pinned_mem) is refilled by the next save."""
    import dataclasses
    import functools
    import threading

    import torch

    from scale_llm.components.checkpoint import DCP_DIR, TRAINER_STATE, damage
    from scale_llm.components.serialization import background_save, dcp_load, save_file
    from scale_llm.model import build_model, empty_state_dict
    from scale_llm.parallel.backend import build_backend
    from scale_llm.parallel.step import optimizer_step

    cfg = make_config(data_dir, tmp_path)
    plan = plan_for(cfg)
    backend = build_backend(cfg, plan)
    model = backend.setup(build_model(cfg.model))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 33))

    def train_one_step() -> dict:
        optimizer_step(backend, model, [(tokens[:, :-1], tokens[:, 1:])])
        return {k: v.clone() for k, v in model.state_dict().items()}

    def write(tmp: Path, foreground: bool = True) -> None:
        if foreground:
            backend.save(tmp)
        save_file({}, tmp / TRAINER_STATE)  # (what makes a step dir complete)

    for mode in ("async", "async_with_pinned_mem"):
        checkpointer = Checkpointer(tmp_path / mode, keep_last=1)
        checkpointer.save(1, write)
        held = threading.Event()
        background = dataclasses.replace(
            background_save(mode, plan.device), on_written=functools.partial(held.wait, 120)
        )
        for step in (2, 3):
            weights = train_one_step()
            try:
                start = functools.partial(backend.save, background=background)
                path = checkpointer.save(step, functools.partial(write, foreground=False), start)
                assert [s for s, _ in checkpointer.complete()] == [step - 1]  # not yet
                assert (checkpointer.dir / f".tmp-step_0000000{step}" / TRAINER_STATE).is_file()
                after = train_one_step()  # the step goes on while the write is held
                assert not all(torch.equal(after[k], weights[k]) for k in weights)
            finally:
                held.set()
            assert checkpointer.wait() == path
            held.clear()
            assert [s for s, _ in checkpointer.complete()] == [step]  # step - 1 pruned now
            assert damage(path) is None
            # (the model's DCP files as written: this test's trainer.pt is a placeholder)
            saved = {"model": empty_state_dict(cfg.model)}
            dcp_load(saved, path / DCP_DIR, no_dist=True)
            saved = saved["model"]
            assert all(torch.equal(saved[k], weights[k]) for k in weights), mode


def test_out_of_disk_in_a_background_write_is_the_foreground_saves_error(
    data_dir, tmp_path, monkeypatch
):
    """The disk fills inside DCP's writer thread while step 4 is written in the background:
    the end of training waits for it and stops with the message a foreground save gives, the
    partial files removed and step 2 intact."""
    import errno

    import torch.distributed.checkpoint.filesystem as fs

    from scale_llm.errors import UserError

    cfg = make_config(data_dir, tmp_path, "checkpoint.every=2", "checkpoint.async_mode=async")
    tr = trainer_for(cfg)
    write_item = fs._write_item

    def full_disk(transforms, stream, *args, **kwargs):
        if "step_00000004" in stream.name:  # (the writer thread's file of step 4)
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_item(transforms, stream, *args, **kwargs)

    monkeypatch.setattr(fs, "_write_item", full_disk)
    with pytest.raises(UserError, match="out of disk space while writing checkpoint") as info:
        tr.fit()
    assert "step_00000004" in str(info.value) and "step_00000002 is intact" in str(info.value)
    kept = sorted(p.name for p in tr.checkpointer.dir.iterdir())
    assert kept == [CLAIM, "step_00000002"]


def test_the_run_lock_outlives_a_background_save_a_second_ctrl_c_left(
    data_dir, tmp_path, monkeypatch
):
    """A second Ctrl-C while the end of training waited for a background save: the run's locks
    were released while the save still wrote into the checkpoints folder (a new launch took
    them, and two processes pruned and renamed there). And a second SIGTERM meanwhile (Slurm's
    and the launcher's, say) killed the process with the last save half written: it is taken as
    the first was, through the end."""
    from scale_llm.train import callbacks
    from scale_llm.train.guards import StopSignals

    cfg = make_config(data_dir, tmp_path, "checkpoint.every=2", "checkpoint.async_mode=async")
    tr = trainer_for(cfg)
    locks = [lock.path for lock in tr.lock.locks]
    publish, held, on_term = Checkpointer._publish, [], []

    def slow(self, tmp, final, *args, **kwargs):
        time.sleep(0.5)  # (the Ctrl-C lands meanwhile)
        held.append([path.exists() for path in locks])
        return publish(self, tmp, final, *args, **kwargs)

    def interrupted(self, trainer, failing):  # the wait for step 4's save, cut by Ctrl-C
        on_term.append(getattr(signal.getsignal(signal.SIGTERM), "__self__", None))
        raise KeyboardInterrupt

    monkeypatch.setattr(Checkpointer, "_publish", slow)
    monkeypatch.setattr(callbacks.Checkpoints, "end", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tr.fit()
    tr.checkpointer._publisher.shutdown(wait=True)
    assert held == [[True, True], [True, True]]  # (steps 2 and 4)
    assert not any(path.exists() for path in locks)  # released after
    assert [type(handler) for handler in on_term] == [StopSignals]
    # a Ctrl-C in the drain is raised (the caller keeps its locks)
    import threading
    from concurrent.futures import Future

    gate, calls = threading.Event(), []
    tr.checkpointer._publisher = ThreadPoolExecutor(1)
    tr.checkpointer._publisher.submit(gate.wait, 30)  # (bounded: a failing test still ends)

    def result(self, timeout=None):
        calls.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(Future, "result", result)
    # in the end's wait, with the run's own error in flight: that error stays the one raised
    pending = (tmp_path / "step_00000009", Future())
    tr.checkpointer._pending = pending
    try:
        assert tr.checkpointer.wait(failing=True) is None
    except KeyboardInterrupt:
        gate.set()
        pytest.fail("a Ctrl-C in the end's wait replaced the run's own error")
    tr.checkpointer._pending = pending  # (without one: raised)
    with pytest.raises(KeyboardInterrupt):
        tr.checkpointer.wait()
    with pytest.raises(KeyboardInterrupt):  # the drain after it: raised
        tr.checkpointer.drain()
    gate.set()
    assert len(calls) == 3


@pytest.mark.parametrize("evaluated", [False, True])
def test_a_stop_signal_during_a_steps_save_stops_after_that_step(
    data_dir, tmp_path, monkeypatch, evaluated
):
    """A SIGTERM that came while step 2's save waited (for the write before it) was read only
    after step 3: one more step trained and saved, twice the shutdown I/O in a grace window.
    And where step 2 had an evaluation, its row (written before the save) never got the stop's
    loss: metrics.jsonl and `runs` ended at step 1's."""
    settings = ["checkpoint.every=2", "train.max_steps=6", "logging.every=5"]
    cfg = make_config(data_dir, tmp_path, *settings, f"eval.every={2 if evaluated else 0}")
    tr = trainer_for(cfg)
    save = tr.save_checkpoint

    def signalled():
        saved = save()
        if tr.step == 2:
            signal.raise_signal(signal.SIGTERM)  # (StopSignals takes it: no exit)
        return saved

    monkeypatch.setattr(tr, "save_checkpoint", signalled)
    result = tr.fit()
    assert result.steps == 2 and result.stopped == "signal SIGTERM"
    assert [step for step, _ in tr.checkpointer.complete()] == [2]
    rows = rows_of(tr.run_dir)  # the stop's step has its row (not a logging step)
    assert sorted(rows) == [1, 2] and "loss" in rows[2] and "tokens" in rows[2]
    assert ("val_loss" in rows[2]) == evaluated


def test_a_failing_save_keeps_its_steps_row(data_dir, tmp_path, monkeypatch):
    """A step's row is written after its save (so a stop during the save adds the step's
    numbers to it); a save that fails still leaves the row (loss and val_loss) behind it."""
    from scale_llm.errors import UserError

    settings = ["checkpoint.every=2", "train.max_steps=6", "logging.every=2", "eval.every=2"]
    tr = trainer_for(make_config(data_dir, tmp_path, *settings))

    def full_disk():
        raise UserError("the disk is full")

    monkeypatch.setattr(tr, "save_checkpoint", full_disk)
    with pytest.raises(UserError, match="the disk is full"):
        tr.fit()
    rows = rows_of(tr.run_dir)
    assert sorted(rows) == [1, 2] and {"loss", "val_loss"} <= rows[2].keys()


def test_torchrun_restarts_a_killed_rank_and_the_run_resumes(data_dir, root, reference):
    name = "restarted"
    args = [*common(data_dir, root, name), *sets(*BACKENDS["ddp"], *SPLIT)]
    cmd = torchrun(2, *args)
    cmd.insert(cmd.index("--standalone") + 1, "--max-restarts=1")
    fault_env = {**env(), "SCALE_LLM_FAULT": "after_step:3:1"}  # rank 1 dies after step 3
    proc = subprocess.run(cmd, cwd=root, env=fault_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fault injection: killing rank 1" in proc.stdout + proc.stderr
    assert "resume: continuing from" in proc.stdout and "at step 2" in proc.stdout
    rows = rows_of(root / name)
    assert sorted(rows) == [1, 2, 3, 4]
    same_steps(rows, reference, range(1, STEPS + 1))


def wait_for_step(path: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        if path.is_file() and any(
            json.loads(x)["step"] >= step for x in path.read_text().splitlines() if x.strip()
        ):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{path} never reached step {step}")


@pytest.mark.parametrize(
    ("nproc", "sig"), [(1, signal.SIGTERM), (1, signal.SIGINT), (2, signal.SIGTERM)]
)
def test_stop_signal_saves_a_final_checkpoint_on_every_rank(data_dir, root, nproc, sig):
    name = f"{sig.name}-{nproc}"
    backend = ["parallel.backend=ddp"] if nproc == 2 else []
    args = [
        *common(data_dir, root, name),
        *sets(
            *backend,
            "train.max_steps=100000",
            "checkpoint.every=0",
            "eval.every=0",
            "train.micro_batch_size=2",
        ),
    ]
    proc = subprocess.Popen(
        train_cmd(nproc, *args),
        cwd=root,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_step(root / name / "metrics.jsonl", 2, proc)
    proc.send_signal(sig)  # torchrun forwards it to its workers
    out = proc.communicate(timeout=300)[0]
    if nproc == 1:
        assert proc.returncode == 0, out[-3000:]
    assert f"stop: signal {sig.name} after step" in out, out[-3000:]
    for rank in range(nproc):  # every rank got the signal and took part in the save
        where = f"[rank {rank}] " if nproc > 1 else ""
        assert f"{where}WARNING: received {sig.name}" in out
    ckpts = sorted((root / name / "checkpoints").glob("step_*"))
    assert len(ckpts) == 1 and (ckpts[0] / "trainer.pt").is_file()
    assert len(list((ckpts[0] / "dcp").glob("*.distcp"))) == nproc


def test_resuming_an_older_checkpoint_moves_the_newer_ones_aside(data_dir, tmp_path, logs):
    """Issue 14: resuming from an older checkpoint on purpose, a later `auto` silently went back
    to the abandoned newer ones. Now they move to checkpoints/abandoned-<time>/ (kept, out of
    reach of auto and pruning), and the new branch continues from the chosen step."""
    common = ["train.max_steps=4", "checkpoint.every=1", "checkpoint.keep_last=5"]
    cfg = make_config(data_dir, tmp_path / "runs", *common)
    trainer_for(cfg).fit()
    ckpts = cfg.run_dir / "checkpoints"
    old4 = (ckpts / "step_00000004" / "trainer.pt").read_bytes()
    branch = make_config(
        data_dir, tmp_path / "runs", *common, f"checkpoint.resume={ckpts / 'step_00000002'}"
    )
    tr = trainer_for(branch)
    assert tr.step == 2 and "starts a new branch" in logs.text
    (aside,) = ckpts.glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000003", "step_00000004"]
    assert (aside / "step_00000004" / "trainer.pt").read_bytes() == old4  # moved, not deleted
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000001", "step_00000002"]
    tr.fit()
    # a later auto launch sees the new branch's step 4, not the abandoned one
    again = make_config(data_dir, tmp_path / "runs", *common)
    assert Checkpointer(cfg.run_dir, 5).latest() == ckpts / "step_00000004"
    assert (ckpts / "step_00000004" / "trainer.pt").read_bytes() != old4
    assert trainer_for(again).complete
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000003", "step_00000004"]
    # another run's checkpoint: this run's own (another history) move aside too (pruned before)
    mine = ["run.name=mine", "checkpoint.every=1", "checkpoint.keep_last=1"]
    trainer_for(make_config(data_dir, tmp_path / "runs", *mine, "train.max_steps=2")).fit()
    own = tmp_path / "runs" / "mine" / "checkpoints"
    kept = (own / "step_00000002" / "trainer.pt").read_bytes()
    (own / "step_notes").mkdir()  # (not a checkpoint: stays)
    onto = [*mine, "train.max_steps=5", f"checkpoint.resume={ckpts / 'step_00000004'}"]
    trainer_for(make_config(data_dir, tmp_path / "runs", *onto)).fit()
    moved = own.glob("abandoned-*/step_00000002/trainer.pt")
    assert [p.read_bytes() for p in moved] == [kept]
    assert sorted(p.name for p in own.glob("step_*")) == ["step_00000005", "step_notes"]
    # and its metric rows: another history, so none stays beside the new branch's
    rows = own.parent / "metrics.jsonl"
    assert [json.loads(x)["step"] for x in rows.read_text().splitlines()] == [5]
    (aside,) = own.parent.glob("metrics-*.jsonl")
    assert [json.loads(x)["step"] for x in aside.read_text().splitlines()] == [1, 2]


# ----------------------------------------------------------------------------- damage


def test_checkpoint_io_bench_times_the_save_and_its_integrity_record(data_dir, tmp_path):
    from scale_llm.analysis.bench import BACKGROUND, bench_checkpoint

    cfg = make_config(data_dir, tmp_path)
    rows = bench_checkpoint(cfg, plan_for(cfg), tmp_path / "io", rounds=1)
    assert [r["kind"] for r in rows] == ["plain", "with record", *BACKGROUND]
    assert all(r["gb"] > 0 and r["save_s"] >= r["blocking_s"] > 0 for r in rows)
    assert rows[1]["record_alone_s"] > 0 and rows[1]["verify_s"] > 0
    assert rows[1]["hashed_while_writing_gb"] > 0.9 * rows[1]["gb"]  # DCP's files: all of it
    assert 0 <= rows[1]["hash_stall_s"] < rows[1]["save_s"]
    assert not (tmp_path / "io").exists()


def test_a_stop_signal_ends_bench_and_check_through_their_cleanup(data_dir, tmp_path):
    """SIGTERM killed `bench --checkpoint-io DIR` at once, leaving its checkpoint-sized folder
    in DIR; stopped `check`'s torchrun launch without stopping it (it went on holding the
    GPUs); and was taken by a curve's run as its own stop, the check then going on to report
    the curve cut short as ok, exit 0. Each ends through its cleanup, 128 + the signal."""
    import os
    import threading

    from scale_llm.analysis import check
    from scale_llm.config import save_config
    from scale_llm.errors import Stopped, note_stop, stop_signals_raise
    from scale_llm.train.trainer import TrainResult

    save_config(make_config(data_dir, tmp_path / "runs"), tmp_path / "c.yaml")
    io = tmp_path / "io"  # (a folder of the user's: the bench's copy goes in it)
    io.mkdir()
    cmd = [sys.executable, "-m", "scale_llm", "bench", str(tmp_path / "c.yaml")]
    proc = subprocess.Popen(
        [*cmd, "--checkpoint-io", str(io), "--rounds", "500"], env=env(), stderr=subprocess.PIPE
    )
    deadline = time.time() + 120
    while not (io.is_dir() and any(io.iterdir())) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # (into its saves)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    assert "stopped by SIGTERM" in err.decode() and list(io.iterdir()) == []
    # a launch the check started stops with it
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"

    def stop_once_started() -> None:  # (the child up: a Python start takes seconds under load)
        deadline = time.time() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_started, daemon=True).start()
    with pytest.raises(Stopped), stop_signals_raise():
        check._run_stoppable([sys.executable, "-c", child], dict(os.environ), 100)
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

    # a curve whose run took a SIGTERM (as its stop, or during its last save, after its loop):
    # the check stops, its report unfinished
    def stopped(cfg, plan):
        note_stop(signal.SIGTERM)  # (as the run's own handler does)
        return TrainResult(tmp_path, 2, losses={1: 9.0, 2: 8.0})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(check, "train", stopped)
        mp.setattr(check, "prepared", lambda cfg: {"dir": str(cfg.data.dir)})
        out = tmp_path / "out"
        with pytest.raises(Stopped):
            check.run_check(out, steps=2, scratch=tmp_path / "scratch", only={"curves"})
    report = json.loads((out / "report.json").read_text())
    assert not report["finished"] and not report["ok"] and "curves" not in report

    # an error that ends an item (or the command) after a stop signal is that stop: DCP's save
    # wraps what it caught in its CheckpointException (a traceback, exit 1, 4 times in 12)
    from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException)

    def wrapped():
        raise RuntimeError("a save's error") from Stopped(signal.SIGTERM)

    with pytest.raises(Stopped):
        check.Report(tmp_path / "out2", None).attempt("sweep", "a save", wrapped)
    with pytest.raises(Stopped), stop_signals_raise():  # (as DCP's save raises it)
        raise CheckpointException("a save", {0: (Stopped(signal.SIGTERM), None)})
    with pytest.raises(RuntimeError), stop_signals_raise():  # (after a stop: still its own error)
        note_stop(signal.SIGTERM)
        raise RuntimeError("disk full")


def test_a_hangup_nohup_ignores_stays_ignored():
    """Every command but train and prepare takes SIGTERM and SIGHUP as a stop: under nohup (SIGHUP
    ignored) a logout ended `nohup scale-llm export ... &` with exit 129."""
    from scale_llm.errors import stop_signals_raise

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_signals_raise():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert callable(signal.getsignal(signal.SIGTERM))
            os.kill(os.getpid(), signal.SIGHUP)  # (nothing: ignored)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_checkpoint_io_bench_on_deepspeed_times_its_foreground_saves_only(tmp_path):
    """DeepSpeed's engine has no background save: the bench's async rows were a traceback.
    (A stand-in backend that saves one file, under a DeepSpeed plan.)"""
    import dataclasses

    from scale_llm.analysis.bench import _time_checkpoints
    from tests.helpers import batch_plan

    class Engine:
        def save(self, directory, background=None):
            assert background is None, "DeepSpeed was asked for a background save"
            (directory / "mp_rank_00_model_states.pt").write_bytes(b"x" * 4096)

    plan = dataclasses.replace(batch_plan(1, 1), backend="deepspeed")
    (tmp_path / "io").mkdir()
    rows = _time_checkpoints(Engine(), plan, tmp_path / "io", rounds=1)
    assert [r["kind"] for r in rows] == ["plain", "with record"]


def test_digests_taken_while_dcp_writes_are_the_files_own_and_a_seek_drops_them(tmp_path):
    """DCP's files are hashed as they are written (the record's cost rides along with the
    write); what a checkpoint records is what hashing the files afterwards gives, and a file
    not written front to back exactly once is left to be hashed afterwards."""
    import torch

    from scale_llm.components import digests
    from scale_llm.components.checkpoint import integrity_record, written_entries
    from scale_llm.components.serialization import dcp_save

    state = {"model": {f"w{i}": torch.randn(700, 600) for i in range(3)}, "step": 7}
    ckpt = tmp_path / "ckpt"
    with digests.recording() as written:
        dcp_save(state, ckpt / "dcp", no_dist=True)
        fs = digests.HashingFileSystem()
        with fs.create_stream(ckpt / "sought.bin", "wb") as f:
            f.write(b"a" * 100)
            f.seek(10)
            f.write(b"b")
        with fs.create_stream(ckpt / "straight.bin", "wb") as f:
            f.write(bytes(3 << 20))  # one buffer hashed in the helper thread
            f.write(b"tail")
    entries = written_entries(ckpt, written)
    assert set(entries) == {"dcp/__0_0.distcp", "dcp/.metadata", "straight.bin"}  # renamed
    assert entries == {k: v for k, v in integrity_record(ckpt).items() if k in entries}
    assert entries["dcp/__0_0.distcp"]["size"] > 3 * 700 * 600 * 4
    with digests.HashingFileSystem().create_stream(tmp_path / "outside.bin", "wb") as f:
        f.write(b"x")  # no recording: a plain file
    assert (tmp_path / "outside.bin").read_bytes() == b"x"
    assert len(written) == 3  # nothing recorded after the block


def test_a_saved_checkpoints_record_equals_hashing_its_files_afterwards(data_dir, tmp_path):
    from scale_llm.components.checkpoint import INTEGRITY, damage, integrity_record

    cfg = make_config(data_dir, tmp_path, "train.max_steps=2", "checkpoint.every=2")
    trainer_for(cfg).fit()
    ckpt = Checkpointer(Path(cfg.run.dir) / cfg.run.name, 1).latest()
    record = json.loads((ckpt / INTEGRITY).read_text())["files"]
    assert record == integrity_record(ckpt) and "dcp/__0_0.distcp" in record
    assert damage(ckpt) is None


def test_ranks_split_the_integrity_hashing_and_cover_every_file_once(tmp_path):
    """Each rank hashes its share of a checkpoint's files (largest first to the least loaded
    rank); the shares are disjoint and together they are the one-process record."""
    import os

    from scale_llm.components.checkpoint import integrity_record

    ckpt = tmp_path / "ckpt"
    (ckpt / "dcp").mkdir(parents=True)
    for i, size in enumerate([5000, 3000, 3000, 10, 0, 700]):
        (ckpt / "dcp" / f"__{i}_0.distcp").write_bytes(os.urandom(size))
    (ckpt / "trainer.pt").write_bytes(b"x" * 42)
    whole = integrity_record(ckpt)
    assert len(whole) == 7
    shares = [integrity_record(ckpt, rank, 3) for rank in range(3)]
    assert all(shares) and sum(len(s) for s in shares) == len(whole)
    assert {k: v for s in shares for k, v in s.items()} == whole
    sizes = [sum(v["size"] for v in s.values()) for s in shares]
    assert max(sizes) == 5000  # the largest file alone; the rest spread over the other two


@pytest.mark.parametrize(
    ("keep_last", "earlier", "advice"),
    [
        (1, 1, "; free space, or move run.dir to a larger disk"),
        (3, 0, "no earlier checkpoint exists; free space, or move run.dir to a larger disk"),
        (3, 1, "; free space, or move run.dir to a larger disk"),
        (
            3,
            2,
            "; free space, lower checkpoint.keep_last (now 3: 2 earlier checkpoints stay on disk "
            "while the next is written), or move run.dir to a larger disk",
        ),
    ],
)
def test_out_of_disk_advice_names_keep_last_only_where_lowering_it_frees_room(
    tmp_path, keep_last, earlier, advice
):
    """'lower checkpoint.keep_last' was advised at keep_last 1 and with no earlier checkpoint,
    where it frees nothing (pruning follows a save)."""
    import errno

    from scale_llm.components.checkpoint import TRAINER_STATE, checkpoint_name
    from scale_llm.errors import UserError

    checkpointer = Checkpointer(tmp_path, keep_last=keep_last)
    for step in range(1, earlier + 1):
        (checkpointer.dir / checkpoint_name(step)).mkdir(parents=True)
        (checkpointer.dir / checkpoint_name(step) / TRAINER_STATE).write_bytes(b"x")

    def full_disk(tmp: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError) as info:
        checkpointer.save(9, full_disk)
    assert str(info.value).endswith(advice), str(info.value)


def test_the_launchers_prepare_keeps_the_tokenizer_a_run_resumes_with(
    four_steps, data_dir, corpus_dir, tmp_path, capsys
):
    """Every launcher runs `prepare --as-train` before `train`: a corpus changed since a run's
    checkpoints rebuilt data.dir with a tokenizer trained on it, and the run could no longer
    resume (the old data gone). Now that prepare stops before it publishes, data.dir untouched;
    `checkpoint.resume=never` (no run to resume) keeps nothing."""
    import shutil

    from scale_llm.cli import main
    from scale_llm.config import save_config
    from scale_llm.train.resume import kept_data

    run = copy_run(four_steps, tmp_path)  # trained on data_dir's tokenizer
    data, corpus = tmp_path / "data", tmp_path / "corpus"
    shutil.copytree(data_dir, data)
    shutil.copytree(corpus_dir, corpus)
    (corpus / "000_new.py").write_text("\n".join(random_texts(300, "new{i}", seed=3)))
    cfg = make_config(data, tmp_path / "runs", f"data.source={corpus}")
    cfg = with_changes(cfg, {"data.tokenizer_sample_bytes": 500000, "data.val_fraction": 0.1})
    save_config(cfg, tmp_path / "run.yaml")
    assert kept_data(cfg).checkpoint == run / "checkpoints" / "step_00000004"
    assert kept_data(with_changes(cfg, {"checkpoint.resume": "never"})) is None
    before = snapshot(data)
    capsys.readouterr()
    assert main(["prepare", "--as-train", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"data.dir={data} would be rebuilt with another tokenizer" in err
    assert f"{run}/checkpoints/step_00000004 was trained with the one it holds" in err
    assert "Traceback" not in err and snapshot(data) == before  # no build left, nothing replaced
    # a damaged newest checkpoint: auto resumes the one before it, which keeps the data too
    (run / "checkpoints" / "step_00000004" / "trainer.pt").write_bytes(b"damaged")
    assert kept_data(cfg).checkpoint == run / "checkpoints" / "step_00000002"


def test_a_deepspeed_checkpoint_saved_without_its_precision_is_read_by_its_own_loader():
    """A layout saved before it named its precision (and its optimizer offload) takes the plan's
    (and the config's): a ZeRO-0 run resumed exactly again (it was read across layouts: weights
    only, the optimizer restarted)."""
    from scale_llm.config import load_config, to_dict
    from scale_llm.config.plan import target_plan
    from scale_llm.parallel.backend import checkpoint_layout
    from scale_llm.train.resume import saved_layout

    cfg = load_config(None, [*BACKENDS["zero0"], "train.precision=fp32", "train.device=cpu"])
    now = checkpoint_layout(cfg, target_plan(cfg, 2))
    older = {k: v for k, v in now.items() if k not in ("precision", "offload_optimizer")}
    state = {"backend": {"layout": older}, "plan": {"precision": "fp32"}, "config": to_dict(cfg)}
    assert now["precision"] == "fp32" and saved_layout(state) == now
    state["plan"]["precision"] = "bf16"  # (its own precision: read across layouts, as it must)
    assert saved_layout(state) != now
    state["plan"]["precision"] = "fp32"
    state["config"]["parallel"]["deepspeed"]["offload_optimizer"] = "cpu"  # (CPU Adam's)
    assert saved_layout(state) == {**now, "offload_optimizer": "cpu"} != now
    state["config"]["parallel"] = []  # (a state no run wrote: its own loader's default)
    assert saved_layout(state) == now
