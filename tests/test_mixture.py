"""data.sources: a weighted mixture prepared per source, read by the weights, evaluated per source,
resumed exactly; a mixture of one source is the one-source data and stream."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from scale_llm.cli import main
from scale_llm.data.loader import PERIOD, SourceSchedule, TokenWindows, TrainLoader
from scale_llm.data.prepare import prepare
from scale_llm.data.prepare_source import Kept
from scale_llm.errors import UserError, short
from scale_llm.train.trainer import Trainer
from tests.helpers import (
    batch_plan,
    logged,
    make_config,
    plan_for,
    prep_config,
    random_texts,
    snapshot,
    trainer_for,
)

WEIGHTS = {"web": 0.7, "code": 0.3}


def corpus(folder: Path, label: str, seed: int, n: int = 40) -> Path:
    folder.mkdir(parents=True)
    for i, text in enumerate(random_texts(n, label + "{i:03d}", seed=seed, length=150)):
        (folder / f"{i:03d}.txt").write_text(text)
    return folder


def sources_override(src: dict[str, Path], weights: dict[str, float] = WEIGHTS) -> str:
    entries = ", ".join(
        f"{{name: {n}, source: '{p}', weight: {weights[n]}}}" for n, p in src.items()
    )
    return f"data.sources=[{entries}]"


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """A prepared two-source mixture (web 0.7, code 0.3) of small random corpora (read only)."""
    root = tmp_path_factory.mktemp("mixture")
    src = {"web": corpus(root / "web", "web", 0), "code": corpus(root / "code", "code", 1)}
    prepare(mixture_config(root / "data", src))
    return root / "data", src


def mixture_config(data_dir: Path, src: dict[str, Path], weights: dict[str, float] = WEIGHTS):
    return prep_config("builtin", data_dir, sources_override(src, weights))


def test_every_stretch_of_the_stream_holds_each_source_by_its_weight():
    """The interleave: each source's k-th draw follows its (k-1)-th, and any window of the
    stream holds each source's share to within two sequences."""
    for weights in ([1.0], [0.7, 0.3], [1, 1, 1], [0.5, 0.25, 0.125, 0.125], [1e-5, 1]):
        schedule = SourceSchedule(weights)
        source, draw = schedule.locate(np.arange(2 * PERIOD + 100))
        share = np.array(weights) / sum(weights)
        for s in range(len(weights)):
            assert (draw[source == s] == np.arange((source == s).sum())).all()
        for start, length in ((0, 16), (1000, 160), (PERIOD - 50, 100), (0, PERIOD)):
            counts = np.bincount(source[start : start + length], minlength=len(weights))
            assert np.abs(counts - share * length).max() <= 2, (weights, start, length, counts)
        assert schedule.counts.min() >= 1  # a tiny weight still gets read


def test_tiny_weights_raised_to_one_sequence_take_their_slots_from_the_large_ones():
    """Tiny weights each get one sequence a period; what that adds over the period comes off
    the weights above one slot. Ordinary weights keep the counts their streams were read with."""
    cases = {
        (1e-6, 1e-6, 1.0): [1, 1, 4094],
        (1e-6,) * 5 + (1.0,): [1] * 5 + [4091],
        (1e-6, 1e-6, 1e-6, 1.0, 3.0): [1, 1, 1, 1023, 3070],
        (0.7, 0.3): [2867, 1229],
        (1, 1, 1): [1366, 1365, 1365],
        (0.5, 0.25, 0.125, 0.125): [2048, 1024, 512, 512],
        (1e-5, 1.0): [1, 4095],
        # a count raised to one is past its share: the leftover slot goes to a large remainder
        (0.0002, 0.3, 0.6998): [1, 1229, 2866],
        (0.9, 1000.5, 3094.6): [1, 1000, 3095],
    }
    for weights, counts in cases.items():
        assert SourceSchedule(list(weights)).counts.tolist() == counts, weights


def test_a_resume_read_with_other_counts_of_the_same_weights_says_so():
    """A checkpoint whose mixture was rounded to other counts a period (an older rounding of
    the same weights) continues at its position, with a warning; the same counts say nothing."""
    windows = TokenWindows([np.arange(2000, dtype=np.int64)], 8)  # (249 windows)
    sources = {"web": (0.0002, 100), "code": (0.9998, 149)}
    saved = TrainLoader(windows, batch_plan(4, 1), seed=3, sources=sources).state_dict()
    assert saved["period_counts"] == [1, 4095]
    for counts, said in (([1, 4095], False), ([2, 4094], True)):
        loader = TrainLoader(windows, batch_plan(4, 1), seed=3, sources=sources)
        with logged() as lines:
            loader.load_state_dict({**saved, "period_counts": counts, "position": 12})
        assert loader.position == 12
        assert ("read its mixture's sources [2, 4094] times" in lines.text) == said


def test_sources_reading_one_file_under_other_names_are_warned_of(tmp_path):
    """A folder and its subfolder as two sources: a file's name differs under each root, so one
    source's validation documents were the other's training documents, without a word."""
    web = corpus(tmp_path / "web", "web", 0, n=12)
    corpus(web / "hq", "hq", 1, n=12)
    said = "data.sources[0] (name web) and data.sources[1] (name code) read 12 of the same files"
    with logged() as lines:
        prepare(mixture_config(tmp_path / "a", {"web": web, "code": web / "hq"}))
    assert said in lines.text and "its val_loss reads trained text" in lines.text
    with logged() as lines:  # (one folder twice: the same names, the same split)
        prepare(mixture_config(tmp_path / "b", {"web": web, "code": web}))
    assert "of the same files" not in lines.text


def test_a_mixture_of_one_source_is_the_one_source_data_and_stream(tmp_path):
    src = corpus(tmp_path / "src", "doc", 0)
    one = prepare(prep_config(src, tmp_path / "one"))
    prepare(mixture_config(tmp_path / "mix", {"web": src}, {"web": 1.0}))
    for split in ("train", "val"):
        for shard in one["splits"][split]["shards"]:
            a = (tmp_path / "one" / shard["file"]).read_bytes()
            assert a == (tmp_path / "mix" / "web" / shard["file"]).read_bytes()
    windows = TokenWindows([np.arange(2000, dtype=np.int64)], 8)
    plan = batch_plan(4, 2)
    plain = TrainLoader(windows, plan, seed=3)
    mixed = TrainLoader(windows, plan, seed=3, sources={"web": (1.0, len(windows))})
    for _ in range(40):  # past an epoch (249 windows)
        a, b = plain.next_batches(), mixed.next_batches()
        assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b))


def test_a_mixture_step_is_the_same_on_any_world_size_and_a_used_up_source_repeats():
    """Two sources of 30 and 200 windows at 0.5 / 0.5: every step's global batch is the same
    read by 1 rank or 3, and the small source's second epoch is announced."""
    windows = TokenWindows([np.arange(241, dtype=np.int64), np.arange(1601) + 1000], 8)
    sources = {"small": (0.5, 30), "big": (0.5, 200)}
    one = TrainLoader(windows, batch_plan(6, 1), seed=1, sources=sources)
    ranks = [TrainLoader(windows, batch_plan(2, 1, 3, r), 1, sources=sources) for r in range(3)]
    with logged() as lines:
        for _ in range(12):  # 72 sequences: 36 of "small", its 31st starts a second epoch
            whole = one.next_batches()[0][0]
            pieces = torch.cat([r.next_batches()[0][0] for r in ranks])
            assert torch.equal(whole, pieces)
    said = [x for x in lines if "ran out" in x]
    assert (
        said
        == [
            "data: source small ran out after 1 epoch(s) of its 30 training windows; it "
            "is read again in a new order (stream position 60)"
        ]
        * 4
    ), said
    assert one.drawn() == {"small": 36, "big": 36}


def run(data_dir: Path, src: dict[str, Path], root: Path, *extra: str) -> Trainer:
    cfg = make_config(
        data_dir,
        root,
        sources_override(src),
        "model.vocab_size=400",
        "train.max_steps=8",
        "train.micro_batch_size=5",
        "logging.every=2",
        "eval.every=4",
        "eval.steps=1",
        "checkpoint.every=4",
        "data.prefetch=0",
        *extra,
    )
    return trainer_for(cfg)


def test_weights_per_source_losses_and_exact_resume(mixture, tmp_path):
    data_dir, src = mixture
    with logged() as lines:
        straight = run(data_dir, src, tmp_path / "a").fit()
    assert "data:   code         weight 0.300" in lines.text  # the mixture, said at start
    rows = {r["step"]: r for r in map(json.loads, (straight.run_dir / "metrics.jsonl").open())}
    read = rows[8]["tokens/web"] + rows[8]["tokens/code"]
    assert read == rows[8]["tokens"] == 8 * 5 * 32
    assert abs(rows[8]["tokens/code"] / read - 0.3) < 0.02  # 12 of the 40 sequences
    for step in (4, 8):
        by_source = {n: rows[step][f"val_loss/{n}"] for n in WEIGHTS}
        assert by_source["web"] != by_source["code"]
        weighted = sum(WEIGHTS[n] * v for n, v in by_source.items())
        assert rows[step]["val_loss"] == pytest.approx(weighted, rel=1e-12)
    assert "val_loss/web" not in rows[2]
    first = run(data_dir, src, tmp_path / "b", "train.exit_at_step=4").fit()
    resumed = run(data_dir, src, tmp_path / "b").fit()
    assert first.steps == 4 and resumed.start_step == 4
    for step in (6, 8):
        assert resumed.losses[step] == straight.losses[step], step
    assert resumed.val_losses[8] == straight.val_losses[8]


def test_a_weight_the_interleave_rounds_away_is_said(mixture, tmp_path):
    """A mixture's shares are whole sequences of each 4,096: a weight of 1e-4 read 2.4 times its
    share (one sequence a period), without a word."""
    data_dir, src = mixture
    tiny = sources_override(src, {"web": 1.0, "code": 1e-4})
    with logged() as lines:
        run(data_dir, src, tmp_path / "a", tiny)
    said = "data.sources[1] (name code): its share 0.0001 is read as 0.000244 (1 sequence in each"
    assert said in lines.text and "give it a weight of at least 0.0244 of the total" in lines.text
    assert "(name web)" not in lines.text
    with logged() as lines:
        run(data_dir, src, tmp_path / "b")
    assert "is read as" not in lines.text


def test_a_changed_source_is_prepared_alone(tmp_path):
    src = {"web": corpus(tmp_path / "web", "web", 0), "code": corpus(tmp_path / "code", "code", 1)}
    cfg = mixture_config(tmp_path / "data", src)
    prepare(cfg)
    web_before = snapshot(tmp_path / "data" / "web")
    (src["code"] / "000.txt").write_text("a new first document of code")
    with logged() as lines:
        prepare(cfg)
    assert snapshot(tmp_path / "data" / "web") == web_before
    assert any("data/web is up to date" in x for x in lines)
    assert any(x.startswith("data: tokenized") for x in lines)  # code, re-encoded
    recorded = json.loads((tmp_path / "data" / "mixture.json").read_text())["sources"]
    manifest = json.loads((tmp_path / "data" / "code" / "manifest.json").read_text())
    assert recorded["code"]["fingerprint"] == manifest["fingerprint"]
    assert recorded["code"]["train_tokens"] == manifest["splits"]["train"]["tokens"]


def test_a_new_tokenizer_replaces_the_data_only_once_every_source_is_built(tmp_path, logs):
    """A mixture prepared again with another tokenizer (vocab_size changed) whose second source
    fails past the tokenizer's sample: the tokenizer had been replaced in place and mixture.json
    emptied, so the previous data trained no more. Now data.dir keeps the previous data whole and
    trainable; the next prepare reuses the new tokenizer and the first source's build."""
    src = {"web": corpus(tmp_path / "web", "web", 0), "code": corpus(tmp_path / "code", "code", 1)}
    cfg = mixture_config(tmp_path / "data", src)
    prepare(cfg)
    before = {
        name: snapshot(tmp_path / "data" / name) for name in ("web", "code", "tokenizer.model")
    } | {"mixture.json": (tmp_path / "data" / "mixture.json").read_bytes()}
    bad = src["code"] / "zzz.jsonl"  # read last: past the tokenizer's sample
    bad.write_text(json.dumps({"text": 5}) + "\n")
    larger = prep_config(
        "builtin",
        tmp_path / "data",
        sources_override(src),
        "model.vocab_size=420",
        "data.tokenizer_sample_bytes=20000",  # (code's first files)
    )
    with logged() as lines, pytest.raises(UserError, match=r"data.sources\[1\] \(name code\)"):
        prepare(larger)
    assert any("trained a 420-piece" in line for line in lines)  # (past the tokenizer)
    for name in ("web", "code", "tokenizer.model"):  # (builds aside: in .prepare-build)
        now = snapshot(tmp_path / "data" / name)
        assert {k: v for k, v in now.items() if ".prepare-build" not in k} == before[name]
    record = json.loads((tmp_path / "data" / "mixture.json").read_text())
    assert {k: v for k, v in record.items() if k != "next"} == json.loads(before["mixture.json"])
    assert run(tmp_path / "data", src, tmp_path / "runs", "train.max_steps=2").fit().steps == 2
    # the launchers' prepare for that run keeps its tokenizer: refused, the next one found or not
    kept = Kept(record["tokenizer"]["sha256"], tmp_path / "runs" / "test" / "checkpoints")
    with pytest.raises(UserError, match="would be rebuilt with another tokenizer"):
        prepare(larger, keep=kept)
    bad.unlink()
    logs.clear()
    prepare(larger)
    assert not any("trained a" in line for line in logs)  # the new one, reused
    assert any("data/web is up to date" in line for line in logs)  # its build, published
    after = json.loads((tmp_path / "data" / "mixture.json").read_text())
    assert "next" not in after and set(after["sources"]) == {"web", "code"}
    assert after["tokenizer"]["sha256"] != record["tokenizer"]["sha256"]
    assert not (tmp_path / "data" / ".next-tokenizer").exists()
    assert not list((tmp_path / "data").glob("*/.prepare-build"))
    assert run(
        tmp_path / "data", src, tmp_path / "runs2", "train.max_steps=2", "model.vocab_size=420"
    ).fit()
    # a rebuild stopped, then the settings data.dir holds back: its tokenizer and builds go
    bad.write_text(json.dumps({"text": 5}) + "\n")
    other = dataclasses.replace(larger, model=dataclasses.replace(larger.model, vocab_size=440))
    with pytest.raises(UserError):
        prepare(other)
    stopped = snapshot(tmp_path / "data")
    assert {k for k in stopped if k == ".next-tokenizer" or k.startswith("web/.prepare-build/")}
    bad.unlink()
    prepare(larger)
    left = {k for k in snapshot(tmp_path / "data") if "next" in k or ".prepare-build" in k}
    assert left == set()
    assert "next" not in json.loads((tmp_path / "data" / "mixture.json").read_text())


def test_a_mixture_prepare_stopped_at_any_write_is_finished_by_the_next(tmp_path, monkeypatch):
    """A stop at each write of mixture.json (a first prepare of a new data.dir, and a rebuild
    with a new tokenizer): the next prepare finishes the data, trainable, with nothing left over.
    A first prepare stopped while building its sources left a mixture.json that prepare and
    train then called edited by hand; --force re-encoded into build folders it never published."""
    import shutil

    from scale_llm.data import mixture as mixture_mod

    src = {"web": corpus(tmp_path / "web", "web", 0), "code": corpus(tmp_path / "code", "code", 1)}
    base = tmp_path / "base"
    prepare(mixture_config(base, src))
    real_write = mixture_mod.atomic_write_json

    def stopped_at(k: int):
        calls = []

        def write(path, obj):
            calls.append(path)
            if len(calls) == k:
                raise KeyboardInterrupt
            return real_write(path, obj)

        return write

    for first, vocab in ((True, 400), (False, 420)):
        for k in range(1, 9):
            data = tmp_path / f"{first}-{k}"
            if not first:
                shutil.copytree(base, data)
            cfg = prep_config("builtin", data, sources_override(src), f"model.vocab_size={vocab}")
            monkeypatch.setattr(mixture_mod, "atomic_write_json", stopped_at(k))
            with contextlib.suppress(KeyboardInterrupt):
                prepare(cfg)
            monkeypatch.setattr(mixture_mod, "atomic_write_json", real_write)
            prepare(cfg)
            record = json.loads((data / "mixture.json").read_text())
            assert set(record["sources"]) == {"web", "code"} and "next" not in record, (first, k)
            names = {p.name for p in data.iterdir()} - {".prepare.lock"}
            assert names == {"code", "mixture.json", "tokenizer.model", "web"}, (first, k, names)
            assert not list(data.glob("*/.prepare-build")), (first, k)
            windows = mixture_mod.open_training_data(
                make_config(
                    data, tmp_path / "runs", sources_override(src), f"model.vocab_size={vocab}"
                )
            )
            assert windows.val, (first, k)
    # the launchers' prepare for a run trained before a rebuild stopped past the tokenizer's
    # move: "restore the input or settings" could not help; it says what happened instead
    data = tmp_path / "moved"
    shutil.copytree(base, data)
    kept = Kept(json.loads((data / "mixture.json").read_text())["tokenizer"]["sha256"], data / "c")
    stops = {"n": 0}

    def stop_after_the_move(path, obj):  # (the adoption's last write: the tokenizer moved)
        if "next" not in obj and obj.get("sources") == {} and stops["n"] == 1:
            raise KeyboardInterrupt
        stops["n"] += "next" in obj and obj.get("sources") == {}
        return real_write(path, obj)

    monkeypatch.setattr(mixture_mod, "atomic_write_json", stop_after_the_move)
    with pytest.raises(KeyboardInterrupt):
        prepare(prep_config("builtin", data, sources_override(src), "model.vocab_size=420"))
    monkeypatch.setattr(mixture_mod, "atomic_write_json", real_write)
    with pytest.raises(UserError, match="no longer holds the tokenizer .* was trained with: a"):
        prepare(mixture_config(data, src), keep=kept)
    # --force: every source encoded and published again
    data = tmp_path / "forced"
    shutil.copytree(base, data)
    with logged() as lines:
        prepare(mixture_config(data, src), force=True)
    assert sum("finishing the publication" in line for line in lines) == 2, lines.text
    assert not list(data.glob("*/.prepare-build"))
    # a stop while a tokenizer of the other kind (data.tokenizer's) took the place of the old:
    # the file under its new name is the one mixture.json's next record names, not a stranger's
    record = json.loads((data / "mixture.json").read_text())
    record["next"] = {**record["tokenizer"], "file": "hf-tokenizer.json"}
    (data / "mixture.json").write_text(json.dumps(record))
    (data / "tokenizer.model").rename(data / "hf-tokenizer.json")
    assert mixture_mod._claim(data, ["web", "code"])["next"] == record["next"]
    # the settings of the old kind back: that file goes with the record that named it (it was
    # left named by none, and every later prepare refused it)
    for _ in range(2):
        prepare(mixture_config(data, src))
    assert sorted(p.name for p in data.iterdir() if "tokenizer" in p.name) == ["tokenizer.model"]


def test_bad_mixtures_exit_2_naming_each_problem_and_writing_nothing(tmp_path, capsys):
    good = corpus(tmp_path / "good", "doc", 0, n=8)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.jsonl").write_text('{"text": ""}\n{"text": " "}\n')
    bad = "[{name: a, weight: 0, colour: red}, {name: a, source: 'x'}, {name: b/c}]"
    cases = {
        "config": (
            [f"data.sources={bad}", "data.hf_split=test"],
            [
                "data.sources[0].colour: unknown key",
                "data.sources[0].weight=0.0 must be > 0",
                "data.sources[1].name='a' is used twice",
                "data.sources[2].name='b/c' must be 1-64 letters",
                "give it per entry (data.sources[i].hf_split)",
            ],
        ),
        "no documents": (
            [sources_override({"web": good, "code": empty})],
            ["data.sources[1] (name code)", "too few non-empty documents"],
        ),
        "two sources without documents (the first alone was named)": (
            [sources_override({"web": empty, "code": empty}, {"web": 0.5, "code": 0.5})],
            ["2 sources of the mixture cannot be prepared:\n  - data.sources[0] (name web)"]
            + ["\n  - data.sources[1] (name code): "],
        ),
        "a vocabulary too small": (
            [sources_override({"web": good}, {"web": 1}), "model.vocab_size=100"],
            ["set model.vocab_size to at least"],
        ),
    }
    for case, (overrides, said) in cases.items():
        before = snapshot(tmp_path)
        argv = [
            "prepare",
            "--set",
            f"data.dir={tmp_path / 'data'}",
            "--set",
            "model.vocab_size=400",
        ]
        code = main(argv + [a for o in overrides for a in ("--set", o)])
        err = capsys.readouterr().err
        assert code == 2, case
        assert "Traceback" not in err
        for text in said:
            assert text in err, (case, text, err)
        assert snapshot(tmp_path) == before, case  # nothing written (no data.dir made)


def test_repeat_false_refuses_a_run_that_would_read_a_source_twice(mixture, tmp_path):
    from scale_llm.errors import UserError

    data_dir, src = mixture
    with pytest.raises(UserError, match=r"data.repeat=false.*code: \d+\.\d+ epochs"):
        run(data_dir, src, tmp_path, "train.max_steps=2000", "data.repeat=false")


def test_a_source_folder_that_holds_other_data_is_refused_untouched(tmp_path, capsys):
    """data.dir/<name> that this data.dir's mixture.json does not list as a source (a one-source
    data folder, a file) is named with the fix, and nothing in data.dir changes."""
    src = {"one": corpus(tmp_path / "a", "aa", 0, n=8), "two": corpus(tmp_path / "b", "bb", 1, n=8)}
    data = tmp_path / "data"
    argv = ["prepare", "--set", "model.vocab_size=400", "--set"]
    assert main([*argv, f"data.source={src['one']}", "--set", f"data.dir={data / 'one'}"]) == 0
    (data / "two").write_text("not a source folder")
    before = snapshot(data)
    capsys.readouterr()
    code = main([*argv, f"data.dir={data}", "--set", sources_override(src, {"one": 1, "two": 1})])
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for text in (f"{data / 'one'}", f"{data / 'two'}", "Point data.dir at a new folder"):
        assert text in err, (text, err)
    assert snapshot(data) == before
    # prepare's own source folders are continued, even before their sources are recorded (a
    # prepare stopped while re-encoding them)
    (data / "one").rename(tmp_path / "one")
    (data / "two").unlink()
    cfg = mixture_config(data, src, {"one": 1, "two": 1})
    prepare(cfg)
    record = json.loads((data / "mixture.json").read_text())
    assert record["folders"] == ["one", "two"]
    (data / "mixture.json").write_text(json.dumps({**record, "sources": {}}))
    assert set(prepare(cfg)["sources"]) == {"one", "two"}


def test_a_source_too_small_for_one_window_is_named_before_any_run_work(tmp_path):
    from scale_llm.errors import UserError

    """Source code has validation windows of model.seq_len=256 but no training window (its one
    validation document, 7.txt by its id's hash, is the long one); web has both."""
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    for i, text in enumerate(random_texts(8, "t{i}", seed=2, length=4)):
        (tiny / f"{i}.txt").write_text(text * (40 if i == 7 else 1))
    src = {"web": corpus(tmp_path / "web", "web", 0, n=8), "code": tiny}
    splits = prepare(mixture_config(tmp_path / "data", src))["sources"]["code"]
    assert splits["train_tokens"] < 257 <= splits["val_tokens"]
    with pytest.raises(UserError) as refused:
        run(tmp_path / "data", src, tmp_path / "runs", "model.seq_len=256")
    said = str(refused.value)
    assert "data.sources[1] (name code)" in said and "web" not in said, said
    assert f"{splits['train_tokens']} training tokens (0 windows)" in said, said
    assert "model.seq_len=256" in said, said
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------- config ergonomics
def weights_config(weights: tuple[float, ...]):
    from scale_llm.config import load_config

    entries = ", ".join(f"{{name: s{i}, weight: {w!r}}}" for i, w in enumerate(weights))
    return load_config(None, [f"data.sources=[{entries}]"])


def test_huge_tiny_and_mixed_weights_read_as_their_scaled_down_equivalents():
    """Weights are shares: 1e308, 1e308 (whose sum overflows) train as 1, 1, and 3e307, 7e307
    as 0.3, 0.7, in the config's shares, the interleave of sources and the batches read."""
    from scale_llm.config.data import mixture_weights

    same = {
        (1e308, 1e308): (1, 1),
        (3e307, 7e307): (0.3, 0.7),
        (1.5e308, 1.5e308, 1e-300): (1, 1, 1e-20),
        (1e-308, 1e-308): (1, 1),
        (3e-320, 7e-320): (0.3, 0.7),
    }
    for big, small in same.items():
        shares = [mixture_weights(weights_config(w).data) for w in (big, small)]
        assert shares[0] == pytest.approx(shares[1], rel=1e-12, abs=1e-15), (big, shares)
        counts = [SourceSchedule(list(w)).counts.tolist() for w in (big, small)]
        assert counts[0] == counts[1] and sum(counts[0]) == PERIOD, (big, counts)
        size = 100  # windows per source
        loaders = [
            TrainLoader(
                TokenWindows([np.arange(size * 8 * len(big) + 1, dtype=np.int64)], 8),
                batch_plan(4, 1),
                seed=0,
                sources={n: (w, size) for n, w in share.items()},
            )
            for share in shares
        ]
        for _ in range(5):
            a, b = (loader.next_batches()[0][0] for loader in loaders)
            assert torch.equal(a, b), big


def test_a_mixture_record_nested_100000_deep_is_refused_naming_it(tmp_path, capsys):
    """mixture.json is read by the one JSON reader: bounded nesting, one paragraph naming the
    file (a RecursionError before), nothing written."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "mixture.json").write_text("[" * 100_000 + "]" * 100_000)
    src = {"web": corpus(tmp_path / "web", "web", 0, n=8)}
    before = snapshot(tmp_path)
    argv = ["prepare", "--set", "model.vocab_size=400", "--set", f"data.dir={data}"]
    assert main([*argv, "--set", sources_override(src, {"web": 1})]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{data / 'mixture.json'}" in err, err
    assert "nested deeper than 64 levels" in err, err
    assert snapshot(tmp_path) == before


def test_eval_perplexity_of_a_mixture_scores_each_source_as_training_does(
    mixture, tmp_path, capsys
):
    """`eval --perplexity DATA_DIR` of a mixture's data dir: each source's loss on its first
    windows, as training's val_loss/<name> at the same step, and their mean by the run's
    weights (its val_loss); a run of one source weighs the sources by their windows."""
    data_dir, src = mixture
    trained = run(data_dir, src, tmp_path / "runs").fit()
    rows = [json.loads(line) for line in (trained.run_dir / "metrics.jsonl").open()]
    last = next(r for r in reversed(rows) if "val_loss" in r)
    argv = ["eval", str(trained.run_dir), "--perplexity", str(data_dir), "--limit", "5"]
    assert main([*argv, "--batch-size", "5"]) == 0  # eval.steps=1 batch of 5 sequences
    out = capsys.readouterr().out
    assert "weighted by the run's data.sources weights" in out and "    code: loss" in out, out
    record = json.loads((trained.run_dir / "eval" / "step_00000008.json").read_text())
    ppl = record["perplexity"]
    for name in WEIGHTS:
        assert ppl["sources"][name]["loss"] == pytest.approx(last[f"val_loss/{name}"], rel=1e-5)
        assert ppl["sources"][name]["weight"] == pytest.approx(WEIGHTS[name])
    assert ppl["loss"] == pytest.approx(last["val_loss"], rel=1e-5)
    one = make_config(
        data_dir / "web", tmp_path / "one", "model.vocab_size=400", "train.max_steps=1"
    )
    one = trainer_for(one).fit()  # a run of one source, the mixture's tokenizer
    assert main(["eval", str(one.run_dir), "--perplexity", str(data_dir)]) == 0
    ppl = json.loads(next((one.run_dir / "eval").glob("*.json")).read_text())["perplexity"]
    windows = {n: s["windows"] for n, s in ppl["sources"].items()}
    assert set(windows) == set(WEIGHTS) and ppl["weighted_by"] == "validation windows"
    pooled = sum(s["loss"] * s["windows"] for s in ppl["sources"].values()) / sum(windows.values())
    assert ppl["loss"] == pytest.approx(pooled, rel=1e-12)


def test_a_run_on_data_prepared_from_other_sources_says_so(
    mixture, data_dir, corpus_dir, tmp_path, logs
):
    """A source edited in the config without a new `prepare`: the run trained on what data.dir
    was prepared from, and said nothing (its config.yaml names the other source)."""
    from tests.helpers import make_config

    mix_dir, src = mixture
    run(mix_dir, src, tmp_path / "a")  # as prepared (the same folders)
    trainer_for(make_config(data_dir, tmp_path / "b", f"data.source={corpus_dir}/"))
    assert "was prepared from" not in logs.text
    moved = {"web": src["web"], "code": tmp_path / "elsewhere"}
    run(mix_dir, moved, tmp_path / "c")
    said = f"data.sources[1].source={short(str(tmp_path / 'elsewhere'))}, but data.dir={mix_dir} "
    assert said + f"was prepared from {short(str(src['code']))} (its manifest)" in logs.text
    assert "data.sources[0]" not in logs.text
    trainer_for(make_config(data_dir, tmp_path / "d", "data.source=/corpus/*.txt"))
    assert f"data.source='/corpus/*.txt', but data.dir={data_dir} was prepared from" in logs.text


def test_a_resume_on_data_prepared_again_says_its_batches_changed(tmp_path, logs):
    """Two files of a source swapped and prepared again (the mixture keeps its tokenizer): the
    same windows in another order, and the resume read them without a word."""
    src = {"web": corpus(tmp_path / "web", "web", 0), "code": corpus(tmp_path / "code", "code", 1)}
    data = tmp_path / "data"
    prepare(mixture_config(data, src))
    run(data, src, tmp_path / "runs", "train.max_steps=4").fit()
    run(data, src, tmp_path / "runs")  # (the same data: nothing said)
    os.utime(src["code"] / "000.txt", (1, 1))  # prepared again, to the same shards
    prepare(mixture_config(data, src))
    run(data, src, tmp_path / "runs")
    assert "shards changed" not in logs.text
    first, second = src["code"] / "000.txt", src["code"] / "001.txt"
    texts = first.read_text(), second.read_text()
    first.write_text(texts[1])
    second.write_text(texts[0])
    prepare(mixture_config(data, src))
    run(data, src, tmp_path / "runs")
    assert "resume: data.dir's shards changed since the checkpoint" in logs.text


def test_a_checkpoint_without_the_shards_digest_compares_prepares_fingerprints():
    """Shards a prepare did not hash (data, or a checkpoint, written before it did): the resume
    compares what prepare was given instead, so a changed source is still said."""
    from scale_llm.train.resume import data_change

    old = {"data_fingerprint": "f1"}
    assert data_change(old, "f1", "") is None and data_change(old, "f1", "s1") is None
    assert "shards changed" in data_change(old, "f2", "s1")
    new = {"data_fingerprint": "f1", "data_shards": "s1"}
    assert data_change(new, "f2", "s1") is None  # (touched files, the same shards)
    assert "shards changed" in data_change(new, "f1", "s2")
    assert data_change({}, "f1", "s1") is None  # (a checkpoint from before either)


def test_the_tokens_no_window_reads_at_shard_ends_are_said(tmp_path):
    """Windows of seq_len + 1 tokens never cross shards: shards of 64 tokens at seq_len 32 leave
    31 of each unread (about half the data, without a word); shards of 65 leave none."""
    from scale_llm.train.preflight import preflight

    src = corpus(tmp_path / "src", "doc", 0)
    for shard_tokens, said in ((64, True), (65, False)):
        data = tmp_path / f"data{shard_tokens}"
        prepare(prep_config(src, data, f"data.shard_tokens={shard_tokens}", "model.seq_len=32"))
        cfg = make_config(data, tmp_path / "runs", "model.vocab_size=400")
        with logged() as lines:
            preflight(cfg, plan_for(cfg))
        assert (
            "the last (length - 1) mod seq_len tokens of each shard are never read" in lines.text
        ) == said
        assert ("of data.dir's finished shards (48.4%)" in lines.text) == said
