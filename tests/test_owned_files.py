"""What a command may delete or replace: only what it can prove it created. Here what it does
replace (an earlier export, an earlier convert output, its own scratch folders, the files its
manifest lists) and the run and prepare locks under contention; every refusal (a run, a user's
file, a link, a pipe) is a case of tests/test_errors.py."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from scale_llm.cli import main
from scale_llm.data.prepare_source import MARK
from scale_llm.errors import UserError
from scale_llm.files import OWNER_MARKER, OwnerLock
from tests.helpers import TINY_MODEL, env, finished_run, prep_config, random_texts, snapshot

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(data_dir, tmp_path_factory) -> Path:
    return finished_run(data_dir, tmp_path_factory.mktemp("owned"), "train.max_steps=2")


# ----------------------------------------------------------------------------- export
def test_a_name_near_the_file_systems_limit_is_written_and_exported(run_dir, tmp_path):
    """A file or export of a 250-character name: its temporary sibling (`.NAME.tmp-PID-RANDOM`)
    was past the file system's 255 (export: `File name too long`)."""
    from scale_llm.cli import main
    from scale_llm.files import atomic_write_text

    for long in ("b" * 250, "\u00e9" * 120):  # (240 bytes in UTF-8: cut by bytes, not characters)
        atomic_write_text(tmp_path / long, "x")
        assert (tmp_path / long).read_text() == "x"
    assert main(["export", str(run_dir), "--out", str(tmp_path / "e" / long)]) == 0
    assert (tmp_path / "e" / long / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == [long]  # (no sibling left)


def test_export_force_replaces_an_earlier_export(run_dir, tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    info = json.loads((out / "scale_llm_export.json").read_text())
    assert sorted(info["files"]) == sorted(p.name for p in out.iterdir())
    first = (out / "scale_llm_export.json").stat().st_ino
    assert main(["export", str(run_dir), "--out", str(out), "--force"]) == 0  # an export: ok
    assert (out / "scale_llm_export.json").stat().st_ino != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no leftovers
    monkeypatch.chdir(out)  # `--out .`: its temporary folder was made in it, then called foreign
    assert main(["export", str(run_dir), "--out", ".", "--force"]) == 0
    monkeypatch.chdir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert sorted(info["files"]) == sorted(p.name for p in out.iterdir())


def test_an_export_cut_between_its_two_renames_puts_the_earlier_one_back(run_dir, tmp_path):
    """--force moves the earlier export aside, then renames the new one in: a Ctrl-C (or, now
    unwound, a SIGTERM) between the two left --out missing, the earlier export hidden beside it."""
    pytest.importorskip("safetensors")
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    first = (out / "scale_llm_export.json").stat().st_ino
    rename, calls = Path.rename, []

    def cut_at_the_second(self, target):
        if self.parent == tmp_path:  # (not the shards' renames inside the new folder)
            calls.append(target)
            if len(calls) == 2:
                raise KeyboardInterrupt
        return rename(self, target)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "rename", cut_at_the_second)
        assert main(["export", str(run_dir), "--out", str(out), "--force"]) == 130
    assert len(calls) == 3  # (aside, in: cut, back)
    assert (out / "scale_llm_export.json").stat().st_ino == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def adding_a_file(out: Path, work: Callable) -> Callable:
    """`work` that first puts a file of the user's in `out` (as while a long export runs)."""

    def user_adds_a_file(*args, **kwargs):
        (out / "notes.md").write_text("mine")
        return work(*args, **kwargs)

    return user_adds_a_file


def test_export_force_proves_the_export_again_before_replacing_it(run_dir, tmp_path, monkeypatch):
    """--out is checked before the weights are read and again before it is replaced: a file the
    user adds in between is kept, with the export as it was."""
    pytest.importorskip("safetensors")
    import scale_llm.export as export_module

    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    before = snapshot(out)
    write_weights = adding_a_file(out, export_module._write_weights)
    monkeypatch.setattr(export_module, "_write_weights", write_weights)
    assert main(["export", str(run_dir), "--out", str(out), "--force"]) == 2
    (out / "notes.md").unlink()
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # its own folder removed


def test_eval_proves_its_export_again_before_replacing_it(run_dir, tmp_path, monkeypatch):
    """eval replaces its own export of other checkpoint bytes; a file the user adds there while
    the new export is made is kept, with the folder as it was."""
    pytest.importorskip("safetensors")
    from scale_llm import evaluate

    ckpt, out = run_dir / "checkpoints" / "step_00000002", tmp_path / "export" / "step_00000002"
    evaluate.make_eval_export(ckpt, out)
    before = snapshot(out)
    monkeypatch.setattr(evaluate, "export", adding_a_file(out, evaluate.export))
    with pytest.raises(UserError, match=r"notes.md, which no export writes"):
        evaluate.make_eval_export(ckpt, out)
    (out / "notes.md").unlink()
    assert snapshot(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["step_00000002"]  # staging removed


# ----------------------------------------------------------------------------- convert
def test_convert_writes_a_new_file_and_replaces_only_its_own(
    run_dir, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "converted.pt"
    assert main(["convert", str(run_dir), "--out", str(out)]) == 0
    first = out.stat().st_ino
    assert main(["convert", str(run_dir), "--out", str(out), "--force"]) == 0  # its own: ok
    assert out.stat().st_ino != first
    capsys.readouterr()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == []
    lone = tmp_path / "copy"  # a checkpoint copied out of its run: a file beside it is fine
    shutil.copytree(run_dir / "checkpoints" / "step_00000002", lone / "step_00000002")
    monkeypatch.chdir(lone)
    assert main(["convert", "step_00000002", "--out", "model.pt"]) == 0
    run = tmp_path / "linked" / "run"  # a run whose checkpoints folder is a link (row 2.3)
    shutil.copytree(run_dir, run, symlinks=True)
    (run / "checkpoints").rename(tmp_path / "linked" / "disk")
    (run / "checkpoints").symlink_to(tmp_path / "linked" / "disk")
    ckpt = run / "checkpoints" / "step_00000002"
    assert main(["convert", str(ckpt), "--out", str(run / "checkpoints" / "model.pt")]) == 2
    assert "is inside a checkpoint directory" in capsys.readouterr().err


def test_a_checkpoint_named_on_a_linked_disk_or_set_aside_exports_from_its_own_run(
    run_dir, tmp_path, capsys
):
    """A run whose checkpoints folder links to another disk, its checkpoint named by the real
    path; a checkpoint in checkpoints/abandoned-*/. convert and export wrote into that folder
    (the next resume moved the export aside as a newer checkpoint), and export looked for the
    tokenizer beside the folder (advising a copy there). The folder's claim decides: --out
    there is refused, and the run dir (its tokenizer, the default name) is found."""
    pytest.importorskip("safetensors")
    run = tmp_path / "runs" / "linked"
    shutil.copytree(run_dir, run, symlinks=True)
    disk = tmp_path / "disk" / "ckpts"
    disk.parent.mkdir()
    (run / "checkpoints").rename(disk)
    (run / "checkpoints").symlink_to(disk)
    aside = tmp_path / "runs" / "aside"
    shutil.copytree(run_dir, aside, symlinks=True)
    (aside / "checkpoints" / "abandoned-20261201-000000").mkdir()
    (aside / "checkpoints" / "step_00000002").rename(
        aside / "checkpoints" / "abandoned-20261201-000000" / "step_00000002"
    )
    for ckpt, folder in [
        (disk / "step_00000002", disk),
        (
            aside / "checkpoints" / "abandoned-20261201-000000" / "step_00000002",
            aside / "checkpoints",
        ),
    ]:
        before = sorted(p.name for p in folder.iterdir())
        assert main(["convert", str(ckpt), "--out", str(folder / "model.pt")]) == 2
        assert "is inside a checkpoint directory" in capsys.readouterr().err
        assert main(["export", str(ckpt), "--out", str(folder / "hf")]) == 2
        assert "or lie in a checkpoint" in capsys.readouterr().err
        assert sorted(p.name for p in folder.iterdir()) == before
        out = tmp_path / "exports" / ckpt.parent.name
        assert main(["export", str(ckpt), "--out", str(out)]) == 0, capsys.readouterr().err
        assert (out / "tokenizer.model").read_bytes() == (run_dir / "tokenizer.model").read_bytes()


def test_a_run_tokenizer_linked_elsewhere_is_refused_before_the_export_writes(
    run_dir, tmp_path, capsys
):
    """The run's tokenizer.model a link out of the run dir: export wrote every weight, then
    refused it, leaving the folders above --out it had made."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, symlinks=True)
    (run / "tokenizer.model").rename(tmp_path / "elsewhere.model")
    (run / "tokenizer.model").symlink_to(tmp_path / "elsewhere.model")
    assert main(["export", str(run), "--out", str(tmp_path / "a" / "b" / "hf")]) == 2
    assert "tokenizer.model is a symlink to" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_a_failed_export_or_convert_leaves_no_folder_it_made(run_dir, tmp_path, monkeypatch):
    """The disk full while the weights are written: the partial output went, but the folders
    made above --out stayed."""
    import errno

    import scale_llm.export
    import scale_llm.train.convert

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(scale_llm.export, "_write_weights", full)
    monkeypatch.setattr(scale_llm.train.convert.torch, "save", full)
    (tmp_path / "kept").mkdir()
    for argv in (
        ["export", str(run_dir), "--out", str(tmp_path / "kept" / "a" / "b" / "hf")],
        ["convert", str(run_dir), "--out", str(tmp_path / "kept" / "a" / "b" / "model.pt")],
    ):
        assert main(argv) == 2
        assert list((tmp_path / "kept").iterdir()) == []


def test_a_stop_signal_during_export_or_convert_leaves_nothing_half_written(run_dir, tmp_path):
    """SIGTERM as the output is about to be published (its files written under a temporary
    name) killed export and convert at once: the half-written folder or file stayed beside
    --out, never removed. Each ends through its cleanup now, exit 143."""
    script = f"""
import os, signal, sys
import scale_llm.export, scale_llm.train.convert
from scale_llm.cli import main

def stop_then(original):
    def stopped(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)
    return stopped

scale_llm.export.publish = stop_then(scale_llm.export.publish)
scale_llm.train.convert.check_out = stop_then(scale_llm.train.convert.check_out)
codes = [main(["export", {str(run_dir)!r}, "--out", {str(tmp_path / "out" / "hf")!r}])]
codes.append(main(["convert", {str(run_dir)!r}, "--out", {str(tmp_path / "out" / "m.pt")!r}]))
print(codes)
"""
    (tmp_path / "out").mkdir()
    done = subprocess.run([sys.executable, "-c", script], env=env(), capture_output=True, text=True)
    assert done.stdout.strip() == "[143, 143]", done.stderr[-2000:]
    assert done.stderr.count("stopped by SIGTERM") == 2
    assert list((tmp_path / "out").iterdir()) == []


# ----------------------------------------------------------------------------- bench, check
def test_bench_checkpoint_io_works_in_a_folder_of_its_own(tmp_path, capsys):
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "keep.txt").write_text("mine")
    (cwd / "runs").mkdir()
    (cwd / "runs" / "r.txt").write_text("a run")
    before = snapshot(cwd)
    args = [*(a for k in TINY_MODEL for a in ("--set", k)), "--set", "train.device=cpu"]
    laid_out = ["--set", "parallel.world_size=2"]  # (a warning: on stderr, not among the rows)
    assert main(["bench", *args, *laid_out, "--checkpoint-io", str(cwd), "--rounds", "1"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert "parallel.world_size=2: the config is laid out for 2 ranks" in err
    kinds = ["plain", "with record", "async", "async_with_pinned_mem"]
    assert [r["kind"] for r in rows] == kinds and rows[0]["gb"] > 0
    assert snapshot(cwd) == before  # the timed saves happened in a folder it made, now gone
    new = tmp_path / "new" / "io"
    assert main(["bench", *args, "--checkpoint-io", str(new), "--rounds", "1"]) == 0
    assert not (tmp_path / "new").exists()  # made for the call, removed after it


def test_a_scratch_folder_the_filesystem_refuses_is_one_paragraph(tmp_path, monkeypatch):
    """A folder the permission check passes but the filesystem refuses (root in /proc): one
    paragraph naming it, and the parents the attempt made are removed again."""
    from scale_llm.files import private_dir

    def refused(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr("tempfile.mkdtemp", refused)
    refusal = r"new/io: cannot make a folder there \(No such file"
    with pytest.raises(UserError, match=refusal), private_dir(tmp_path / "new" / "io", "x-"):
        pass
    assert list(tmp_path.iterdir()) == []


def test_check_folders_the_filesystem_refuses_are_one_paragraph_and_leave_nothing(
    tmp_path, monkeypatch, capsys
):
    """`check OUT --scratch DIR` where the permission check passes but the filesystem refuses
    the folder (root in /proc): a FileNotFoundError traceback, and OUT, claimed first, stayed
    behind (the same for OUT's own folder)."""
    from scale_llm.cli import main

    real_mkdir = Path.mkdir

    def refused(self, *args, **kwargs):
        if "refused" in self.parts:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refused)
    scratch, out = tmp_path / "refused" / "scratch", tmp_path / "out"
    assert main(["check", str(out), "--scratch", str(scratch)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --scratch {scratch}: cannot make it there (No such file")
    for out in (tmp_path / "refused" / "out", tmp_path / "refused"):  # (its parent there)
        assert main(["check", str(out)]) == 2
        assert capsys.readouterr().err.startswith(f"error: check OUT {out}: cannot make it")
    assert list(tmp_path.iterdir()) == []


def test_check_keeps_to_its_own_report_and_runs_folders(tmp_path):
    from scale_llm.analysis.check import claim_out, new_runs_dir

    scratch = tmp_path / "scratch"
    (scratch / "runs" / "mine").mkdir(parents=True)  # a user's runs where the check once put its
    (scratch / "runs" / "mine" / "metrics.jsonl").write_text("{}\n")
    (scratch / "runs-notes").mkdir()  # named like the check's runs folders, but not marked
    before = snapshot(scratch)
    first = new_runs_dir(scratch)
    second = new_runs_dir(scratch)  # this process's earlier check has ended: its folder goes
    assert not first.exists() and second.is_dir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mark = json.loads((second / OWNER_MARKER).read_text())
        (second / OWNER_MARKER).write_text(json.dumps({**mark, "pid": other.pid}))
        third = new_runs_dir(scratch)  # the check of `second` still runs: its folder stays
        assert second.is_dir()
    finally:
        other.kill()
        other.wait()
    fourth = new_runs_dir(scratch)  # ... until it has exited; nothing else goes
    assert not second.exists() and not third.exists()
    shutil.rmtree(fourth)
    assert snapshot(scratch) == before

    earlier = tmp_path / "earlier"  # what an earlier check left, without the mark
    earlier.mkdir()
    (earlier / "report.json").write_text(json.dumps({"device": "cpu", "torch": "x", "errors": []}))
    (earlier / "check.log").write_text("")
    claim_out(earlier)
    assert (earlier / OWNER_MARKER).is_file()


def test_check_prepares_a_data_dir_given_by_set_only_when_nothing_is_replaced(
    data_dir, corpus_dir, tmp_path, capsys
):
    """`check --set data.dir=X` prepared X with the check's settings: a user's data prepared
    with others (another vocabulary) had its tokenizer and shards replaced, exit 0. Data those
    settings prepared is read as it is; other data is refused before any work."""
    from scale_llm.analysis.check import tiny_config
    from scale_llm.data.prepare import would_replace
    from tests.helpers import TINY_MODEL

    mine = tmp_path / "mine"
    shutil.copytree(data_dir, mine)
    same = [*TINY_MODEL, f"data.source={corpus_dir}", f"data.dir={mine}", "data.val_fraction=0.1"]
    same.append("data.tokenizer_sample_bytes=500000")
    assert not would_replace(tiny_config(tmp_path / "s", tmp_path / "r", 2, same))
    other = [*same, "model.vocab_size=1024"]
    assert would_replace(tiny_config(tmp_path / "s", tmp_path / "r", 2, other))
    before = snapshot(tmp_path)
    sets = [x for item in other for x in ("--set", item)]
    assert main(["check", str(tmp_path / "out"), "--scratch", str(tmp_path / "s"), *sets]) == 2
    said = capsys.readouterr().err
    assert f"--set data.dir={mine}: the folder holds data prepared from other input" in said
    assert snapshot(tmp_path) == before


def test_check_leaves_what_the_user_keeps_in_its_scratch(tmp_path, capsys, caplog):
    """The check prepared its corpus into SCRATCH/data, replacing a user's prepared data there;
    removed an earlier runs folder with the files a user had put in it; and took an OUT inside
    such a folder, deleted it and raised FileNotFoundError. Each is refused or kept now."""
    from scale_llm.analysis.check import DATA_KIND, mark_scratch_data, new_runs_dir

    scratch = tmp_path / "scratch"
    (scratch / "data").mkdir(parents=True)
    (scratch / "data" / "manifest.json").write_text("{}")  # the user's own prepared data
    before = snapshot(tmp_path)
    assert main(["check", str(tmp_path / "report"), "--scratch", str(scratch)]) == 2
    said = capsys.readouterr().err
    assert f"--scratch {scratch} holds data, which the check did not make" in said, said
    assert snapshot(tmp_path) == before
    mine = tmp_path / "mine"  # a data.dir of --set's: prepared again with the check's settings
    (mine / "manifest.json").parent.mkdir()
    (mine / "manifest.json").write_text("{}")
    before = snapshot(tmp_path)
    argv = ["check", str(tmp_path / "report"), "--scratch", str(tmp_path / "s2")]
    assert main([*argv, "--set", f"data.dir={mine}"]) == 2
    said = capsys.readouterr().err
    assert f"--set data.dir={mine}: the folder holds data prepared from other input" in said, said
    assert snapshot(tmp_path) == before
    runs = new_runs_dir(scratch)  # a scratch the check used before it marked its data: adopted
    (runs / "check-cpu-fp32-eager").mkdir()
    (runs / "scaling.yaml").write_text("")
    mark_scratch_data(scratch / "data")
    assert json.loads((scratch / "data" / OWNER_MARKER).read_text())["kind"] == DATA_KIND
    for out in (runs / "report", scratch / "data" / "report"):
        assert main(["check", str(out), "--scratch", str(scratch)]) == 2
        assert f"check OUT {out} lies in {out.parent}, which the check" in capsys.readouterr().err
        assert not out.exists()
    (runs / "my-export").mkdir()  # a user's files put in the check's runs folder
    (runs / "notes.txt").write_text("mine")
    with caplog.at_level("WARNING"):
        newer = new_runs_dir(scratch)
    assert (runs / "notes.txt").read_text() == "mine" and (runs / "my-export").is_dir()
    assert f"kept {runs}: it holds files the check did not write (my-export, notes.txt)" in (
        caplog.text
    )
    (runs / "notes.txt").unlink()
    (runs / "my-export").rmdir()
    new_runs_dir(scratch)  # only its own left: removed, with the newer one
    assert not runs.exists() and not newer.exists()
    # a run trained on in an earlier check's runs folder: it went whole, its new checkpoints
    # with it, and the live run crashed. Kept now: files changed since the check's record, or
    # (no record: a check cut short) a run whose lock a live process holds.
    from scale_llm.analysis.check import RUNS_FILES, files_below

    runs = new_runs_dir(scratch)
    run = runs / "check-cpu-fp32-eager"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 8}\n')
    (runs / RUNS_FILES).write_text(json.dumps(files_below(runs)))  # as the check leaves it
    (run / "checkpoints" / "step_00000040").mkdir()
    (run / "checkpoints" / "step_00000040" / "trainer.pt").write_bytes(b"weights")
    caplog.clear()
    with caplog.at_level("WARNING"):
        newer = new_runs_dir(scratch)
    assert (run / "checkpoints" / "step_00000040" / "trainer.pt").read_bytes() == b"weights"
    assert f"kept {runs}: it holds files added or changed since the check (" in caplog.text
    (runs / RUNS_FILES).unlink()
    (run / ".lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    caplog.clear()
    with caplog.at_level("WARNING"):
        new_runs_dir(scratch)
    assert f"kept {runs}: it holds a run a live process holds (check-cpu-fp32-eager)" in caplog.text
    (run / ".lock").unlink()
    new_runs_dir(scratch)  # no record, no live run: the check's, removed
    assert not runs.exists() and not newer.exists()
    # a data folder of the user's beside a check's runs folder was taken as the check's
    other = tmp_path / "other"
    new_runs_dir(other)
    (other / "data").mkdir()
    (other / "data" / "notes.txt").write_text("mine")
    before = snapshot(other)
    assert main(["check", str(tmp_path / "r2"), "--scratch", str(other)]) == 2
    assert f"--scratch {other} holds data, which the check did not make" in capsys.readouterr().err
    assert snapshot(other) == before and not (tmp_path / "r2").exists()


def test_check_refuses_a_scratch_folder_others_can_write(tmp_path, monkeypatch, capsys):
    """The default scratch lies in the shared temporary folder: another user could make it
    first (or it is writable by all), with data for the check to train on, or links among its
    runs folders. Refused before any work, named or the default; the default is per user."""
    from scale_llm.analysis import check

    assert check.default_scratch().name == f"scale-llm-check-{os.getuid()}"
    scratch = tmp_path / "scratch"
    (scratch / "data").mkdir(parents=True)
    scratch.chmod(0o777)
    monkeypatch.setattr(check, "default_scratch", lambda: scratch)
    before = snapshot(tmp_path)
    for given in (["--scratch", str(scratch)], []):
        assert main(["check", str(tmp_path / "report"), *given]) == 2
        said = capsys.readouterr().err
        assert f"--scratch {scratch} can be written into by other users" in said, said
        assert snapshot(tmp_path) == before
    scratch.chmod(0o755)
    monkeypatch.setattr(os, "getuid", lambda: scratch.stat().st_uid + 1)
    assert main(["check", str(tmp_path / "report")]) == 2
    assert f"--scratch {scratch} belongs to another user" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_the_gpu_checks_fp8_item_alone_refuses_a_scratch_folder_others_can_write(tmp_path):
    """`gpu-check.sh --fp8-only` trains from the check's scratch folder without the check's own
    start: it refuses the same folder, in one paragraph, before claiming OUT (and
    --calibration-only a bad OUT)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    scratch.chmod(0o777)
    out = tmp_path / "report"
    cmd = ["bash", str(REPO / "launch" / "gpu-check.sh"), str(out), "--fp8-only"]
    proc = subprocess.run(
        [*cmd, f"--scratch={scratch}"], env=env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: --scratch {scratch} can be written into by other users" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    assert list(scratch.iterdir()) == []
    out.write_text("a file of the user's")  # --calibration-only: OUT refused the same way
    calibration = {**env(), "SCALE_LLM_CHECK_CALIBRATION": "1"}
    proc = subprocess.run(
        [*cmd[:3], "--calibration-only"],
        env=calibration,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and f"error: check OUT {out} is a file" in proc.stderr
    assert "Traceback" not in proc.stderr and out.read_text() == "a file of the user's"
    out.unlink()  # a user's data in the scratch, where --fp8-only prepares: refused, kept
    scratch.chmod(0o755)
    import torch

    data = scratch / ("data-builtin-v32000" if torch.cuda.is_available() else "data")
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    proc = subprocess.run(
        [*cmd, f"--scratch={scratch}"], env=env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2 and f"holds {data.name}, which the check did not" in proc.stderr
    assert not out.exists() and [p.name for p in data.iterdir()] == ["manifest.json"]


# ----------------------------------------------------------------------------- prepare
def _corpus(root: Path, n: int = 40) -> Path:
    root.mkdir()
    for i, text in enumerate(random_texts(n, "doc{i:03d}", length=400)):
        (root / f"{i:03d}.txt").write_text(text)
    return root


def test_prepare_leaves_files_it_did_not_write_and_its_manifest_decides_what_it_replaces(
    tmp_path,
):
    """(A file named like its shards that no manifest lists: a case of tests/test_errors.py.)"""
    from scale_llm.data.prepare import prepare
    from scale_llm.data.shards import read_manifest, shard_problems

    corpus = _corpus(tmp_path / "corpus")
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("mine")
    prepare(prep_config(corpus, data))
    first = read_manifest(data)
    prepare(prep_config(corpus, data, "data.shard_tokens=2048"), force=True)  # other shards
    manifest = read_manifest(data)
    assert manifest["fingerprint"] != first["fingerprint"] and not shard_problems(data, manifest)
    listed = {s["file"] for split in manifest["splits"].values() for s in split["shards"]}
    names = {p.name for p in data.iterdir()}
    assert names == listed | {"manifest.json", "tokenizer.model", "notes.txt", MARK}


def test_prepare_proves_on_every_run_that_what_it_replaces_is_its_own(tmp_path):
    """Its mark beside a manifest proves the manifest prepare's (a damaged one too: --force
    rebuilds it); without the mark (a folder prepared before it, a complete manifest too)
    anything under its names is refused, the folder unchanged, on every run. (The refused
    cases: tests/bad_input_cases.py, OWNED_OUTPUTS and COMPAT.)"""
    from scale_llm.data.prepare import prepare
    from scale_llm.data.shards import read_manifest

    corpus = _corpus(tmp_path / "corpus")
    data = tmp_path / "data"
    prepare(prep_config(corpus, data))
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["tokenizer"]["sha256"]  # damaged by hand: still prepare's, rebuilt by --force
    (data / "manifest.json").write_text(json.dumps(manifest))
    prepare(prep_config(corpus, data), force=True)
    read_manifest(data)
    (data / MARK).unlink()  # as prepared before the mark: a complete manifest proves nothing
    for settings, force in [((), False), (("data.shard_tokens=2048",), True)]:
        before = snapshot(data)
        with pytest.raises(UserError, match="holds manifest.json, which prepare cannot prove"):
            prepare(prep_config(corpus, data, *settings), force=force)
        assert snapshot(data) == before


def test_prepare_proves_what_it_replaces_again_before_publishing(tmp_path, monkeypatch):
    """A file named like a new shard that appears in data.dir while prepare builds (the check
    before any work saw none) is kept: prepare stops before publishing, and the next prepare
    publishes the finished build once the file is moved away."""
    from scale_llm.data import prepare_source
    from scale_llm.data.prepare import prepare
    from scale_llm.data.shards import read_manifest

    corpus, data = _corpus(tmp_path / "corpus"), tmp_path / "data"
    publish = prepare_source._publish

    def user_adds_a_file(build, out):
        (out / "train_00000.bin").write_text("mine")
        if out.name == "listed":  # with a manifest.json naming it: not prepare's either
            (out / "manifest.json").write_text(
                '{"splits": {"train": {"shards": [{"file": "train_00000.bin"}]}}}'
            )
        publish(build, out)

    monkeypatch.setattr(prepare_source, "_publish", user_adds_a_file)
    for folder in (tmp_path / "listed", data):
        with pytest.raises(UserError, match="now holds .*train_00000.bin, named like the files"):
            prepare(prep_config(corpus, folder))
        assert (folder / "train_00000.bin").read_text() == "mine"
    assert (tmp_path / "listed" / "manifest.json").read_text().startswith('{"splits"')
    monkeypatch.setattr(prepare_source, "_publish", publish)
    (data / "train_00000.bin").rename(tmp_path / "mine.bin")
    prepare(prep_config(corpus, data))
    read_manifest(data)


def test_two_prepares_of_one_data_dir_take_turns(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    data = tmp_path / "data"
    lock = OwnerLock(data / ".prepare.lock", "data", "")
    lock.acquire()  # another prepare is at work
    cmd = [sys.executable, "-m", "scale_llm", "prepare", "--set", "model.vocab_size=400"]
    cmd += ["--set", f"data.source={corpus}", "--set", f"data.dir={data}"]
    log = tmp_path / "waiting.log"
    with open(log, "w") as f:
        waiting = subprocess.Popen(cmd, env=env(), stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while "waiting for another prepare" not in log.read_text() and time.time() < deadline:
            assert waiting.poll() is None, log.read_text()
            time.sleep(0.2)
        assert f"waiting for another prepare of this data.dir (pid {os.getpid()}" in log.read_text()
        assert sorted(p.name for p in data.iterdir()) == [".prepare.lock"]  # nothing built yet
    finally:
        lock.release()
    assert waiting.wait(timeout=300) == 0, log.read_text()
    assert "wrote" in log.read_text()

    both = [
        subprocess.Popen([*cmd, "--force"], env=env(), stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [(p.wait(timeout=300), p.stdout.read()) for p in both]
    assert [rc for rc, _ in results] == [0, 0], results
    from scale_llm.data.shards import read_manifest, shard_problems

    assert not shard_problems(data, read_manifest(data))
    assert not (data / ".prepare-build").exists() and not (data / ".prepare.lock").exists()


# ----------------------------------------------------------------------------- run lock
def _contend(path: str, start, tried, results) -> None:
    lock = OwnerLock(Path(path), "the run", "pick another")
    start.wait()
    try:
        lock.acquire()
    except UserError:
        results.put(False)
        tried.wait(timeout=60)
        return
    results.put(True)
    tried.wait(timeout=60)  # held until every contender has tried (a late one under load too)
    lock.release()


def test_the_run_lock_admits_one_of_many_simultaneous_launches(tmp_path):
    """Contenders started at one barrier, on a fresh lock, on an empty lock file (a launch
    that died before writing it), and on a dead owner's lock: exactly one wins each round."""
    ctx = multiprocessing.get_context("fork")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rounds = 40
    for n in range(rounds):
        path = tmp_path / f"lock{n}"
        if n % 3 == 1:
            path.write_text("")
        elif n % 3 == 2:
            path.write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
        start, tried, results = ctx.Barrier(3), ctx.Barrier(3), ctx.Queue()
        args = (str(path), start, tried, results)
        procs = [ctx.Process(target=_contend, args=args) for _ in range(3)]
        for p in procs:
            p.start()
        outcome = sorted(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        assert outcome == [False, False, True], f"round {n}: {outcome}"
        assert not path.exists()  # released by its winner


def test_a_lock_held_by_a_live_process_is_refused_by_the_early_check(tmp_path):
    path = tmp_path / ".lock"
    code = (
        "import sys, time; from pathlib import Path; from scale_llm.files import OwnerLock; "
        f"OwnerLock(Path({str(path)!r}), 'x', '').acquire(); print('held', flush=True); "
        "time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], env=env(), stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"held"
        with pytest.raises(UserError, match=rf"in use by another launch \(pid {holder.pid} on"):
            OwnerLock(path, "runs/x", "pick another run.name").check()
    finally:
        holder.kill()
        holder.wait()
    OwnerLock(path, "runs/x", "pick another run.name").check()  # its owner died: stale, fine
