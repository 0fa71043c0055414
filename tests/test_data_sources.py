"""Sources: local .jsonl / .parquet, Hugging Face datasets offline, caps, and bad input."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from scale_llm.config import load_config
from scale_llm.config.data import unread_hf_keys
from scale_llm.data.prepare import prepare
from scale_llm.data.shards import open_split
from scale_llm.data.sources import open_source
from scale_llm.data.tokenizer import Tokenizer
from scale_llm.errors import UserError
from tests.helpers import prep_config, random_texts


def records(n=30, seed=0):
    """Documents that each carry a unique marker word, so they can be found after decoding."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 5)) for _ in range(300)]
    return [
        {"text": f"doc{i:03d}marker " + " ".join(rng.choice(words, 100)), "id": i} for i in range(n)
    ]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    return path


def config(source, out, *extra):
    return prep_config(source, out, "data.val_fraction=0.2", "data.num_proc=1", *extra)


def decoded_markers(out, manifest):
    tok = Tokenizer(out / "tokenizer.model")
    text = "".join(
        tok.decode(np.concatenate(open_split(out, manifest, s)).tolist()) for s in ("train", "val")
    )
    return {i for i in range(100) if f"doc{i:03d}marker" in text}


def test_hf_only_keys_beside_a_local_source_are_said_not_read(tmp_path, caplog):
    """A base file's Hub source replaced by local files leaves its hf: keys unread: said."""
    src = write_jsonl(tmp_path / "c.jsonl", records())
    extra = ("data.hf_config=sample-10BT", "data.streaming=true")
    with caplog.at_level("WARNING", logger="scale_llm"):
        manifest = prepare(config(src, tmp_path / "a", *extra))
    assert sum(s["documents"] for s in manifest["splits"].values()) == 30
    said = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert said == [
        "data: data.hf_config='sample-10BT', data.streaming=true are not read: "
        f"data.source='{src}' is not an hf: dataset (unset them with null to silence this)"
    ]
    mix = "data.sources=[{name: a, source: builtin, hf_split: test}, {name: b, source: 'hf:x'}]"
    assert unread_hf_keys(load_config(None, [mix, "data.hf_split=null"]).data) == [
        "data.sources[0].hf_split='test' is not read: data.sources[0].source='builtin' is not "
        "an hf: dataset (remove it from the entry to silence this)"
    ]
    assert unread_hf_keys(load_config(None, ["data.source=hf:x", *extra]).data) == []


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Keep the Arrow cache `datasets` writes for non-streamed datasets inside tmp_path."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def test_local_parquet_and_jsonl_give_the_same_documents(tmp_path):
    rows = records()
    a = prepare(config(write_parquet(tmp_path / "p" / "c.parquet", rows), tmp_path / "a"))
    b = prepare(config(write_jsonl(tmp_path / "j" / "c.jsonl", rows), tmp_path / "b"))
    assert sum(s["documents"] for s in a["splits"].values()) == 30
    assert decoded_markers(tmp_path / "a", a) == set(range(30))
    # a glob over several parquet files, in sorted order
    write_parquet(tmp_path / "many" / "part-0.parquet", rows[:12])
    write_parquet(tmp_path / "many" / "part-1.parquet", rows[12:])
    c = prepare(config(f"{tmp_path}/many/*.parquet", tmp_path / "c"))
    assert decoded_markers(tmp_path / "c", c) == set(range(30))
    assert decoded_markers(tmp_path / "b", b) == set(range(30))


@pytest.mark.parametrize("streaming", [True, False])
def test_hf_dataset_folder_goes_through_load_dataset_offline(tmp_path, hf_cache, streaming):
    """A folder of data files takes the same `load_dataset` call as a Hub name."""
    rows = records(40)
    write_parquet(tmp_path / "ds" / "data" / "train-00000-of-00002.parquet", rows[:25])
    write_parquet(tmp_path / "ds" / "data" / "train-00001-of-00002.parquet", rows[25:])
    out = tmp_path / "out"
    cfg = config(f"hf:{tmp_path / 'ds'}", out, f"data.streaming={str(streaming).lower()}")
    manifest = prepare(cfg)
    assert decoded_markers(out, manifest) == set(range(40))
    assert manifest["documents_read"] == 40
    assert prepare(cfg) == manifest  # a finished prepare is a no-op


def test_hf_jsonl_folder_and_caps(tmp_path, hf_cache):
    rows = records(40)
    write_jsonl(tmp_path / "ds" / "train.jsonl", rows)
    src = f"hf:{tmp_path / 'ds'}"
    capped = prepare(config(src, tmp_path / "a", "data.max_documents=9", "data.streaming=true"))
    assert decoded_markers(tmp_path / "a", capped) == set(range(9))
    full = prepare(config(src, tmp_path / "b", "data.streaming=true"))
    per_doc = (full["splits"]["train"]["tokens"] + full["splits"]["val"]["tokens"]) / 40
    limit = int(per_doc * 10.5)
    by_tokens = prepare(config(src, tmp_path / "c", f"data.max_tokens={limit}"))
    written = sum(s["tokens"] for s in by_tokens["splits"].values())
    assert by_tokens["capped_at_max_tokens"]
    assert limit <= written < limit + 2 * per_doc  # stops at the document that reaches the cap
    assert decoded_markers(tmp_path / "c", by_tokens) == set(range(by_tokens["documents_read"]))


def test_hf_saved_to_disk_dataset(tmp_path, hf_cache):
    import datasets

    rows = records(20)
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
    ds.save_to_disk(str(tmp_path / "saved"))
    manifest = prepare(config(f"hf:{tmp_path / 'saved'}", tmp_path / "out"))
    assert decoded_markers(tmp_path / "out", manifest) == set(range(20))
    with pytest.raises(UserError, match="no split 'validation'.*data.hf_split"):
        prepare(config(f"hf:{tmp_path / 'saved'}", tmp_path / "o2", "data.hf_split=validation"))
    # one split saved alone has no splits nor configs to pick: keys naming them were not read
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "alone"))
    for key in ("data.hf_split=validation", "data.hf_config=en"):
        with pytest.raises(UserError, match=rf"{key.split('=')[0]}=.*holds one dataset saved"):
            prepare(config(f"hf:{tmp_path / 'alone'}", tmp_path / "o3", key))
        assert not (tmp_path / "o3").exists()
    alone = prepare(config(f"hf:{tmp_path / 'alone'}", tmp_path / "o4"))
    assert decoded_markers(tmp_path / "o4", alone) == set(range(20))


def test_an_hf_folder_naming_files_outside_it_is_refused(tmp_path, hf_cache):
    """A dataset card whose configs name /elsewhere/*.jsonl, or a save_to_disk record naming an
    Arrow file by its absolute path: prepare read the files there (another user's secrets became
    training data) and, fingerprinting the folder alone, called the data up to date after they
    changed. What the folder's records name must lie in it; what does is read."""
    secret = write_jsonl(tmp_path / "secret" / "keys.jsonl", records(5))
    card = tmp_path / "card"
    write_jsonl(card / "local.jsonl", records(30))
    for named in (f"{secret.parent}/*.jsonl", "../secret/keys.jsonl", "hf://datasets/o/n"):
        (card / "README.md").write_text(
            f"---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
            f"    path: {named}\n---\n"
        )
        with pytest.raises(UserError, match=f"README.md names {re.escape(repr(named))}, outside"):
            prepare(config(f"hf:{card}", tmp_path / "out"))
        assert not (tmp_path / "out").exists()
    (card / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        "    path: local.jsonl\n---\n"
    )
    assert decoded_markers(
        tmp_path / "out", prepare(config(f"hf:{card}", tmp_path / "out"))
    ) == set(range(30))
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_list(records(5)).save_to_disk(str(saved))
    state = json.loads((saved / "state.json").read_text())
    state["_data_files"][0]["filename"] = str(tmp_path / "elsewhere.arrow")
    (saved / "state.json").write_text(json.dumps(state))
    for i in range(1000):  # (JSON files sorting first hid the record from a capped search)
        (saved / f"a{i:04d}.json").write_text("{}")
    with pytest.raises(UserError, match="state.json names .*elsewhere.arrow', outside"):
        prepare(config(f"hf:{saved}", tmp_path / "o2"))


def test_hf_bad_input_names_the_dataset_or_field(tmp_path, hf_cache):
    # not in the local cache and no network: a clear error, no traceback, nothing written
    with pytest.raises(UserError, match="could not be opened.*HF_HUB_OFFLINE") as e:
        prepare(config("hf:no-such-org/no-such-dataset", tmp_path / "d", "data.streaming=true"))
    assert "no-such-org/no-such-dataset" in str(e.value)
    assert not (tmp_path / "d" / "manifest.json").exists()

    write_jsonl(tmp_path / "ds" / "train.jsonl", [{"body": "x " * 50}] * 5)
    with pytest.raises(UserError, match="no field 'text'.*'body'.*data.text_field"):
        prepare(config(f"hf:{tmp_path / 'ds'}", tmp_path / "d", "data.streaming=true"))
    with pytest.raises(UserError, match="data.hf_config='nope'"):
        prepare(config(f"hf:{tmp_path / 'ds'}", tmp_path / "d", "data.hf_config=nope"))
    with pytest.raises(UserError, match="names no dataset"):
        prepare(config("'hf:'", tmp_path / "d"))


def test_bad_local_files_name_the_file_and_field(tmp_path):
    pq_file = write_parquet(tmp_path / "c.parquet", [{"body": "some text " * 20}] * 3)
    with pytest.raises(UserError, match=r"c.parquet has no column 'text' \(found \['body'\]\)"):
        prepare(config(pq_file, tmp_path / "d"))
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all" * 10)
    with pytest.raises(UserError, match="junk.parquet is not a readable Parquet file"):
        prepare(config(junk, tmp_path / "d"))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2 is not valid UTF-8"):
        prepare(config(bad, tmp_path / "d"))
    bom = tmp_path / "bom.jsonl"  # (saved by an editor that starts UTF-8 with a byte-order mark)
    bom.write_bytes(b'\xef\xbb\xbf{"text": "fine"}\n{"text": "also \xef\xbb\xbf kept"}\n')
    assert [
        d.text for d in open_source(load_config(None, [f"data.source={bom}"]).data).documents()
    ] == [
        "fine",
        "also \ufeff kept",
    ]
    listy = write_jsonl(tmp_path / "listy.jsonl", [{"text": ["a", "b"]}])
    with pytest.raises(UserError, match=r"listy.jsonl:1: field 'text' holds list"):
        prepare(config(listy, tmp_path / "d"))
    (tmp_path / "e1.jsonl").write_text("")
    (tmp_path / "e2.txt").write_text("")
    with pytest.raises(UserError, match="every matched file is empty"):
        prepare(config(f"{tmp_path}/e*", tmp_path / "d"))
    assert not (tmp_path / "d" / "manifest.json").exists()
    # a damaged data page behind a good footer, and a string column that is not UTF-8: pyarrow's
    # OSError and UnicodeDecodeError were tracebacks, leaving data.dir/.prepare-build behind
    rows = [{"text": f"row {i} " + "some words here " * 30} for i in range(200)]
    damaged = tmp_path / "damaged.parquet"
    pq.write_table(pa.Table.from_pylist(rows), damaged, compression="snappy", row_group_size=50)
    data = bytearray(damaged.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 200] = bytes(b ^ 0x5A for b in data[middle : middle + 200])
    damaged.write_bytes(bytes(data))
    text = pa.Array.from_buffers(
        pa.string(),
        1,
        [None, pa.py_buffer(np.array([0, 6], np.int32)), pa.py_buffer(b"hello\xff")],
    )
    latin = tmp_path / "latin.parquet"
    pq.write_table(pa.table({"text": text}), latin)
    for path, said in [
        (damaged, "damaged.parquet cannot be read (OSError: "),
        (latin, "latin.parquet cannot be read (UnicodeDecodeError: "),
    ]:
        with pytest.raises(UserError, match=re.escape(said)):
            prepare(config(path, tmp_path / "d"))
        assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir()), path


def test_a_bad_record_past_the_tokenizers_sample_leaves_no_build(tmp_path):
    """A record refused while tokenizing (past the tokenizer's sample) left data.dir/
    .prepare-build with its shards: one paragraph, exit 2, and a build no fix could resume."""
    good = [{"text": text} for text in random_texts(1000, "doc{i}")]
    write_jsonl(tmp_path / "src" / "a.jsonl", good)
    write_jsonl(tmp_path / "src" / "z.jsonl", [{"text": 5}])
    out = tmp_path / "d"
    with pytest.raises(UserError, match=r"z.jsonl:1: field 'text' holds int"):
        prepare(config(tmp_path / "src", out, "data.tokenizer_sample_bytes=30000"))
    assert not out.exists() or not any(out.iterdir())


def test_a_file_name_that_is_not_utf8_is_read(tmp_path, hf_cache):
    """A corpus file named by bytes that are not UTF-8 (\\xff.jsonl): the fingerprint and the
    train/val split hashed its name as text, a UnicodeEncodeError traceback; an hf: folder's
    fingerprint too. Its documents are read, named with the byte escaped."""
    rows = records(12)
    write_jsonl(tmp_path / "src" / "a.jsonl", rows[:6])
    with open(bytes(tmp_path / "src") + b"/\xff.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[6:])
    source = open_source(load_config(None, [f"data.source={tmp_path / 'src'}"]).data)
    names = {doc.doc_id.split(":")[0] for doc in source.documents()}
    assert names == {"a.jsonl", "\\xff.jsonl"} and source.fingerprint()
    manifest = prepare(config(tmp_path / "src", tmp_path / "out", "model.vocab_size=400"))
    assert decoded_markers(tmp_path / "out", manifest) == set(range(12))
    hf = open_source(load_config(None, [f"data.source=hf:{tmp_path / 'src'}"]).data)
    before = hf.fingerprint(), source.fingerprint()
    src = tmp_path / "src"
    os.rename(bytes(src) + b"/\xff.jsonl", bytes(src) + b"/\xfe.jsonl")
    again = [open_source(load_config(None, [f"data.source={s}"]).data) for s in (f"hf:{src}", src)]
    assert again[0].fingerprint() != before[0] and again[1].fingerprint() != before[1]


def test_hub_source_fingerprint_needs_no_network():
    """Offline, from the settings alone: each setting that picks other rows changes it."""
    base = ["data.source=hf:HuggingFaceFW/fineweb-edu", "data.streaming=true"]
    fingerprint = open_source(load_config(None, base).data).fingerprint()
    changes = ["data.hf_config=x", "data.hf_split=validation", "data.hf_revision=abc123"]
    changes += ["data.text_field=content", "data.source=hf:HuggingFaceFW/fineweb"]
    for change in changes:
        other = open_source(load_config(None, [*base, change]).data).fingerprint()
        assert other != fingerprint, change


def test_a_special_tokens_text_in_a_document_stays_text(tmp_path):
    """A `data.tokenizer` folder whose EOS is `<|endoftext|>`: a document quoting that text keeps
    one EOS, its own end (the folder's encoder read the quote as the id that ends a document)."""
    from tokenizers import Tokenizer as Pipeline
    from tokenizers import decoders, models, pre_tokenizers, trainers

    src = tmp_path / "src"
    src.mkdir()
    texts = random_texts(30, "doc{i:03d}marker", seed=0, length=80)
    texts[0] = "quoted <|endoftext|> in the text " + texts[0]
    for i, text in enumerate(texts):
        (src / f"{i:03d}.txt").write_text(text)
    tok = Pipeline(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special, alphabet = ["<|endoftext|>"], pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(vocab_size=300, special_tokens=special, initial_alphabet=alphabet),
    )
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    named = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(named))
    out = tmp_path / "data"
    manifest = prepare(config(src, out, f"data.tokenizer={folder}"))
    tokens = np.concatenate(
        [np.concatenate(open_split(out, manifest, s)) for s in ("train", "val")]
    )
    assert manifest["tokenizer"]["eos_id"] == 0
    assert (tokens == 0).sum() == len(texts)  # (one end a document)


def test_a_byte_order_mark_is_not_text_and_a_split_of_all_validation_is_named(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(random_texts(20, "doc{i:03d}marker", seed=0, length=80)):
        (src / f"{i:03d}.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())
    docs = list(open_source(load_config(None, [f"data.source={src}"]).data).documents())
    assert len(docs) == 20 and not any(d.text.startswith("\ufeff") for d in docs)
    with pytest.raises(UserError, match=r"data.val_fraction=0.999 sent every one of the 20 "):
        prepare(config(src, tmp_path / "data", "data.val_fraction=0.999"))
    assert not (tmp_path / "data").exists()
