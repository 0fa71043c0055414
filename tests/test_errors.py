"""The whole bad-input table: each user mistake, damaged artifact or hostile file ends with exit
code 2 and one message naming the key or file and the fix, no traceback, and nothing written or
lost; or, where the docs say so, it is handled safely (skipped with one warning, a fallback to
the newest good checkpoint, a fresh start of prepare's build).

`test_broken_input` runs every row of tests/bad_input_cases.py's tables with the same checks; the
other tests are the cases of another shape. docs/reliability.md ("Bad input") lists them all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch

from scale_llm.cli import main
from scale_llm.components.checkpoint import CLAIM, INTEGRITY, Checkpointer, damage
from scale_llm.errors import UserError
from scale_llm.train.trainer import Trainer
from tests.bad_input_cases import (
    CASES,
    CORPUS_SKIPS,
    DAMAGES,
    FAULT_SPECS,
    FILES,
    INIT_CONFIG_FIELDS,
    INIT_TENSORS,
    ONE_LINE,
    PROGRESS_DAMAGE,
    QUOTING,
    RUN_DIR_ENTRIES,
    STEP2,
    STEP4,
    TINY,
    Ctx,
    OneLine,
    Quoting,
    Setup,
    Without,
    damaged_build,
    s,
    without_wandb_credentials,
)
from tests.helpers import (
    Payload,
    copy_run,
    documents_of,
    env,
    finished_run,
    logged,
    make_config,
    plan_for,
    random_texts,
    snapshot,
    trainer_for,
    tree,
    write_file,
    write_jsonl,
)

REPO = Path(__file__).resolve().parents[1]


def trainer(data_dir: Path, tmp_path: Path, *overrides: str) -> Trainer:
    cfg = make_config(data_dir, tmp_path / "runs", *overrides)
    return trainer_for(cfg)


def resume_auto(data_dir: Path, tmp_path: Path, *overrides: str) -> Trainer:
    return trainer(data_dir, tmp_path, "checkpoint.every=2", "train.max_steps=6", *overrides)


# ================================================================================== every table row


def assert_says(err: str, *expected) -> None:
    """Each excerpt is in the message (a pattern matches it; a Without is not in it)."""
    for item in expected:
        if isinstance(item, re.Pattern):
            assert item.search(err), (item.pattern, err[:2000])
        elif isinstance(item, Without):
            assert item.text not in err, err[:2000]
        elif isinstance(item, (Quoting, OneLine)):
            continue
        else:
            assert item in err, (item, err[:2000])


def one_paragraph(err: str) -> bool:
    """The message alone, as one paragraph: `error: ...` first (no log line before it), no
    blank line, one newline at the end."""
    lines = err.removesuffix("\n").split("\n")
    return lines[0].startswith("error: ") and all(line.strip() for line in lines)


def changed(before: dict, after: dict) -> dict:
    """The entries a snapshot gained, lost or saw change: {path: (before, after)}."""
    return {
        k: (before.get(k), after.get(k)) for k in before | after if before.get(k) != after.get(k)
    }


@pytest.mark.parametrize(("case", "argv", "expected"), CASES, ids=[c[0] for c in CASES])
def test_broken_input(case, argv, expected, request, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name, content in FILES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(content)
    (tmp_path / "folder").mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    watch = [tmp_path]
    if callable(argv):
        setup = argv(Ctx(tmp_path, request, monkeypatch))
    elif any("DATA" in a for a in argv):
        data_dir = request.getfixturevalue("data_dir")
        setup = Setup([a.replace("DATA", str(data_dir)) for a in argv])
        watch.append(data_dir)
    else:
        setup = Setup(argv)
    if not isinstance(setup, Setup):
        setup = Setup(setup)
    watch = setup.watch or watch
    before = [snapshot(p) for p in watch]
    capsys.readouterr()
    code = main(setup.argv)
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert_says(err, *(expected if isinstance(expected, tuple) else (expected,)), *setup.expect)
    assert "Traceback" not in err and len(err) < 5000  # never a huge value repeated back
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert one_paragraph(err) or (QUOTING in expected and err.startswith("error: ")), err[:3000]
    if ONE_LINE in expected:
        assert err.count("\n") == 1, err
    for path, old in zip(watch, before):  # nothing written, nothing lost
        diff = changed(old, snapshot(path))
        assert not diff, diff
    if setup.then is not None:
        setup.then()


def test_user_errors_exit_2_but_internal_errors_keep_their_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "scale_llm", "train", "--set", "train.lr=-1"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    code = (
        "import scale_llm.cli as c\n"
        "c.COMMANDS['prepare'] = lambda args: 1 / 0\n"
        "raise SystemExit(c.main(['prepare']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        proc.returncode == 1 and "Traceback" in proc.stderr and "ZeroDivisionError" in proc.stderr
    )


# =========================================================================================== config


def test_cli_reports_config_errors_with_exit_code_2_and_no_traceback(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lrr: 1\nmodel:\n  d_model: -1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "scale_llm", "train", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "train.lrr: unknown key; did you mean train.lr?" in proc.stderr
    assert "model.d_model=-1 must be > 0" in proc.stderr


def test_a_section_with_every_key_commented_out_is_empty(tmp_path):
    """`model:` with nothing under it is YAML null: read as an empty section, here and over a
    base file (whose values it keeps)."""
    from scale_llm.config import Config, load_config

    (tmp_path / "base.yaml").write_text("model:\n  d_model: 64\n")
    (tmp_path / "top.yaml").write_text("base: base.yaml\nmodel:\n  # d_model: 128\ntrain:\n")
    (tmp_path / "alone.yaml").write_text("model:\n  # d_model: 128\n")
    assert load_config(tmp_path / "top.yaml").model.d_model == 64
    assert load_config(tmp_path / "alone.yaml") == Config()


def test_run_name_is_a_name_not_a_path():
    from scale_llm.config import load_config

    for bad in ("..", "../x", "a/b", "a\\b", "-x", "."):
        with pytest.raises(UserError, match="must be a plain name"):
            load_config(None, [f"run.name={bad}"])
    for good in ("400m-fsdp_v2.1", "quoted $(x) 'y'"):
        assert load_config(None, [f"run.name={good}"]).run.name == good


def test_running_out_of_device_memory_is_one_paragraph_with_the_ways_to_fit(
    data_dir, tmp_path, monkeypatch
):
    """A device's out-of-memory error in a step becomes a UserError (no traceback) that says
    what ran out, the estimate for these settings and the commands that fit them."""
    tr = trainer(data_dir, tmp_path)

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nSECOND LINE")

    tr.train_step = out_of_memory
    with pytest.raises(UserError) as info:
        tr.fit()
    msg = str(info.value)
    assert "rank 0 ran out of CPU memory in step 1 (CUDA out of memory. Tried to allocate" in msg
    assert "SECOND LINE" not in msg  # the first line of torch's message only
    assert f"`scale-llm estimate {tr.run_dir / 'config.yaml'} --fit SIZE`" in msg
    assert "micro-batch 4 x seq_len" in msg and "train --fit auto" in msg
    assert "activation_checkpointing.mode=full" in msg and "\n" not in msg
    # in the work after a step (evaluation, samples, eval.tasks, a save): a traceback before
    from scale_llm.train import callbacks

    tr = trainer(data_dir, tmp_path, "eval.every=2", "train.max_steps=4")

    def evaluate(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB.")

    monkeypatch.setattr(callbacks.Validation, "evaluate", evaluate)
    with pytest.raises(UserError) as info:
        tr.fit()
    msg = str(info.value)
    assert msg.startswith("rank 0 ran out of CPU memory after step 2, in its evaluation, samples")
    assert "eval.tasks" not in msg and "\n" not in msg  # (a run without them)
    from scale_llm.config import with_changes
    from scale_llm.train.guards import out_of_memory

    tasks = with_changes(tr.cfg, {"eval.tasks": "hellaswag"})
    said = out_of_memory(torch.OutOfMemoryError("CUDA out of memory."), tasks, tr.plan, 2, True)
    assert "samples, eval.tasks or save" in said
    assert "set eval.tasks: null and run `scale-llm eval` on a checkpoint instead" in said


def test_bench_checks_host_memory_before_allocating_and_a_sweep_row_says_so(tmp_path, monkeypatch):
    from scale_llm.analysis.bench import bench_sweep
    from scale_llm.analysis.memory import check_host_memory, host_memory_problem
    from scale_llm.analysis.memory import host as host_mod
    from scale_llm.config import load_config
    from tests.helpers import TINY_MODEL

    cfg = load_config(None, [*TINY_MODEL, "train.device=cpu"])
    plan = plan_for(cfg)
    assert host_memory_problem(cfg, plan) is None
    monkeypatch.setattr(host_mod, "host_available_bytes", lambda: 1024)  # a 1 KiB host
    with pytest.raises(UserError, match=r"needs about .* GiB of host memory .* 2 models at once"):
        check_host_memory(cfg, plan, models=2)

    def never(*a, **k):
        raise AssertionError("a row that does not fit the host was run")

    monkeypatch.setattr("scale_llm.analysis.bench.build_model", never)
    rows = bench_sweep(cfg, plan, [1, 2], ["none"], [False], steps=1, warmup=0)
    assert [r["oom"] for r in rows] == [True, True]
    assert all("GiB of host memory" in r["host_memory"] for r in rows)


def test_a_sweep_row_the_config_refuses_is_not_run(monkeypatch):
    """A row's changes can make a config the preflight refuses (selective checkpointing under a
    V schedule, a micro-batch a pipeline cannot cut): the row says why and nothing runs."""
    from scale_llm.analysis.bench import bench_sweep, markdown_table
    from scale_llm.config import load_config
    from scale_llm.config.plan import Launch, resolve_plan
    from tests.helpers import REPO

    sets = ["parallel.backend=fsdp", "parallel.pipeline_parallel=2", "model.tie_embeddings=false"]
    sets += ["parallel.pipeline.schedule=zero_bubble", "activation_checkpointing.mode=full"]
    cfg = load_config(REPO / "yaml" / "tiny.yaml", sets)

    def never(*a, **k):
        raise AssertionError("a refused row was run")

    monkeypatch.setattr("scale_llm.analysis.bench.build_model", never)
    monkeypatch.setattr("scale_llm.components.distributed.start", never)
    plan = resolve_plan(cfg, Launch(world_size=2))
    rows = bench_sweep(cfg, plan, [1], ["selective", "full"], [False])
    refused = [r.get("refused", "") for r in rows]
    assert "activation_checkpointing.mode=selective with parallel.pipeline.schedule" in refused[0]
    assert "train.micro_batch_size=1 cannot be cut" in refused[1] and len(rows) == 2
    assert "| - |" in markdown_table(rows) and "OOM" not in markdown_table(rows)
    # fp8 under a swept DDP (the launch's rule): a row, not an exit that lost the measured rows
    fp8 = load_config(REPO / "yaml" / "tiny.yaml", ["train.fp8.enabled=true"])
    rows = bench_sweep(fp8, resolve_plan(fp8, Launch()), [1], ["none"], [False], backends=["ddp"])
    assert "train.fp8.enabled=true works with parallel.backend=fsdp" in rows[0]["refused"]


# ================================================================================ paths and run dir


@pytest.mark.parametrize(
    ("name", "make", "expected"),
    [entry[1:] for entry in RUN_DIR_ENTRIES],
    ids=[entry[0] for entry in RUN_DIR_ENTRIES],
)
def test_a_run_dir_entry_of_the_wrong_kind_is_named(name, make, expected, tmp_path):
    from scale_llm.train.preflight import check_run_dir

    run_dir = tmp_path / "run"
    check_run_dir(run_dir)  # a new run dir: nothing to check
    run_dir.mkdir()
    (run_dir / ".scale-llm-owner.json").write_text('{"kind": "run"}')  # a run's mark
    (tmp_path / "elsewhere").mkdir()
    (run_dir / "checkpoints").symlink_to(tmp_path / "elsewhere")  # a link to a folder is fine
    check_run_dir(run_dir)
    (run_dir / "checkpoints").unlink()
    make(run_dir / name)
    with pytest.raises(UserError) as e:
        check_run_dir(run_dir)
    assert str(e.value).startswith(f"{run_dir / name} ") and expected in str(e.value)
    assert "move it away (or pick another run.name)" in str(e.value)


def test_metrics_of_the_wrong_kind_or_with_a_torn_line_never_traceback(tmp_path, capsys):
    """metrics.jsonl as a folder (IsADirectoryError before); on resume, a line cut short by a
    kill mid-write, or not a row (JSONDecodeError / AttributeError before) moves aside, said
    (it was deleted); so do the rows past the resumed step (they were deleted)."""
    from scale_llm.config import load_config
    from scale_llm.log import setup_logging
    from scale_llm.train.metrics import MetricsLogger

    cfg = load_config(None, ["logging.tensorboard=false"])
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(UserError, match="is a directory, but the run keeps its metric rows"):
        MetricsLogger(tmp_path, True, cfg, 0)
    (tmp_path / "metrics.jsonl").rmdir()
    rows = ['{"step": 1, "loss": 5.0}', "[1, 2]", '{"step": 2, "loss": 4.0}', '{"step": 3, "lo']
    rows += ['{"step": 3, "loss": 3.5}', '{"step": 4, "loss": 3.0}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows))
    setup_logging(0)
    MetricsLogger(tmp_path, True, cfg, 2).close()
    assert (tmp_path / "metrics.jsonl").read_text() == rows[0] + "\n" + rows[2] + "\n"
    (aside,) = tmp_path.glob("metrics-*.jsonl")
    assert aside.read_text() == "\n".join([rows[1], rows[3], rows[4], rows[5]]) + "\n"
    said = capsys.readouterr().out
    assert (
        f"2 line(s) of {tmp_path / 'metrics.jsonl'} are not metric rows; moved to {aside}" in said
    )
    assert f"the 2 row(s) past it moved to {aside}" in said


def test_a_folder_that_is_not_a_run_dir_is_never_written_into(data_dir, tmp_path):
    """run.name naming someone's folder (say a project with its own config.yaml) would have its
    config.yaml replaced: a non-empty folder holding nothing of a run's is refused, untouched."""
    mine = tmp_path / "runs" / "test"
    mine.mkdir(parents=True)
    (mine / "config.yaml").write_text("mine: true\n")
    (mine / "notes.txt").write_text("notes")
    (mine / "checkpoints").mkdir()  # names a run uses are no proof (an empty checkpoints/ was)
    (mine / "metrics.jsonl").write_text("mine\n")
    before = snapshot(mine)
    with pytest.raises(
        UserError, match=r"holds files but is not a run directory .*notes\.txt"
    ) as e:
        trainer(data_dir, tmp_path, "train.max_steps=1")
    assert snapshot(mine) == before
    assert f'to continue such a run, write {{"kind": "run"}} into {mine}' in str(e.value)
    for name in ("config.yaml", "notes.txt", "metrics.jsonl"):
        (mine / name).unlink()
    assert trainer(data_dir, tmp_path, "train.max_steps=1").fit().steps == 1  # empty: a run's
    assert trainer(data_dir, tmp_path, "train.max_steps=2").fit().steps == 2  # a run's: resumes


def test_a_live_run_dir_is_refused_and_a_stale_lock_is_taken_over(data_dir, tmp_path, logs):
    """A lock record whose pid is alive is refused; one whose pid now names a process that
    began after the record was written (a killed owner's pid, reused) was refused too, and
    `runs` showed the run as running."""
    import socket
    import time

    from scale_llm.files import _start_ticks, lock_holder

    run_dir = tmp_path / "runs" / "test"
    run_dir.mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    lock = {"pid": sleeper.pid, "host": socket.gethostname(), "started": time.time()}
    lock["start_ticks"] = _start_ticks(sleeper.pid)
    try:
        (run_dir / ".lock").write_text(json.dumps(lock))
        with pytest.raises(UserError, match=rf"in use by another launch \(pid {sleeper.pid}"):
            trainer(data_dir, tmp_path)
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # nothing written
        assert lock_holder(run_dir / ".lock") == f"pid {sleeper.pid}"
        lock["start_ticks"] -= 1  # written by a process that started before this pid's
        (run_dir / ".lock").write_text(json.dumps(lock))
        assert lock_holder(run_dir / ".lock") is None
        older = {k: v for k, v in lock.items() if k != "start_ticks"}  # (a record without it:
        older["started"] = time.time() - 3600  # taken an hour before this pid's process began)
        (run_dir / ".lock").write_text(json.dumps(older))
        assert lock_holder(run_dir / ".lock") is None
        older["started"] = time.time()
        (run_dir / ".lock").write_text(json.dumps(older))
        assert lock_holder(run_dir / ".lock") == f"pid {sleeper.pid}"
        (run_dir / ".lock").write_text(json.dumps(lock))
        result = trainer(data_dir, tmp_path, "train.max_steps=1").fit()
        assert logs.text.count("which has exited; taking it over") == 1
        assert result.steps == 1 and not (run_dir / ".lock").exists()  # released at the end
    finally:
        sleeper.kill()
        sleeper.wait()
    (run_dir / ".lock").write_text(json.dumps(lock))
    result = trainer(data_dir, tmp_path, "train.max_steps=2").fit()  # the owner is dead
    assert logs.text.count("which has exited; taking it over") == 2
    assert result.steps == 2 and not (run_dir / ".lock").exists()


def test_a_damaged_or_foreign_lock_is_refused_with_the_fix(tmp_path, monkeypatch):
    from scale_llm.files import OwnerLock

    path = tmp_path / ".lock"
    for content in ("[1, 2]", '{"pid": "7", "host": "h"}', "\x00garbage"):
        path.write_text(content)
        with pytest.raises(UserError, match=r"is damaged.*delete .*\.lock"):
            OwnerLock(path, "runs/x", "pick another run.name").acquire()
        assert path.read_text() == content
    path.write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    with pytest.raises(UserError, match="cannot be checked from"):
        OwnerLock(path, "runs/x", "pick another run.name").check()
    real = os.open  # another user's lock file (as root the check itself is what is tested)

    def refused(p, flags, *args):
        if Path(p) == path:
            raise PermissionError(13, "Permission denied")
        return real(p, flags, *args)

    with monkeypatch.context() as m:
        m.setattr(os, "open", refused)
        for attempt in ("check", "acquire"):  # (a traceback before)
            with pytest.raises(UserError, match=r"cannot be opened for writing by this user, so"):
                getattr(OwnerLock(path, "runs/x", "pick another run.name"), attempt)()
    path.unlink()
    path.mkdir()
    with pytest.raises(UserError, match="is a directory"):
        OwnerLock(path, "runs/x", "pick another run.name").acquire()


def test_a_full_disk_in_any_command_is_one_paragraph(monkeypatch, capsys):
    """ENOSPC outside a checkpoint save (which has its own message): prepare writing shards,
    export, convert. It reached the user as a raw OSError traceback."""
    import errno

    from scale_llm import cli

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/shards/train_00003.bin")

    monkeypatch.setitem(cli.COMMANDS, "prepare", full)
    assert main(["prepare", TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "error: `scale-llm prepare` ran out of disk space while writing "
        "/data/shards/train_00003.bin (No space left on device); free some space there"
    )
    assert "Traceback" not in err and err.count("\n") == 1

    def broken(args):  # any other OSError is not the user's: it keeps its traceback
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setitem(cli.COMMANDS, "prepare", broken)
    with pytest.raises(OSError):
        main(["prepare", TINY])


def test_out_of_disk_during_a_save_is_a_clear_error(data_dir, tmp_path):
    import errno

    tr = trainer(data_dir, tmp_path, "train.max_steps=4", "checkpoint.every=2")
    save = tr.backend.save

    def full_disk(path):
        if tr.step == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(path)

    tr.backend.save = full_disk
    with pytest.raises(UserError) as info:
        tr.fit()
    msg = str(info.value)
    assert "out of disk space while writing checkpoint" in msg and "step_00000004" in msg
    assert "previous checkpoint" in msg and "step_00000002 is intact" in msg
    ckpts = tr.checkpointer.dir
    assert sorted(p.name for p in ckpts.iterdir()) == [CLAIM, "step_00000002"]  # no partial files


def test_out_of_disk_inside_dcp_is_the_same_clear_error(data_dir, tmp_path, monkeypatch):
    """DCP wraps the writer's OSError in its CheckpointException (a BaseException): it used to
    escape as a traceback. Here the disk fills inside DCP's own file writer."""
    import errno

    import torch.distributed.checkpoint.filesystem as fs

    tr = trainer(data_dir, tmp_path, "train.max_steps=4", "checkpoint.every=2")
    write_item = fs._write_item

    def full_disk(*args, **kwargs):
        if tr.step == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_item(*args, **kwargs)

    monkeypatch.setattr(fs, "_write_item", full_disk)
    with pytest.raises(UserError, match="out of disk space while writing checkpoint") as info:
        tr.fit()
    assert "step_00000002 is intact" in str(info.value)
    assert sorted(p.name for p in tr.checkpointer.dir.iterdir()) == [CLAIM, "step_00000002"]


def test_a_failing_disk_during_a_save_or_a_resume_is_one_paragraph(
    data_dir, tmp_path, monkeypatch, caplog
):
    """EIO (or a file system gone read-only) while writing a checkpoint's record was a
    traceback, leaving the partial folder; one while reading a checkpoint's files for its
    checksums at a resume, a traceback (an unreadable checkpoint is not skipped as damaged: the
    disk may come back, and the run would go on from an older one)."""
    import errno

    from scale_llm.components import checkpoint, digests

    tr = trainer(data_dir, tmp_path, "train.max_steps=4", "checkpoint.every=2")
    write = checkpoint.write_integrity

    def failing(folder, *args, **kwargs):
        if tr.step == 4:
            raise OSError(errno.EIO, "Input/output error", str(folder / "integrity.json"))
        return write(folder, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_integrity", failing)
    with pytest.raises(UserError) as info:
        tr.fit()
    said = str(info.value)
    assert said.startswith("could not write checkpoint ") and "step_00000004" in said
    assert "(Input/output error on " in said and "step_00000002 is intact" in said
    assert sorted(p.name for p in tr.checkpointer.dir.iterdir()) == [CLAIM, "step_00000002"]
    monkeypatch.setattr(checkpoint, "write_integrity", write)
    other = trainer(data_dir, tmp_path / "b", "train.max_steps=4", "checkpoint.every=2")
    save = other.backend.save

    def torch_save(path):  # (torch.save's RuntimeError holds the write's EIO as its context)
        if other.step == 4:
            try:
                raise OSError(errno.EIO, "Input/output error")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from None
        return save(path)

    other.backend.save = torch_save
    with pytest.raises(UserError, match=r"could not write checkpoint .*\(Input/output error\)"):
        other.fit()
    trainer(data_dir, tmp_path, "train.max_steps=4", "checkpoint.every=2").fit()
    digest = digests.file_digest

    def unreadable(path, *args, **kwargs):
        if "step_00000004" in str(path):
            raise OSError(errno.EIO, "Input/output error")
        return digest(path, *args, **kwargs)

    monkeypatch.setattr(digests, "file_digest", unreadable)  # not damage: no fall-back past it
    with pytest.raises(UserError, match=r"step_00000004/\S+ cannot be read \(Input/output error\)"):
        trainer(data_dir, tmp_path, "train.max_steps=6", "checkpoint.every=2")
    assert (tr.checkpointer.dir / "step_00000004").is_dir()  # (nothing moved aside)


def test_a_prune_cut_short_is_finished_by_the_next(data_dir, tmp_path, monkeypatch):
    """Pruning removed a step folder in place: a kill (or a second Ctrl-C) inside it left a
    half-deleted checkpoint that was never pruned again (or, without its trainer.pt, never
    seen). It is renamed to .tmp-step_N first, which the next prune removes."""
    import shutil

    from scale_llm.components import checkpoint

    tr = trainer(data_dir, tmp_path, "train.max_steps=4", "checkpoint.every=2")
    tr.checkpointer.keep_last = 1
    real = shutil.rmtree

    def killed(path, *args, **kwargs):
        if Path(path).name == ".tmp-step_00000002" and Path(path).is_dir():
            (Path(path) / "trainer.pt").unlink()  # part of the folder goes, then the kill
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        tr.fit()
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real)
    names = sorted(p.name for p in tr.checkpointer.dir.iterdir())
    assert names == [CLAIM, ".tmp-step_00000002", "step_00000004"], names
    tr.checkpointer.prune()
    assert sorted(p.name for p in tr.checkpointer.dir.iterdir()) == [CLAIM, "step_00000004"]


# ================================================================================= data and corpora


def test_the_files_a_manifest_accounts_for_are_read_from_any_shape():
    from scale_llm.data.shards import manifest_files

    good = {
        "tokenizer": {"file": "tokenizer.model"},
        "splits": {"train": {"shards": [{"file": "train_00000.bin"}]}, "val": "damaged"},
    }
    assert manifest_files(good) == {"tokenizer.model", "train_00000.bin"}
    for damaged in ([good], "x", 3, {"splits": [1], "tokenizer": ["tokenizer.model"]}):
        assert manifest_files(damaged) == set()


def test_truncated_shard_and_missing_manifest_are_refused(tmp_path):
    from scale_llm.data.prepare import prepare
    from scale_llm.data.shards import read_manifest
    from tests.helpers import prep_config

    corpus = write_jsonl(tmp_path / "docs.jsonl", random_texts(24, "doc{i:03d}marker"))
    out = tmp_path / "data"
    prepare(prep_config(corpus, out))
    shard = out / "train_00000.bin"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 2)
    with pytest.raises(UserError, match="truncated"):
        read_manifest(out)
    with pytest.raises(UserError, match="run `scale-llm prepare CONFIG` first"):
        read_manifest(tmp_path / "nothing-here")


@pytest.mark.parametrize("kind", PROGRESS_DAMAGE)
def test_a_damaged_progress_record_starts_the_prepare_afresh(kind, tmp_path, capsys):
    """progress.json is prepare's own scratch: a damaged one is said in one line and the build
    starts over (an AttributeError, or a ValueError from the shard writer, before)."""
    from scale_llm.data.shards import read_manifest
    from scale_llm.log import setup_logging

    argv, out = damaged_build(tmp_path, kind)
    setup_logging(0)  # (log lines to this test's stdout)
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    printed = capsys.readouterr().out
    record = out / ".prepare-build" / "progress.json"
    assert f"{record} is damaged (" in printed and "starting the prepare afresh" in printed
    assert read_manifest(out)["splits"]["train"]["tokens"] > 0


def test_a_vocab_the_corpus_cannot_fill_is_refused_naming_the_limit(tmp_path):
    from scale_llm.data.tokenizer import train_tokenizer

    with pytest.raises(UserError, match="too small.*at least 320"):
        train_tokenizer(["hello world"], 100, tmp_path / "t.model")
    # corpora with few distinct pieces: SentencePiece says how many it can make
    with pytest.raises(UserError, match=r"gives at most 2\d\d pieces, fewer than the 320"):
        train_tokenizer(["hello world\n" * 200], 2048, tmp_path / "t.model")
    with pytest.raises(UserError, match=r"model.vocab_size=4096 is more .* <= \d{3,4}, or"):
        train_tokenizer(random_texts(20, "d{i}", vocab=100), 4096, tmp_path / "t.model")
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("case", list(CORPUS_SKIPS))
def test_a_path_a_corpus_cannot_read_is_skipped_and_said(case, tmp_path):
    """Loops, second paths to a file, broken links, pipes and files of unknown kinds are not
    errors: each real file is read once, and one warning names what was skipped."""
    make, docs, said = CORPUS_SKIPS[case]
    corpus = tmp_path / "corpus"
    write_file(corpus / "a.txt", "alpha")
    spec = make(corpus)
    with logged() as lines:
        assert documents_of(spec) == docs
    warned = [line for line in lines if "skips" in line]
    if said is None:
        assert warned == [], lines.text
    else:
        assert len(warned) == 1 and warned[0].startswith(f"data.source='{spec}' skips 1 path")
        assert said in warned[0], warned


@pytest.fixture
def small_limit(monkeypatch):
    from scale_llm.data import documents, sources

    for module in (documents, sources):  # (a record's text; a file's or a line's bytes)
        monkeypatch.setattr(module, "MAX_DOCUMENT_CHARS", 1000)


def test_a_jsonl_line_over_the_limit_is_refused_before_it_is_read_whole(tmp_path, small_limit):
    import tracemalloc

    from scale_llm.data.sources import local_source

    ok = "x" * (1000 - len('{"text": ""}'))  # a line of exactly the limit is read
    path = write_file(
        tmp_path / "c.jsonl",
        "\n".join([json.dumps({"text": ok}), json.dumps({"text": "y" * 400_000})]) + "\n",
    )
    docs = local_source(str(path), "text").documents()
    assert next(docs).text == ok
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match=r"c.jsonl:2 is longer than 1,000 bytes.*split"):
            next(docs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50_000  # the 400 kB line was not read whole


def test_a_text_file_or_row_over_the_limit_is_refused(tmp_path, small_limit):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from scale_llm.data.sources import local_source

    big = write_file(tmp_path / "t" / "big.txt", "z" * 1001)
    write_file(tmp_path / "t" / "fits.txt", "z" * 1000)
    with pytest.raises(UserError, match=r"big.txt is longer than 1,000 bytes.*split"):
        list(local_source(str(big.parent), "text").documents())
    assert len(documents_of(tmp_path / "t" / "fits.txt")) == 1
    rows = write_file(tmp_path / "r.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": "ok"}, {"text": "é" * 1001}]), rows)
    with pytest.raises(UserError, match=r"r.parquet row 2: .* 1,001 characters.*1,000"):
        documents_of(rows)


def test_a_lone_surrogate_in_a_jsonl_record_names_the_file_and_line(tmp_path):
    """Valid JSON, but not text: it used to reach the tokenizer and fail there as a TypeError
    from a worker process, naming no file."""
    path = write_file(tmp_path / "s.jsonl", '{"text": "fine"}\n{"text": "a\\ud800b"}\n')
    with pytest.raises(UserError, match=r"s.jsonl:2: field 'text' holds a lone surrogate"):
        documents_of(path)
    pair = write_file(tmp_path / "p.jsonl", '{"text": "smile \\ud83d\\ude00"}\n')
    assert documents_of(pair) == {"p.jsonl:1": "smile \U0001f600"}  # a whole pair is text


@pytest.mark.parametrize("streaming", [True, False])
def test_a_hf_folder_with_a_lone_surrogate_names_the_problem_and_the_way_to_find_it(
    tmp_path, monkeypatch, streaming
):
    import datasets

    from scale_llm.config import load_config
    from scale_llm.data.sources import open_source

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    write_jsonl(tmp_path / "ds" / "train.jsonl", random_texts(5, "doc{i}", length=20))
    with open(tmp_path / "ds" / "train.jsonl", "a") as f:
        f.write('{"text": "a\\ud800b"}\n')
    data = load_config(
        None, [f"data.source=hf:{tmp_path / 'ds'}", f"data.streaming={str(streaming).lower()}"]
    ).data
    with pytest.raises(UserError) as e:
        list(open_source(data).documents())
    message = str(e.value)
    assert "surrogate" in message and "again" not in message and "network" not in message
    assert f"data.source={tmp_path / 'ds'}/**/*.jsonl" in message  # names file and line


def test_skipped_files_that_are_not_utf8_are_counted(tmp_path, logs):
    """The builtin corpus skips its few Latin-1 files; it now says which."""
    from scale_llm.data.sources import Source

    good = write_file(tmp_path / "good.py", "x = 1\n")
    bad = write_file(tmp_path / "bad.py", data=b"s = '\xe9'\n")
    src = Source("builtin:test", [bad, good], skip_undecodable=True, root=tmp_path)
    assert [d.doc_id for d in src.documents()] == ["good.py"]
    assert "skipped 1 file that is not UTF-8 (bad.py)" in logs.text


# ======================================================================== checkpoints and artifacts


def test_the_ranks_share_a_checkpoints_checksums_and_agree_on_its_damage(
    four_steps, tmp_path, monkeypatch
):
    """Every rank read every byte of the newest checkpoint to checksum it at a launch (a 70B
    run's ~1 TB, once a rank): each reads its share, and a file one rank finds changed
    makes every rank fall back (here rank r of a simulated 2-rank world: the other rank's
    outcome is what first_failed_rank reports)."""
    from scale_llm.components import checkpoint, digests

    run = copy_run(four_steps, tmp_path)
    ckpt = run / "checkpoints" / STEP4
    files = list(json.loads((ckpt / INTEGRITY).read_text())["files"])
    read, real = [], digests.file_digest
    monkeypatch.setattr(digests, "file_digest", lambda f, **kw: read.append(f) or real(f, **kw))
    shares = []
    for rank in (0, 1):
        read.clear()
        monkeypatch.setattr(checkpoint, "rank_and_world", lambda rank=rank: (rank, 2))
        monkeypatch.setattr(checkpoint, "first_failed_rank", lambda failed: 0 if failed else None)
        assert checkpoint.agreed_damage(ckpt) is None
        shares.append({str(f.relative_to(ckpt)) for f in read})
    assert shares[0].isdisjoint(shares[1]) and shares[0] | shares[1] == set(files)
    # the other rank found its share damaged: this one, whose share is intact, falls back too
    monkeypatch.setattr(checkpoint, "rank_and_world", lambda: (0, 2))
    outcomes = iter([None, None, 1] + [None] * 3)  # (step 4: all see it, read it; rank 1: damage)
    monkeypatch.setattr(checkpoint, "first_failed_rank", lambda failed: next(outcomes))
    (ckpt / sorted(shares[1])[0]).write_bytes(b"x" * (ckpt / sorted(shares[1])[0]).stat().st_size)
    with logged() as lines:
        assert Checkpointer(run, 1).latest_good() == run / "checkpoints" / STEP2
    assert f"skipping {ckpt}: rank 1 found a file of it damaged" in lines.text
    # every rank walks rank 0's listing (another node's file system may show it an older one)
    monkeypatch.setattr(checkpoint, "is_distributed", lambda: True)
    rank0 = lambda names, src: names.__setitem__(0, [STEP2])  # noqa: E731
    monkeypatch.setattr(checkpoint.dist, "broadcast_object_list", rank0)
    outcomes = iter([None] * 3)  # (step 2 alone is checked: seen, readable, intact)
    with logged() as lines:
        assert Checkpointer(run, 1).latest_good() == run / "checkpoints" / STEP2
    assert "skipping" not in lines.text
    # a checkpoint rank 0 lists that another node does not see: a stop, not an older resume
    monkeypatch.setattr(checkpoint.dist, "broadcast_object_list", lambda names, src: None)
    monkeypatch.setattr(checkpoint, "first_failed_rank", lambda failed: 1)  # (rank 1: behind)
    with pytest.raises(UserError, match="listed on rank 0's node but missing on rank 1's"):
        Checkpointer(run, 1).latest_good()


@pytest.mark.parametrize("case", list(DAMAGES))
def test_a_damaged_newest_checkpoint_is_skipped_by_auto(case, four_steps, data_dir, tmp_path):
    """`auto` takes the newest checkpoint whose files match its record: a damaged newer one is
    skipped with one warning naming it and what is wrong (a record of the wrong shape was a
    traceback that also blocked this fallback)."""
    run = copy_run(four_steps, tmp_path)
    ckpt = run / "checkpoints" / STEP4
    said = DAMAGES[case](ckpt)
    problem = damage(ckpt)
    assert problem is not None and said in problem and "\n" not in problem, problem
    assert str(ckpt) in problem, problem
    with logged() as lines:
        assert Checkpointer(run, 1).latest_good() == run / "checkpoints" / STEP2
    assert f"skipping {ckpt}: " in lines.text and "falling back" in lines.text
    with logged() as lines:
        tr = resume_auto(data_dir, tmp_path)
    assert tr.step == 2  # fell back to step 2
    assert f"skipping {ckpt}" in lines.text and said in lines.text
    tr.lock.release()


def test_every_checkpoint_damaged_is_refused_and_kept(four_steps, data_dir, tmp_path):
    """Every checkpoint damaged: auto stops before any work (a run from step 0 would replace
    and prune them), and both are as they were."""
    run = copy_run(four_steps, tmp_path)
    for step in (STEP2, STEP4):
        (run / "checkpoints" / step / "notes.txt").write_text("a file the record does not list")
    before = snapshot(run)
    with pytest.raises(UserError, match=r"every checkpoint in .* is damaged .*move them out"):
        resume_auto(data_dir, tmp_path)
    assert snapshot(run) == before
    # generate said the run "has no complete checkpoint; train longer"
    from scale_llm.generate import run_checkpoint

    with pytest.raises(UserError, match=r"2 complete checkpoint\(s\) are all damaged"):
        run_checkpoint(run, None)


def test_what_a_run_did_not_write_in_its_folders_is_kept(four_steps, data_dir, tmp_path, logs):
    """A step_N without trainer.pt in the way of a save is moved aside, a .tmp-* folder not
    named like a save's is left, and a fresh start moves the earlier attempt's rows aside."""
    run = copy_run(four_steps, tmp_path)
    ckpts = run / "checkpoints"
    for step in (STEP2, STEP4):
        shutil.rmtree(ckpts / step)
    (ckpts / "step_00000002").mkdir()
    (ckpts / "step_00000002" / "notes.txt").write_text("mine")
    (ckpts / ".tmp-mine").mkdir()
    rows = (run / "metrics.jsonl").read_text()
    trainer(data_dir, tmp_path, "checkpoint.every=2", "checkpoint.keep_last=1").fit()
    assert (ckpts / ".tmp-mine").is_dir()
    assert [p.read_text() for p in ckpts.glob("abandoned-*/step_00000002/notes.txt")] == ["mine"]
    assert [p.read_text() for p in run.glob("metrics-*.jsonl")] == [rows]
    assert "rows of the earlier attempt moved to" in logs.text


def test_a_stale_save_of_another_kind_and_a_link_loop_never_traceback(four_steps, tmp_path, capsys):
    """A .tmp-step_N that is a file or a named pipe (rmtree left the file and the save's mkdir
    raised FileExistsError; it opened the pipe and blocked), and a link loop named as a
    checkpoint or above --out (pathlib's RuntimeError)."""
    import threading

    from scale_llm.components.checkpoint import _remove_stale
    from scale_llm.files import require_writable_dir

    (tmp_path / ".tmp-step_00000006").write_text("x")
    os.mkfifo(tmp_path / ".tmp-step_00000008")
    for stale in sorted(tmp_path.iterdir()):
        worker = threading.Thread(target=_remove_stale, args=(stale,), daemon=True)
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive() and not stale.exists(), stale
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    loop, ckpt = tmp_path / "loop", four_steps / "checkpoints" / STEP2
    with pytest.raises(UserError, match=r"loop is a symlink, not a directory"):
        require_writable_dir(loop / "runs", "run.dir")  # (a run dir below it: row 2.1)
    for command in ("convert", "export"):
        assert main([command, str(loop), "--out", str(tmp_path / "out")]) == 2
        assert main([command, str(ckpt), "--out", str(loop / "out")]) == 2  # (mkdir raised)
    assert "Traceback" not in capsys.readouterr().err


def test_a_checkpoints_link_into_another_run_is_refused(four_steps, data_dir, tmp_path):
    """runs/test/checkpoints -> runs/a/checkpoints is refused: it would resume and prune a's."""
    a = copy_run(four_steps, tmp_path, "a")
    (tmp_path / "runs" / "test").mkdir()
    (tmp_path / "runs" / "test" / "checkpoints").symlink_to(a / "checkpoints")
    before = snapshot(a)
    with pytest.raises(UserError, match=r"belongs to the run .*/runs/a: it lies in"):
        resume_auto(data_dir, tmp_path)
    assert snapshot(a) == before


def test_two_runs_linked_to_one_checkpoints_folder_are_refused(four_steps, data_dir, tmp_path):
    """runs/a/checkpoints and runs/test/checkpoints -> one plain folder: the launch that takes it
    holds its lock and records itself there, and the other is refused (it would resume and prune
    a's): before it starts, when a's launch took the folder after its preflight, and while a's
    launch holds the lock. A link into any depth of another run's checkpoints is refused too."""
    from scale_llm.train.preflight import CHECKPOINTS_LOCK, check_run_dir, preflight

    a = copy_run(four_steps, tmp_path, "a")
    shared = tmp_path / "disk" / "checkpoints"
    shared.parent.mkdir()
    (a / "checkpoints").rename(shared)
    (a / "checkpoints").symlink_to(shared)
    (tmp_path / "runs" / "test").mkdir()
    (tmp_path / "runs" / "test" / "checkpoints").symlink_to(shared)
    cfg = make_config(data_dir, tmp_path / "runs", "checkpoint.every=2", "train.max_steps=6")
    passed = preflight(cfg, plan_for(cfg))  # before a's launch: nothing to see yet
    resume_auto(data_dir, tmp_path, "run.name=a")  # a's launch takes the folder

    def checkpoints() -> dict:  # (a's lock, taken over by this process's second launch, aside)
        return {k: v for k, v in snapshot(shared).items() if k != CHECKPOINTS_LOCK}

    before = checkpoints()
    refused = r"belongs to the run .*/runs/a: it lies in that run dir or in the checkpoints"
    with pytest.raises(UserError, match=refused):
        Trainer(passed)  # checked again once its launch holds the folder's lock
    with pytest.raises(UserError, match=refused):
        resume_auto(data_dir, tmp_path)
    assert checkpoints() == before
    (shared / "abandoned-x").mkdir()  # a folder inside the one a's claim names
    (tmp_path / "runs" / "f" / "checkpoints").parent.mkdir()
    (tmp_path / "runs" / "f" / "checkpoints").symlink_to(shared / "abandoned-x")
    with pytest.raises(UserError, match=refused):
        check_run_dir(tmp_path / "runs" / "f")
    (a / "checkpoints").unlink()  # a no longer links there: the folder is test's to take
    code = (
        "import time; from pathlib import Path; from scale_llm.files import OwnerLock; "
        f"OwnerLock(Path({str(shared / CHECKPOINTS_LOCK)!r}), 'x', '').acquire(); "
        "print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], env=env(), stdout=subprocess.PIPE)
    try:  # a launch in another process holds the folder (its claim not yet written)
        assert holder.stdout.readline().strip() == b"held"
        with pytest.raises(UserError, match=r"checkpoints is in use by another launch \(pid"):
            resume_auto(data_dir, tmp_path)
    finally:
        holder.kill()
        holder.wait()
    resume_auto(data_dir, tmp_path)
    d = copy_run(four_steps, tmp_path, "d")
    (tmp_path / "runs" / "e" / "checkpoints").parent.mkdir()
    (tmp_path / "runs" / "e" / "checkpoints").symlink_to(d / "checkpoints" / STEP2)
    with pytest.raises(UserError, match=r"belongs to the run .*/runs/d: it lies in"):
        check_run_dir(tmp_path / "runs" / "e")
    nested = copy_run(four_steps, tmp_path, "d/nested")  # a run inside d, linked into itself
    (nested / "checkpoints").rename(nested / "store")
    (nested / "checkpoints").symlink_to(nested / "store")
    check_run_dir(nested)


def test_a_symlinked_step_dir_is_never_resumed_counted_or_pruned(four_steps, data_dir, tmp_path):
    """checkpoints/step_00000004 -> another run's checkpoint was resumed without a word, and
    the run's own checkpoints were then pruned. Now it is skipped with a warning naming it,
    and nothing is deleted through it."""
    other = copy_run(four_steps, tmp_path, "other")
    theirs = other / "checkpoints" / STEP4
    before = tree(theirs)
    run = copy_run(four_steps, tmp_path)
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / STEP4)
    (ckpts / STEP4).symlink_to(theirs)
    (ckpts / "step_00000009").symlink_to(theirs)  # a newer one: would push step 2 out
    mine = tree(ckpts / STEP2)
    checkpointer = Checkpointer(run, 1)
    with logged() as lines:
        assert checkpointer.complete() == [(2, ckpts / STEP2)]
        checkpointer.prune()  # keep_last 1: the links are not counted
    assert f"skipping {ckpts / STEP4}: it is a symlink (to {theirs})" in lines.text
    assert tree(ckpts / STEP2) == mine and tree(theirs) == before
    with logged() as lines:
        tr = resume_auto(data_dir, tmp_path, "checkpoint.keep_last=1")
    assert tr.step == 2 and tr.resume_from == ckpts / STEP2
    tr.fit()  # saves step 4 and 6, pruning down to one
    assert tree(theirs) == before and (other / "checkpoints" / STEP2).is_dir()
    assert [p.name for _, p in Checkpointer(run, 1).complete()] == ["step_00000006"]
    (aside,) = ckpts.glob("abandoned-*")  # the links were moved aside as links
    assert sorted(p.name for p in aside.iterdir()) == [STEP4, "step_00000009"]
    assert all((aside / name).is_symlink() for name in (STEP4, "step_00000009"))


def test_a_checkpoint_that_is_missing_or_another_runs_is_named(four_steps, tmp_path, capsys):
    """generate --checkpoint: a pruned step or a typo lists the run's checkpoints; one of
    another run (another model shape, another tokenizer) says so, naming the difference."""
    from scale_llm.data.tokenizer import train_tokenizer

    run_dir = copy_run(four_steps, tmp_path)
    capsys.readouterr()
    ckpts = run_dir / "checkpoints"
    gen = ["--max-new-tokens", "2"]
    assert main(["generate", str(run_dir), "--checkpoint", str(ckpts / "step_00000005"), *gen]) == 2
    err = capsys.readouterr().err
    assert "not a checkpoint directory (no trainer.pt inside)" in err, err
    assert "holds 2 complete checkpoints (step_00000002, step_00000004)" in err
    assert main(["generate", str(run_dir), "--checkpoint", str(run_dir), *gen]) == 0  # its newest

    wider = tmp_path / "wider"  # a run whose model differs from the checkpoint's
    shutil.copytree(run_dir, wider)
    config = (wider / "config.yaml").read_text()
    (wider / "config.yaml").write_text(config.replace("d_model: 32", "d_model: 64"))
    assert main(["generate", str(wider), "--checkpoint", str(ckpts / STEP2), *gen]) == 2
    err = capsys.readouterr().err
    assert "step_00000002 belongs to another run" in err and "Traceback" not in err, err
    assert "model.d_model (32 in the checkpoint, 64 in the run)" in err
    assert main(["generate", str(wider), *gen]) == 2  # its own checkpoint: config.yaml edited
    err = capsys.readouterr().err  # (it said "belongs to another run ... (the run itself)")
    assert f"{wider / 'config.yaml'} differs from the model" in err, err
    assert "it was edited after the run wrote it; restore those values" in err

    retokenized = tmp_path / "retokenized"  # a run with another tokenizer
    shutil.copytree(run_dir, retokenized)
    train_tokenizer(random_texts(200, "doc{i}"), 400, retokenized / "tokenizer.model")
    argv = ["generate", str(retokenized), "--checkpoint", str(ckpts / STEP2), *gen]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "belongs to another run: it was trained with another tokenizer" in err, err
    assert "copy the tokenizer.model" not in err


def test_a_garbage_or_foreign_tokenizer_in_a_run_dir_is_named(four_steps, tmp_path, capsys):
    from scale_llm.data.tokenizer import train_tokenizer

    run_dir = copy_run(four_steps, tmp_path)
    capsys.readouterr()
    good = (run_dir / "tokenizer.model").read_bytes()
    (run_dir / "tokenizer.model").write_bytes(b"not a model" * 100)
    assert main(["generate", str(run_dir), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "is not a SentencePiece model" in err and "Traceback" not in err

    train_tokenizer(random_texts(200, "doc{i}"), 400, run_dir / "tokenizer.model")
    assert (run_dir / "tokenizer.model").read_bytes() != good
    assert main(["generate", str(run_dir), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "is not the tokenizer" in err and "the checkpoint records" in err
    (run_dir / "tokenizer.model").write_bytes(good)
    assert main(["generate", str(run_dir), "--max-new-tokens", "2"]) == 0


def test_resuming_a_different_run_is_refused(data_dir, tmp_path):
    trainer(data_dir, tmp_path, "train.max_steps=1").fit()
    with pytest.raises(UserError) as info:
        trainer(data_dir, tmp_path, "train.max_steps=2", "model.d_model=64", "run.seed=5")
    msg = str(info.value)
    assert "model.d_model: the checkpoint has 32, the config says 64" in msg
    assert "run.seed" in msg and "start a new run: --run-name NAME (the run.name key" in msg
    with pytest.raises(UserError, match="checkpoint.resume=never but"):
        trainer(data_dir, tmp_path, "checkpoint.resume=never")
    # settings that do not define the run may change: a longer run continues
    assert trainer(data_dir, tmp_path, "train.max_steps=2", "train.lr=5e-4").step == 1
    # a null that stands for a computed value (the default SwiGLU width, n_heads key/value
    # heads) is the same run as that value written out; another value is not
    same = ("train.max_steps=2", "model.mlp_hidden=128", "model.n_kv_heads=4")
    assert trainer(data_dir, tmp_path, *same).step == 1
    run = str(tmp_path / "runs" / "test")  # (its config.yaml now says 128 and 4: the same model)
    assert main(["generate", run, "--max-new-tokens", "2"]) == 0
    assert trainer(data_dir, tmp_path, "train.max_steps=1", *same[1:]).step == 1  # finished
    with pytest.raises(UserError) as info:
        trainer(
            data_dir, tmp_path, "train.max_steps=2", "model.mlp_hidden=256", "model.n_kv_heads=2"
        )
    assert "model.mlp_hidden: the checkpoint has None, the config says 256" in str(info.value)
    assert "model.n_kv_heads: the checkpoint has None, the config says 2" in str(info.value)


def test_metadata_pointing_outside_the_checkpoint_is_refused(four_steps, tmp_path):
    import pickle

    from scale_llm.components.serialization import DamagedCheckpoint, read_dcp_metadata

    path = copy_run(four_steps, tmp_path) / "checkpoints" / STEP4 / "dcp" / ".metadata"
    md = read_dcp_metadata(path)
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../../etc/passwd"
    path.write_bytes(pickle.dumps(md))
    with pytest.raises(DamagedCheckpoint, match="leaves the checkpoint"):
        read_dcp_metadata(path)


def test_torch_files_name_the_refused_global(tmp_path):
    from scale_llm.components.serialization import UnsafeCheckpoint, load_file

    path = tmp_path / "trainer.pt"
    torch.save({"x": Payload(tmp_path / "pwned")}, path)
    with pytest.raises(UnsafeCheckpoint, match=r"trainer\.pt.*system"):
        load_file(path)
    assert not (tmp_path / "pwned").exists()


def init_model(data_dir: Path, tmp_path: Path, folder: Path):
    return replace(make_config(data_dir, tmp_path).model, init_from=str(folder))


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file as load_st

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_st(f))
    return out


@pytest.mark.parametrize("case", list(INIT_CONFIG_FIELDS))
def test_init_from_config_fields_are_checked_for_json_type_and_range(
    case, exported, data_dir, tmp_path
):
    """ "false" was read as true, zero heads and infinities were tracebacks."""
    from tests.helpers import init_weights

    folder = tmp_path / "hf"
    shutil.copytree(exported, folder)
    hf = json.loads((folder / "config.json").read_text())
    changes, said = INIT_CONFIG_FIELDS[case]
    hf.update(changes)
    (folder / "config.json").write_text(json.dumps(hf))  # (inf / nan as Infinity / NaN)
    with pytest.raises(UserError) as e:
        init_weights(init_model(data_dir, tmp_path, folder), None)
    assert str(folder) in str(e.value) and said in str(e.value), str(e.value)
    assert "config.json" in str(e.value)


@pytest.mark.parametrize("case", list(INIT_TENSORS))
def test_init_from_weights_must_be_finite_floats(case, exported, data_dir, tmp_path):
    from safetensors.torch import load_file as load_st
    from safetensors.torch import save_file as save_st

    from tests.helpers import init_weights

    folder = tmp_path / "hf"
    shutil.copytree(exported, folder)
    tensors = load_st(folder / "model.safetensors")
    name = "model.norm.weight"
    change, said = INIT_TENSORS[case]
    tensors[name] = change(tensors[name])
    save_st(tensors, str(folder / "model.safetensors"), {"format": "pt"})
    with pytest.raises(UserError) as e:
        init_weights(init_model(data_dir, tmp_path, folder), None)
    msg = str(e.value)
    assert name in msg and str(folder / "model.safetensors") in msg and said in msg, msg


def test_init_from_errors_name_what_is_wrong(four_steps, exported, data_dir, tmp_path):
    from safetensors.torch import save_file as save_st

    from scale_llm.data.shards import read_manifest
    from scale_llm.generate import read_run_config
    from tests.helpers import init_weights

    good = replace(read_run_config(four_steps).model, init_from=str(exported))
    sha = read_manifest(data_dir)["tokenizer"]["sha256"]
    with pytest.raises(UserError, match="no such folder"):
        init_weights(replace(good, init_from=str(tmp_path / "nope")), None)
    with pytest.raises(UserError, match="no config.json"):
        init_weights(replace(good, init_from=str(tmp_path)), None)
    # a model section that differs: the key, both values, and the shapes it changes
    with pytest.raises(UserError) as e:
        init_weights(replace(good, d_model=64), sha)
    assert "model.d_model=64" in str(e.value) and "has 32: set model.d_model=32" in str(e.value)
    assert "model.embed_tokens.weight: shape (512, 32) in the checkpoint, (512, 64)" in str(e.value)
    # one tensor of another shape (config.json as it should be)
    bad = tmp_path / "bad_shape"
    shutil.copytree(exported, bad)
    tensors = hf_tensors(bad)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:64]
    save_st(tensors, bad / "model.safetensors", {"format": "pt"})
    wrong = r"model\.layers\.1\.mlp\.up_proj\.weight: shape \(64, 32\) in the checkpoint, "
    with pytest.raises(UserError, match=wrong + r"\(128, 32\) in the model"):
        init_weights(replace(good, init_from=str(bad)), sha)
    # configurations the model cannot run: each field is named
    odd = tmp_path / "unsupported"
    shutil.copytree(exported, odd)
    hf = json.loads((odd / "config.json").read_text())
    hf.update(rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True)
    hf.update(hidden_act="gelu", mlp_bias=True)
    (odd / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UserError) as e:
        init_weights(replace(good, init_from=str(odd)), sha)
    for field in ("rope_scaling=", "attention_bias=True", "hidden_act='gelu'", "mlp_bias=True"):
        assert field in str(e.value)
    # weights another tokenizer learned
    other = tmp_path / "other_tokenizer"
    shutil.copytree(exported, other)
    (other / "tokenizer.model").write_bytes(b"not our tokenizer")
    with pytest.raises(UserError, match="differs from the tokenizer of data.dir"):
        init_weights(replace(good, init_from=str(other)), sha)
    # no weights at all
    empty = tmp_path / "no_weights"
    empty.mkdir()
    shutil.copy(exported / "config.json", empty)
    with pytest.raises(UserError, match="no weights found"):
        init_weights(replace(good, init_from=str(empty)), None)


def test_init_from_a_pickled_folder_goes_through_the_safe_loader(four_steps, exported, tmp_path):
    from scale_llm.components.serialization import UnsafeCheckpoint
    from scale_llm.generate import read_run_config
    from tests.helpers import init_weights

    folder = tmp_path / "bin"
    folder.mkdir()
    shutil.copy(exported / "config.json", folder)
    tensors = hf_tensors(exported)
    torch.save(tensors, folder / "pytorch_model.bin")
    model = read_run_config(four_steps).model
    cfg = replace(model, init_from=str(folder))
    state = init_weights(cfg, None)
    expected = init_weights(replace(model, init_from=str(exported)), None)
    assert state.keys() == expected.keys()
    for name in state:
        assert state[name].dtype == expected[name].dtype, name
        assert torch.equal(state[name], expected[name]), name
    marker = tmp_path / "payload-ran"
    tensors["planted"] = Payload(marker)
    torch.save(tensors, folder / "pytorch_model.bin")
    with pytest.raises(UnsafeCheckpoint, match="pytorch_model.bin"):
        init_weights(cfg, None)
    assert not marker.exists()


def test_a_trainer_with_a_missing_init_folder_stops_with_a_clear_error(data_dir, tmp_path):
    with pytest.raises(UserError, match=r"model\.init_from=.*nope: no such folder"):
        finished_run(data_dir, tmp_path, f"model.init_from={tmp_path / 'nope'}")
    assert not (tmp_path / "test" / "checkpoints").exists()
    with pytest.raises(UserError, match="model.init_from is empty"):
        make_config(data_dir, tmp_path, "model.init_from=' '")


# ============================================================================= files a command owns
# (all in the table: export, convert, eval, bench --checkpoint-io, check and prepare refusing to
# replace what they cannot prove they wrote)


# ======================================================================================== CLI flags


def test_sweep_entries_are_read_with_spaces_and_any_case():
    from scale_llm.analysis.bench import sweep_axes

    assert sweep_axes(" 1, 2", "none, full", "False, yes") == (
        [1, 2],
        ["none", "full"],
        [False, True],
    )


# =============================================================================== launch environment


def test_a_leftover_world_size_says_what_it_waits_for_then_stops(data_dir, tmp_path):
    """WORLD_SIZE=2 left in a shell, no launcher, no peer: say what, where and how long, then
    an error (not a silent wait, not a traceback)."""
    child = {**env(), "WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "29731"}
    child["SCALE_LLM_PG_TIMEOUT_MIN"] = "0.05"  # 3 s
    for key in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID"):
        child.pop(key, None)
    argv = ["train", TINY, *s(f"data.dir={data_dir}", "model.vocab_size=512")]
    proc = subprocess.run(
        [sys.executable, "-m", "scale_llm", *argv],
        cwd=tmp_path,
        env=child,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rank 0 waits for 2 processes to join at 127.0.0.1:29731" in proc.stdout
    assert "gives up after 0.05 min" in proc.stdout and "left over" in proc.stdout
    assert "did not form at 127.0.0.1:29731" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_world_size_fails_before_any_process_group(tmp_path):
    child = {**os.environ, "WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0"}
    child["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scale_llm",
            "train",
            *s("parallel.backend=ddp", "train.global_batch_size=8", "train.micro_batch_size=2"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=child,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "not divisible by train.micro_batch_size=2 x world size 3" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("value", FAULT_SPECS)
def test_a_malformed_fault_injection_variable_is_named(value, monkeypatch):
    """IndexError / ValueError from maybe_fail mid-run before, or nothing injected at all."""
    from scale_llm.config import load_config
    from scale_llm.train.guards import maybe_fail
    from scale_llm.train.preflight import check_fault_reach

    monkeypatch.setenv("SCALE_LLM_FAULT", value)
    forms = "use after_step:STEP or mid_save:STEP, optionally :RANK (STEP >= 1, RANK >= 0"
    with pytest.raises(UserError, match="SCALE_LLM_FAULT=.*is not a fault to inject") as e:
        check_fault_reach(load_config(None, []))
    assert forms in str(e.value)
    with pytest.raises(UserError):
        maybe_fail("after_step", 1, 0)


def test_fault_injection_reads_its_forms(monkeypatch, caplog):
    from scale_llm.config import load_config
    from scale_llm.train.guards import fault_spec
    from scale_llm.train.preflight import check_fault_reach

    cfg = load_config(None, ["train.max_steps=4", "checkpoint.every=2"])
    monkeypatch.setenv("SCALE_LLM_FAULT", "mid_save:3")  # saved at only on a stop signal: said
    with caplog.at_level("WARNING", logger="scale_llm"):
        check_fault_reach(cfg)
    assert "checkpoint.every=2 saves at no step 3: the fault fires only if a stop" in caplog.text
    for fault in ("mid_save:4", "after_step:4"):
        monkeypatch.setenv("SCALE_LLM_FAULT", fault)
        check_fault_reach(cfg)  # (steps it reaches and saves at)

    for value, parsed in [
        ("", None),
        ("after_step:3", ("after_step", 3, None)),
        ("mid_save:4", ("mid_save", 4, None)),
        ("after_step:3:1", ("after_step", 3, 1)),
    ]:
        monkeypatch.setenv("SCALE_LLM_FAULT", value)
        check_fault_reach(cfg)
        assert fault_spec() == parsed


def test_wandb_missing_is_a_clear_error(data_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(UserError, match=r"logging.wandb.project=p needs the wandb package"):
        trainer(data_dir, tmp_path, "logging.wandb.project=p")
    assert not (tmp_path / "runs").exists()  # the preflight's: nothing written


def test_wandb_online_without_credentials_is_refused_before_any_work(
    data_dir, tmp_path, monkeypatch
):
    """W&B online on a node with no API key: the refusal came from wandb.init, after the run
    dir (config, tokenizer, TensorBoard events, plan) was written. The preflight finds the
    credentials as W&B does, without asking the server; a key of the wrong form is named."""
    wandb = pytest.importorskip("wandb")
    without_wandb_credentials(monkeypatch, tmp_path)
    with pytest.raises(UserError) as info:
        trainer(data_dir, tmp_path, "logging.wandb.project=p")
    msg = str(info.value)
    assert msg.startswith("logging.wandb.project=p: W&B finds no API key on this node")
    assert "`wandb login`" in msg and "logging.wandb.mode=offline" in msg
    assert not (tmp_path / "runs").exists()
    monkeypatch.setenv("WANDB_API_KEY", "short")
    with pytest.raises(
        UserError, match=r"W&B cannot use this node's settings or credentials \(WANDB_API_KEY"
    ):
        trainer(data_dir, tmp_path, "logging.wandb.project=p")
    monkeypatch.setenv("WANDB_BASE_URL", "not a url")  # (wandb's own ValueError: a traceback)
    with pytest.raises(UserError, match=r"settings or credentials \(.*fix the WANDB_\* variables"):
        trainer(data_dir, tmp_path, "logging.wandb.project=p")
    assert not (tmp_path / "runs").exists()
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.delenv("WANDB_BASE_URL")
    from wandb.sdk import wandb_setup

    assert wandb_setup._singleton is None  # (its settings not kept: wandb.init reads them afresh)
    host = urlparse(wandb.Settings().base_url).hostname  # (W&B's server, or WANDB_BASE_URL's)
    (tmp_path / "netrc").write_text(f"machine {host} login user password {'k' * 40}\n")
    (tmp_path / "netrc").chmod(0o600)
    from scale_llm.train.preflight import check_wandb

    check_wandb(make_config(data_dir, tmp_path / "runs", "logging.wandb.project=p"), False)
    check_wandb(
        make_config(
            data_dir, tmp_path / "runs", "logging.wandb.project=p", "logging.wandb.mode=offline"
        ),
        False,
    )


def test_wandb_that_cannot_start_is_a_clear_error(data_dir, tmp_path, monkeypatch):
    """W&B's server unreachable, or refusing the key: wandb.init's own error became a
    traceback."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # (a key of the right form: past the preflight)

    def no_key(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=...)")

    monkeypatch.setattr(wandb, "init", no_key)
    with pytest.raises(UserError) as info:
        trainer(data_dir, tmp_path, "logging.wandb.project=p", "logging.tensorboard=true")
    msg = str(info.value)
    assert msg.startswith("logging.wandb.project=p: W&B did not start (api_key not configured")
    assert "`wandb login`" in msg and "logging.wandb.mode=offline" in msg
    # the launch released its run lock: a relaunch from another host would be refused
    assert not (tmp_path / "runs" / "test" / ".lock").exists()
    # and closed its TensorBoard file (what it had queued is written, its thread gone)
    (events,) = (tmp_path / "runs" / "test" / "tensorboard").glob("events.*")
    assert b"config/yaml" in events.read_bytes()
    assert not [t for t in threading.enumerate() if "AsyncWriter" in type(t).__name__]


def test_a_run_tokenizer_that_does_not_fit_its_model_is_one_paragraph(four_steps, tmp_path, capsys):
    """A run whose tokenizer.model (and its hash in the records) was replaced: one with BOS
    turned off (SentencePiece's id -1), or of more ids than the model's embedding rows, was an
    IndexError in generate and export, or an export whose tokenizer the model cannot read."""
    import hashlib

    import sentencepiece as spm

    from tests.helpers import copy_run, random_texts, rewrite_state

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(random_texts(200, "doc{i}")))
    for name, extra, said in [
        ("nobos", {"bos_id": -1}, "has no BOS or EOS piece (its ids -1, 2)"),
        ("wide", {"user_defined_symbols": [f"<x{i}>" for i in range(600)]}, "has 900 token ids"),
    ]:
        run = copy_run(four_steps, tmp_path, name)
        pieces = 300 + 600 * (name == "wide")
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(tmp_path / name), vocab_size=pieces,
            model_type="bpe", byte_fallback=True, minloglevel=2, **extra,
        )  # fmt: skip
        shutil.copy(tmp_path / f"{name}.model", run / "tokenizer.model")
        sha = hashlib.sha256((run / "tokenizer.model").read_bytes()).hexdigest()
        for ckpt in (run / "checkpoints").glob("step_*"):
            rewrite_state(ckpt, tokenizer_sha256=sha)
        for argv in (["generate", str(run)], ["export", str(run), "--out", str(tmp_path / "x")]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert said in err and err.count("\n") == 1, err
        assert not (tmp_path / "x").exists()


def test_a_checkpoint_file_gone_while_it_is_read_is_one_paragraph(tmp_path):
    """export reads a checkpoint a tensor at a time, for minutes: a live run's keep_last pruning
    removing it meanwhile was DCP's FileNotFoundError in a CheckpointException, a traceback."""
    import torch.distributed.checkpoint as dcp

    from scale_llm.components.serialization import dcp_load, dcp_metadata

    dcp.save({"w": torch.ones(4)}, checkpoint_id=tmp_path, no_dist=True)
    metadata = dcp_metadata(tmp_path)  # (read before the files went, as export reads it)
    for file in tmp_path.glob("*.distcp"):
        file.unlink()
    said = r"its file __0_0\.distcp is missing: an incomplete copy, or removed while it was"
    with pytest.raises(UserError, match=said):
        dcp_load({"w": torch.empty(4)}, tmp_path, True, metadata)
