"""Preparation at scale: parallel == serial, interrupted prepare continues, tokenizer mismatch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scale_llm.cli import main
from scale_llm.config import load_config
from scale_llm.data import encode as encode_mod
from scale_llm.data import prepare_source as prepare_mod
from scale_llm.data.encode import Encoder, batched
from scale_llm.data.prepare import prepare
from scale_llm.data.shards import read_manifest
from scale_llm.data.sources import Document
from scale_llm.errors import UserError
from tests.helpers import (
    TINY_MODEL,
    env,
    logged,
    make_config,
    prep_config,
    random_texts,
    trainer_for,
)


def corpus(tmp_path, n=60):
    path = tmp_path / "c.jsonl"
    texts = random_texts(n, "doc{i}", seed=1, vocab=400, word_len=4, length=150)
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return path


def config(source, out, *extra):
    return prep_config(
        source, out, "data.val_fraction=0.2", "data.shard_tokens=1500", "data.num_proc=1", *extra
    )


def shard_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.bin"))}


@pytest.fixture
def small_batches(monkeypatch):
    """About three documents per encode batch, so a run has many batches and checkpoints."""
    monkeypatch.setattr(encode_mod, "BATCH_CHARS", 2000)
    monkeypatch.setattr(prepare_mod, "CHECKPOINT_SECONDS", 0.0)


def test_worker_processes_give_the_same_tokens_as_one_process(data_dir, corpus_dir, small_batches):
    from scale_llm.data.sources import local_source

    docs = list(local_source(str(corpus_dir), "text").documents())[:40]
    model = data_dir / "tokenizer.model"
    with Encoder(model, 0.1, 1) as one, Encoder(model, 0.1, 2) as two:
        serial = list(one.map(batched(docs)))
        parallel = list(two.map(batched(docs)))
        assert (one.processes, two.processes) == (1, 2)
    assert len(serial) == len(parallel) > 2
    for a, b in zip(serial, parallel):
        assert np.array_equal(a.tokens, b.tokens)
        assert np.array_equal(a.lengths, b.lengths) and np.array_equal(a.is_val, b.is_val)
    first = serial[0]
    assert first.tokens[0] == 1 and first.tokens[first.lengths[0] - 1] == 2  # BOS ... EOS


def test_interrupted_prepare_continues_and_matches_an_uninterrupted_one(
    tmp_path, monkeypatch, small_batches
):
    src = corpus(tmp_path)
    reference = prepare(config(src, tmp_path / "ref", "data.num_proc=2"))
    assert len(reference["splits"]["train"]["shards"]) > 3

    out = tmp_path / "out"
    real_write, calls = prepare_mod._write, []

    def write_then_die(writers, batch, n_docs):
        calls.append(n_docs)
        if len(calls) == 9:
            raise KeyboardInterrupt  # killed mid-run, after 8 batches were checkpointed
        return real_write(writers, batch, n_docs)

    monkeypatch.setattr(prepare_mod, "_write", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare(config(src, out))
    with pytest.raises(UserError, match="manifest.json missing"):
        read_manifest(out)  # a half-done directory never reads as prepared
    build = out / ".prepare-build"  # where an unfinished prepare writes
    progress = json.loads((build / "progress.json").read_text())
    assert progress["documents_read"] == sum(calls[:8])
    partial = next(build.glob("*.partial"))
    with open(partial, "ab") as f:
        f.write(b"\x07\x00" * 5)  # bytes written after the last checkpoint: must be dropped

    def no_retraining(*a, **k):
        raise AssertionError("the resumed prepare retrained the tokenizer")

    resumed_docs = []
    monkeypatch.setattr(prepare_mod, "train_tokenizer", no_retraining)
    monkeypatch.setattr(
        prepare_mod, "_write", lambda w, b, n: resumed_docs.append(n) or real_write(w, b, n)
    )
    manifest = prepare(config(src, out))
    assert sum(resumed_docs) == 60 - progress["documents_read"]  # only the rest was encoded
    assert manifest["splits"] == reference["splits"]
    assert manifest["tokenizer"] == reference["tokenizer"]
    assert shard_bytes(out) == shard_bytes(tmp_path / "ref")
    assert not list(out.glob("*.partial")) and not (out / "progress.json").exists()
    assert not build.exists()

    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert prepare(config(src, out)) == manifest  # finished: a no-op
    assert (out / "manifest.json").stat().st_mtime_ns == stamp


def test_a_prepare_stopped_before_its_first_checkpoint_writes_its_shards_afresh(
    tmp_path, monkeypatch, small_batches
):
    """Stopped before its first checkpoint (the first ~30 s), the next prepare appended the
    whole corpus to the partial shards it had left: duplicated documents, shards larger than
    the manifest says, published with exit 0."""
    src, one_shard = corpus(tmp_path), "data.shard_tokens=1000000"  # (none finished early)
    reference = prepare(config(src, tmp_path / "ref", one_shard))
    out = tmp_path / "out"
    real_write, calls = prepare_mod._write, []

    def write_then_die(writers, batch, n_docs):
        calls.append(n_docs)
        if len(calls) == 4:
            raise KeyboardInterrupt  # stopped with 3 batches written, none checkpointed
        return real_write(writers, batch, n_docs)

    monkeypatch.setattr(prepare_mod, "CHECKPOINT_SECONDS", 1e9)
    monkeypatch.setattr(prepare_mod, "_write", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare(config(src, out, one_shard))
    assert sum(p.stat().st_size for p in (out / ".prepare-build").glob("*.partial")) > 0
    monkeypatch.setattr(prepare_mod, "_write", real_write)
    manifest = prepare(config(src, out, one_shard))
    assert manifest["splits"] == reference["splits"]
    assert shard_bytes(out) == shard_bytes(tmp_path / "ref")
    read_manifest(out)


def test_stale_progress_starts_afresh(tmp_path, monkeypatch, small_batches):
    src = corpus(tmp_path)
    out = tmp_path / "out"
    real_write, calls = prepare_mod._write, []

    def die_late(writers, batch, n_docs):
        calls.append(1)
        if len(calls) == 12:
            raise KeyboardInterrupt
        return real_write(writers, batch, n_docs)

    monkeypatch.setattr(prepare_mod, "_write", die_late)
    with pytest.raises(KeyboardInterrupt):
        prepare(config(src, out))
    monkeypatch.setattr(prepare_mod, "_write", real_write)
    # a finished shard the checkpoint relies on is gone
    (out / ".prepare-build" / "train_00000.bin").unlink()
    manifest = prepare(config(src, out))
    assert sum(s["documents"] for s in manifest["splits"].values()) == 60
    read_manifest(out)
    # a record whose counts disagree with its splits (a hand-edited documents_read skipped that
    # many documents of the corpus, without a word): afresh, every document kept
    # and one whose dtype is not its tokenizer's (uint32 ids cut to uint16 without a word)
    for key, more in (("documents_read", 20), ("tokens", 1), ("dtype", "uint32")):
        calls.clear()
        monkeypatch.setattr(prepare_mod, "_write", die_late)
        with pytest.raises(KeyboardInterrupt):
            prepare(config(src, tmp_path / key))
        monkeypatch.setattr(prepare_mod, "_write", real_write)
        record = tmp_path / key / ".prepare-build" / "progress.json"
        progress = json.loads(record.read_text())
        progress[key] = more if key == "dtype" else progress[key] + more
        record.write_text(json.dumps(progress))
        with logged() as logs:
            manifest = prepare(config(src, tmp_path / key))
        said = "its shards are uint32, its tokenizer's ids uint16" if key == "dtype" else "it read"
        assert f"cannot continue the interrupted prepare ({said}" in logs.text, key
        assert sum(s["documents"] for s in manifest["splits"].values()) == 60
        assert manifest["dtype"] == "uint16"


def test_shards_of_another_tokenizer_are_refused(tmp_path, data_dir, corpus_dir):
    # 1. a tokenizer file swapped under prepared shards
    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    other = prepare(config(corpus(tmp_path), tmp_path / "other"))
    shutil.copyfile(tmp_path / "other" / "tokenizer.model", copy / "tokenizer.model")
    with pytest.raises(UserError, match="is not the tokenizer the shards.*were made with"):
        read_manifest(copy)
    assert other["tokenizer"]["sha256"] != read_manifest(data_dir)["tokenizer"]["sha256"]

    # 2. resuming a run on data tokenized with a different tokenizer
    runs = tmp_path / "runs"
    first = make_config(data_dir, runs, "train.max_steps=1")
    trainer_for(first).fit()
    assert (runs / "test" / "tokenizer.model").read_bytes() == (
        data_dir / "tokenizer.model"
    ).read_bytes()  # the tokenizer travels with the run
    retokenized = tmp_path / "retok"
    prepare(
        load_config(
            None,
            [
                "model.vocab_size=512",
                f"data.source={corpus_dir}",
                f"data.dir={retokenized}",
                "data.tokenizer_sample_bytes=200000",
                "data.val_fraction=0.1",
            ],
        )
    )
    with pytest.raises(UserError, match="its tokenizer differs"):
        again = make_config(retokenized, runs, "train.max_steps=2")
        trainer_for(again)


def test_prepare_bench_prints_tokens_per_second(data_dir, corpus_dir, capsys, monkeypatch):
    monkeypatch.setattr(encode_mod, "BATCH_CHARS", 100_000)
    args = ["--set", "model.vocab_size=512", "--set", f"data.source={corpus_dir}"]
    code = main(
        [
            "prepare",
            "--bench",
            "--bench-mb",
            "0.5",
            *args,
            "--set",
            f"data.dir={data_dir}",
            "--set",
            "data.num_proc=2",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "plain loop: sp.encode per document" in out
    assert "worker processes" in out and "tokens/s" in out


def test_documents_are_split_by_id_not_by_position():
    docs = [Document(f"file{i}.txt", "x") for i in range(2000)]
    val = [d for d in docs if encode_mod.is_val_document(d.doc_id, 0.1)]
    assert 150 < len(val) < 250
    # pinned: the split of a document never changes (between processes, Python's hash() would)
    assert [d.doc_id for d in val[:2]] == ["file33.txt", "file56.txt"]


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _start_prepare(tmp_path) -> subprocess.Popen:
    """`prepare` of the built-in corpus with 2 worker processes, in the background, from a
    working folder holding a threading.py that would say it ran (`_planted_ran`): a spawned
    worker starts as `python -c`, the working folder first on its sys.path."""
    work = tmp_path / "work"
    work.mkdir()
    ran = tmp_path / "planted-threading-ran"
    (work / "threading.py").write_text(f"open({str(ran)!r}, 'a').close()\nraise ImportError\n")
    args = ["--set", "model.vocab_size=512", "--set", f"data.dir={tmp_path / 'data'}"]
    args += ["--set", "data.num_proc=2", "--set", "data.tokenizer_sample_bytes=300000"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    return subprocess.Popen(
        [sys.executable, "-m", "scale_llm", "prepare", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=work,
    )


def test_a_script_calling_prepare_without_a_main_guard_stops_instead_of_waiting(
    corpus_dir, tmp_path
):
    """Python starts each of prepare's workers by running the calling script again: a script
    that calls prepare at its top level had each worker wait, without end, for the data.dir lock
    its parent held (the log said "waiting for another prepare"). The refusal is at the lock:
    an up-to-date data.dir's prepare stays a no-op in a spawned process."""
    script = tmp_path / "script.py"
    settings = [*TINY_MODEL, f"data.source={corpus_dir}", f"data.dir={tmp_path / 'data'}"]
    settings += ["data.num_proc=2", "data.tokenizer_sample_bytes=300000"]
    script.write_text(
        "from scale_llm.config import load_config\n"
        "from scale_llm.data.prepare import prepare\n"
        f"prepare(load_config(None, {settings!r}))\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], env=env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert 'call prepare under `if __name__ == "__main__":`' in proc.stderr, proc.stderr[-3000:]
    # the workers say why, without a traceback; the parent's pool error is one paragraph
    assert "BrokenProcessPool" not in proc.stderr and proc.stderr.count("Traceback") == 1
    assert "WorkersEnded: data: a worker process of prepare's 2 ended" in proc.stderr, proc.stderr
    # on an up-to-date data.dir the script's own spawned process runs its top-level prepare
    # again: a read-only no-op (no lock), as before
    prepare(load_config(None, settings))
    script.write_text(
        script.read_text()
        + "import multiprocessing\n"
        + 'if __name__ == "__main__":\n'
        + "    child = multiprocessing.get_context('spawn').Process(target=print, args=('ran',))\n"
        + "    child.start()\n    child.join()\n    raise SystemExit(child.exitcode)\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], env=env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ran"), proc.stderr[-3000:]


def _planted_ran(tmp_path) -> bool:
    return (tmp_path / "planted-threading-ran").exists()


def _wait_for_workers(proc, n: int = 2, timeout: float = 60) -> list[int]:
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        kids = [k for k in _children(proc.pid) if _is_worker(k)]
        if len(kids) >= n:
            return kids
        if proc.poll() is not None:
            pytest.fail("prepare ended before its workers started")
        time.sleep(0.2)
    pytest.fail("no prepare workers appeared")


def _is_worker(pid: int) -> bool:
    import psutil

    try:
        return "multiprocessing" in " ".join(psutil.Process(pid).cmdline())
    except psutil.NoSuchProcess:
        return False


def test_prepare_workers_die_with_a_killed_parent(tmp_path):
    import signal
    import time

    import psutil

    proc = _start_prepare(tmp_path)
    workers = _wait_for_workers(proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.time() + 10
    while time.time() < deadline and any(psutil.pid_exists(w) for w in workers):
        time.sleep(0.2)
    alive = [w for w in workers if psutil.pid_exists(w) and psutil.Process(w).status() != "zombie"]
    assert not alive, f"orphaned prepare workers {alive}"
    assert not _planted_ran(tmp_path)


def test_a_worker_killed_mid_prepare_is_one_paragraph_and_its_build_is_kept(tmp_path):
    """The OOM killer ending one of prepare's workers: a BrokenProcessPool traceback; as a
    paragraph it must not take the build (shards, progress.json) with it as a bad record's
    refusal does: the next prepare continues from it."""
    import signal

    proc = _start_prepare(tmp_path)
    import psutil

    workers = _wait_for_workers(proc)  # (and the resource tracker: not one of them)
    encoder = [w for w in workers if "spawn_main" in " ".join(psutil.Process(w).cmdline())]
    os.kill(encoder[0], signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out[-2000:]
    assert "error: data: a worker process of prepare's 2 ended before its batch" in out
    assert "; what was written is kept: the same command continues" in out
    assert "Traceback" not in out and not _planted_ran(tmp_path)
    assert (tmp_path / "data" / ".prepare-build").is_dir()


def test_sigterm_during_prepare_says_what_was_kept(tmp_path):
    import signal
    import time

    proc = _start_prepare(tmp_path)
    _wait_for_workers(proc)
    proc.send_signal(signal.SIGTERM)
    said = ""
    for line in iter(proc.stdout.readline, ""):  # (the first taken: prepare says what it kept)
        said += line
        if "kept the shards" in line:
            break
    proc.send_signal(signal.SIGTERM)  # (Slurm's and a launcher's: taken as the first, no kill)
    out, _ = proc.communicate(timeout=60)
    out = said + out
    assert proc.returncode == 130, out[-2000:]
    assert "kept the shards written so far and progress.json" in out, out[-2000:]
    assert "Traceback" not in out
    assert not _planted_ran(tmp_path)  # (its workers: `scale-llm` sets PYTHONSAFEPATH)
    # Ctrl-C twice: it waited for its workers' batches, and the second hung it for good
    shutil.rmtree(tmp_path / "work")
    proc = _start_prepare(tmp_path)
    _wait_for_workers(proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)  # (ends, whenever the second one lands)
    assert proc.returncode in (130, -signal.SIGINT), out[-2000:]  # (the second: Python's own)


def test_sigterm_before_the_encoding_stops_prepare_as_ctrl_c_does(tmp_path):
    """SIGTERM while prepare read its sample and trained its tokenizer (before the workers
    started) ended it at once: no word, exit -15, as if killed."""
    import signal

    proc = _start_prepare(tmp_path)
    said = ""
    for line in iter(proc.stdout.readline, ""):
        said += line
        if "data: reading" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    out = said + out
    assert proc.returncode == 130 and "interrupted" in out, out[-2000:]
    assert "kept the shards" not in out and "Traceback" not in out, out[-2000:]
    assert not (tmp_path / "data" / "manifest.json").exists()


def test_a_progress_record_nested_100000_deep_starts_the_prepare_afresh(tmp_path, caplog):
    """prepare's own progress.json is read by the one JSON reader: a hostile one is damage,
    said in one line, and the build starts over (a RecursionError before)."""
    import logging

    from tests.bad_input_cases import damaged_build

    argv, out = damaged_build(tmp_path, "list")
    record = out / ".prepare-build" / "progress.json"
    record.write_text("[" * 100_000 + "]" * 100_000)
    with caplog.at_level(logging.INFO, logger="scale_llm"):
        assert main(argv) == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"{record} is damaged (" in said and "nested deeper than 64 levels" in said, said
    assert read_manifest(out)["splits"]["train"]["tokens"] > 0


def test_a_prepare_stopped_after_publishing_its_manifest_leaves_no_stale_record(
    tmp_path, monkeypatch
):
    """Stopped after the new manifest moved in, before its build folder was removed: the next
    prepare removes the rest of that build, whose record of the old data is spent (it was
    reused before: the shards of the data in place beyond that record's names were left behind,
    and every later prepare refused them as files no manifest lists)."""
    src = corpus(tmp_path)
    out = tmp_path / "out"
    prepare(config(src, out, "data.shard_tokens=4096"))
    monkeypatch.setattr(prepare_mod, "fsync_dir", lambda path: (_ for _ in ()).throw(OSError()))
    with pytest.raises(OSError):  # (fsync_dir follows the manifest's move)
        prepare(config(src, out, "data.shard_tokens=1024"), force=True)
    monkeypatch.undo()
    assert (out / ".prepare-build" / "previous-manifest.json").is_file()
    manifest = prepare(config(src, out, "data.shard_tokens=8192"), force=True)
    listed = {s["file"] for split in manifest["splits"].values() for s in split["shards"]}
    assert {p.name for p in out.iterdir()} == listed | {
        "manifest.json",
        "tokenizer.model",
        prepare_mod.MARK,
    }
    prepare(config(src, out, "data.shard_tokens=2048"), force=True)  # and the next one too
