"""Data: tokenizer round trip, preparation (split, idempotence, interrupted builds), batch layout.
(Bad sources, damaged shards and a vocab the corpus cannot fill: tests/test_errors.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from scale_llm.data import prepare_source as prepare_mod
from scale_llm.data.loader import TokenWindows, TrainLoader, eval_batches
from scale_llm.data.prepare import prepare
from scale_llm.data.shards import open_split, read_manifest
from scale_llm.data.tokenizer import Tokenizer
from scale_llm.errors import UserError
from tests.helpers import batch_plan, prep_config, random_texts

CPU = torch.device("cpu")


def marker_corpus(tmp_path, n=24):
    """Documents that each carry a unique marker word, so splits can be checked by decoding."""
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:
        for i, body in enumerate(random_texts(n, "doc{i:03d}marker")):
            f.write(json.dumps({"text": body, "meta": i}) + "\n")
    return path


def test_tokenizer_round_trips_code_and_unicode(tmp_path, data_dir):
    tok = Tokenizer(data_dir / "tokenizer.model")
    text = (
        "def f(x):\n\tif x:\n        return {'k': [1, 2]}  # ok\n\n\n"
        "    s = 'naïve café ☕ 日本語'\r\n"
    )
    ids = tok.encode(text, bos=True)
    assert ids[0] == tok.bos_id
    assert tok.decode(ids) == text
    assert max(ids) < tok.vocab_size
    # the one exception docs/data.md names: SentencePiece's own mark for a space
    assert tok.decode(tok.encode("a\u2581b")) == "a b"


def test_prepare_splits_by_document_and_writes_manifest(tmp_path):
    out = tmp_path / "data"
    manifest = prepare(prep_config(marker_corpus(tmp_path), out))
    tok = Tokenizer(out / "tokenizer.model")
    texts = {}
    for split in ("train", "val"):
        tokens = np.concatenate(open_split(out, manifest, split))
        texts[split] = tok.decode(tokens.tolist())
        assert manifest["splits"][split]["tokens"] == len(tokens)
        assert (tokens == tok.eos_id).sum() == manifest["splits"][split]["documents"]
    train_docs = {m for m in range(24) if f"doc{m:03d}marker" in texts["train"]}
    val_docs = {m for m in range(24) if f"doc{m:03d}marker" in texts["val"]}
    assert val_docs and train_docs
    assert not train_docs & val_docs  # disjoint by document
    assert train_docs | val_docs == set(range(24))
    assert manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["vocab_size"] == 400
    assert len(manifest["tokenizer"]["sha256"]) == 64


def test_prepare_is_idempotent_and_redoes_work_when_input_changes(tmp_path, monkeypatch):
    corpus = marker_corpus(tmp_path)
    out = tmp_path / "data"
    first = prepare(prep_config(corpus, out))
    stamp = (out / "train_00000.bin").stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("prepare retrained the tokenizer on unchanged input")

    monkeypatch.setattr(prepare_mod, "train_tokenizer", boom)
    assert prepare(prep_config(corpus, out)) == first
    assert (out / "train_00000.bin").stat().st_mtime_ns == stamp
    monkeypatch.undo()

    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "one more document " * 20}) + "\n")
    second = prepare(prep_config(corpus, out))
    assert second["fingerprint"] != first["fingerprint"]
    assert sum(s["documents"] for s in second["splits"].values()) == 25


def test_the_same_corpus_in_another_place_gives_the_same_shards(tmp_path):
    """The val split hashes document names relative to the corpus, not absolute paths."""
    texts = random_texts(12, "file{i:02d}marker", length=150)
    shards = {}
    for place in ("a", "b/deeper"):
        corpus = tmp_path / place / "corpus"
        corpus.mkdir(parents=True)
        for i, text in enumerate(texts):  # a directory of files: each file is a document
            (corpus / f"f{i:02d}.txt").write_text(text)
        out = tmp_path / place / "data"
        prepare(prep_config(corpus, out, "data.val_fraction=0.3"))
        shards[place] = [(out / f).read_bytes() for f in ("train_00000.bin", "val_00000.bin")]
    assert shards["a"] == shards["b/deeper"]


def test_a_file_added_below_a_globs_folder_leaves_the_split_of_the_others(tmp_path):
    """Documents of a glob were named relative to the matched files' common folder, which moves
    when a file lands in another subfolder: a third of the training documents became validation
    documents (a resumed run had trained on them). The glob's folder before its wildcard names
    them now."""
    texts = random_texts(21, "file{i:02d}marker", length=150)
    (tmp_path / "c" / "x").mkdir(parents=True)
    for i, text in enumerate(texts[:20]):
        (tmp_path / "c" / "x" / f"f{i:02d}.txt").write_text(text)
    out = tmp_path / "data"
    splits = []
    for step in range(2):
        if step:
            (tmp_path / "c" / "y").mkdir()
            (tmp_path / "c" / "y" / "new.txt").write_text(texts[20])
        manifest = prepare(prep_config(f"{tmp_path}/c/**/*.txt", out, "data.val_fraction=0.3"))
        tok = Tokenizer(out / "tokenizer.model")
        val = tok.decode(np.concatenate(open_split(out, manifest, "val")).tolist())
        splits.append({i for i in range(20) if f"file{i:02d}marker" in val})
    assert splits[0] and splits[0] == splits[1]


def test_shards_are_split_at_the_configured_size(tmp_path):
    out = tmp_path / "data"
    manifest = prepare(prep_config(marker_corpus(tmp_path), out, "data.shard_tokens=1000"))
    shards = manifest["splits"]["train"]["shards"]
    assert len(shards) > 1
    assert all(s["tokens"] == 1000 for s in shards[:-1])


def test_a_failed_or_interrupted_prepare_leaves_the_good_data_untouched(tmp_path, monkeypatch):
    """Issue 14: prepare deleted the manifest and shards before building the new ones. It now
    builds in data.dir/.prepare-build/ and publishes only a complete build; until then the
    previous data reads exactly as before (and never as the new, half-done data)."""
    corpus = marker_corpus(tmp_path)
    out = tmp_path / "data"
    before = prepare(prep_config(corpus, out))
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "changed " * 30}) + "\n")

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_mod, "_write", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare(prep_config(corpus, out))
    assert read_manifest(out) == before  # the good data is still there, unchanged
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == files
    assert (out / ".prepare-build" / "progress.json").is_file()
    with open(corpus, "a") as f:  # a source that fails half-way: the same
        f.write("{not json\n")
    monkeypatch.undo()
    with pytest.raises(UserError, match=r"\.jsonl:\d+ is not valid JSON"):
        prepare(prep_config(corpus, out))
    assert read_manifest(out) == before
    lines = corpus.read_text().splitlines()[:-1]
    corpus.write_text("\n".join(lines) + "\n")
    after = prepare(prep_config(corpus, out))  # fixed: the new data is published
    assert after["fingerprint"] != before["fingerprint"] and read_manifest(out) == after
    assert not (out / ".prepare-build").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(files)  # no stray files


def test_a_prepare_killed_while_publishing_is_finished_by_the_next(tmp_path, monkeypatch):
    corpus = marker_corpus(tmp_path)
    out = tmp_path / "data"
    prepare(prep_config(corpus, out))
    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "changed " * 30}) + "\n")
    real = prepare_mod._publish

    def die_midway(build, dest):  # as _publish: the old manifest kept in the build, then gone
        (build / prepare_mod.PREVIOUS).write_bytes((dest / "manifest.json").read_bytes())
        (dest / "manifest.json").unlink()  # the old data is already half gone...
        raise KeyboardInterrupt  # ...and the process is killed

    monkeypatch.setattr(prepare_mod, "_publish", die_midway)
    with pytest.raises(KeyboardInterrupt):
        prepare(prep_config(corpus, out))
    monkeypatch.setattr(prepare_mod, "_publish", real)
    assert (out / ".prepare-build" / "manifest.json").is_file()
    encoded = []
    monkeypatch.setattr(prepare_mod, "_write", lambda *a: encoded.append(1))
    manifest = prepare(prep_config(corpus, out))  # publishes the complete build, encodes nothing
    assert encoded == [] and read_manifest(out) == manifest
    assert not (out / ".prepare-build").exists()


def test_text_field_selects_the_jsonl_field(tmp_path):
    src = tmp_path / "c.jsonl"
    rows = [json.loads(line) for line in marker_corpus(tmp_path).read_text().splitlines()]
    src.write_text("".join(json.dumps({"body": r["text"]}) + "\n" for r in rows))
    manifest = prepare(prep_config(src, tmp_path / "d", "data.text_field=body"))
    assert sum(s["documents"] for s in manifest["splits"].values()) == 24


# ----------------------------------------------------------------------------- loader


def windows_from(n_tokens=5000, seq_len=8, shards=2):
    data = np.arange(n_tokens, dtype=np.uint16)
    return TokenWindows(np.array_split(data, shards), seq_len)


def loader(windows, mb, accum, world=1, rank=0, seed=0):
    return TrainLoader(windows, batch_plan(mb, accum, world, rank), seed)


def rows(batches):
    return {tuple(x.tolist()) for pair in batches for x in pair[0]}


def test_windows_hold_inputs_and_shifted_targets():
    w = windows_from()
    x, y = loader(w, 2, 1).next_batches()[0]
    assert x.shape == y.shape == (2, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:, -1], x[:, -1] + 1)


def test_global_batch_does_not_depend_on_micro_batch_accumulation_or_ranks():
    w = windows_from()
    big = loader(w, 8, 1)
    accum = loader(w, 2, 4)
    ranks = [loader(w, 2, 2, world=2, rank=r) for r in (0, 1)]
    for _ in range(5):
        a = big.next_batches()
        b = accum.next_batches()
        r0, r1 = (ld.next_batches() for ld in ranks)
        assert rows(a) == rows(b) == rows(r0) | rows(r1)
        assert not rows(r0) & rows(r1)  # ranks read disjoint sequences
        assert len(rows(a)) == 8
        # same order too: concatenating the micro-batches gives the big batch
        assert torch.equal(torch.cat([x for x, _ in b]), a[0][0])


def test_loader_state_resumes_with_the_exact_next_batch():
    w = windows_from()
    a = loader(w, 4, 2, seed=7)
    for _ in range(3):
        a.next_batches()
    state = a.state_dict()
    expected = a.next_batches()
    b = loader(w, 4, 2, seed=7)
    b.load_state_dict(state)
    got = b.next_batches()
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(expected, got))


def test_epochs_visit_every_window_once_in_a_new_order():
    w = windows_from(n_tokens=8 * 16 + 1, shards=1)  # exactly 16 windows
    ld = loader(w, 4, 1, seed=3)
    epoch0 = [r for _ in range(4) for r in rows(ld.next_batches())]
    epoch1 = [r for _ in range(4) for r in rows(ld.next_batches())]
    assert len(set(epoch0)) == len(set(epoch1)) == 16
    assert set(epoch0) == set(epoch1)
    assert epoch0 != epoch1


def test_eval_batches_are_fixed_and_independent_of_the_layout():
    w = windows_from()

    def seqs(mb, accum, world, rank):
        return [
            tuple(x.tolist())
            for b, _, _ in eval_batches(w, batch_plan(mb, accum, world, rank), 3)
            for x in b
        ]

    first = seqs(8, 1, 1, 0)
    assert seqs(8, 1, 1, 0) == first  # the same windows at every evaluation
    split = seqs(2, 2, 2, 0) + seqs(2, 2, 2, 1)
    assert sorted(split) == sorted(first)  # same set whatever the micro-batch / accum / world
    assert not set(seqs(2, 2, 2, 0)) & set(seqs(2, 2, 2, 1))  # ranks read disjoint windows


def test_builtin_source_is_the_standard_library_in_fixed_order():
    from scale_llm.data.sources import builtin_source

    src = builtin_source()
    names = [f.relative_to(src.root).as_posix() for f in src.files]
    assert names == sorted(names)
    assert "os.py" in names and not any("site-packages" in n for n in names)
    assert src.total_bytes() > 10_000_000
    assert src.fingerprint() == builtin_source().fingerprint()


def test_the_tokenizer_file_is_the_same_on_machines_of_any_core_count(tmp_path, monkeypatch):
    """SentencePiece writes the threads it trained with into the model: a prepare --force on a
    machine of another core count made another SHA-256, and the run's resume was refused."""
    from scale_llm.data.tokenizer import train_tokenizer

    texts = random_texts(200, "doc{i:03d}", length=200)
    made = []
    for cores in (1, 2, 7):
        monkeypatch.setattr("os.cpu_count", lambda cores=cores: cores)
        train_tokenizer(texts, 400, tmp_path / f"{cores}.model")
        made.append((tmp_path / f"{cores}.model").read_bytes())
    assert made[0] == made[1] == made[2]
    assert Tokenizer(tmp_path / "7.model").vocab_size == 400


def test_a_file_named_with_wildcard_characters_is_named_from_its_folder(tmp_path, monkeypatch):
    """A literal file whose folder's name holds [ ] (data[1]/c.jsonl) was read as a glob with no
    fixed folder: its documents were named from the working folder."""
    from scale_llm.data.sources import local_source

    (tmp_path / "data[1]").mkdir()
    (tmp_path / "data[1]" / "c.jsonl").write_text('{"text": "a document"}\n')
    monkeypatch.chdir(tmp_path)
    assert local_source("data[1]/c.jsonl", "text").root == tmp_path / "data[1]"
    assert local_source(f"{tmp_path}/data?1?/*.jsonl", "text").root == tmp_path
