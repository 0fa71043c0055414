"""Continued pretraining of an existing model, end to end: `data.tokenizer`.

A tiny 4-step run (on conftest.py's prepared data) is exported; a second run starts from the
export (model.init_from) on data prepared with the export's own tokenizer (data.tokenizer), trains
4 steps and is exported again: the second export carries the same tokenizer files, transformers
loads it, and its greedy text equals `scale-llm generate`'s. Around it: the ids equal those of
the SentencePiece path, a changed tokenizer rebuilds the data, ids past uint16 are stored as
uint32, and init_from refuses a tokenizer the data was not encoded with.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from scale_llm.config import load_config
from scale_llm.data.prepare import prepare
from scale_llm.data.shards import open_split, read_manifest
from scale_llm.errors import UserError
from scale_llm.export import export
from scale_llm.generate import load_run, read_run_config
from tests.helpers import (
    TINY_MODEL,
    finished_run,
    first_batch_loss,
    greedy_texts,
    init_weights,
    plan_for,
    random_texts,
    rows_of,
    word_tokenizer,
    write_jsonl,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TEXTS = ["def f(x):\n    return x + 1\n", "  runs   of spaces\t\ttabs", "café 😀 中文 <s> 0xBEEF"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def source(data_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A 4-step run of the tiny model on conftest.py's data_dir, and its export."""
    root = tmp_path_factory.mktemp("source")
    run = finished_run(data_dir, root)
    export(run, root / "export")
    return run, root / "export"


def tokenizer_config(data: Path, source: Path, exported: Path, *extra: str):
    """conftest.py's data_dir settings over the same corpus, encoded with the export's tokenizer."""
    return load_config(
        None,
        [
            *TINY_MODEL,
            f"data.source={source}",
            f"data.dir={data}",
            "data.val_fraction=0.1",
            f"data.tokenizer={exported}",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def continued(source, corpus_dir, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(data encoded with the export's tokenizer, a 4-step run from the export on it, its
    export)."""
    _, exported = source
    root = tmp_path_factory.mktemp("continued")
    prepare(tokenizer_config(root / "data", corpus_dir, exported))
    run = finished_run(
        root / "data", root, f"model.init_from={exported}", f"data.tokenizer={exported}"
    )
    export(run, root / "export")
    return root / "data", run, root / "export"


def test_the_exports_tokenizer_gives_the_ids_of_the_tokenizer_it_came_from(
    continued, data_dir, source
):
    data, _, _ = continued
    ours, theirs = read_manifest(data_dir), read_manifest(data)
    tok = theirs["tokenizer"]
    assert tok["file"] == "hf-tokenizer.json" and tok["from"] == str(source[1])
    assert (tok["vocab_size"], tok["bos_id"], tok["eos_id"]) == (512, 1, 2)
    assert theirs["dtype"] == "uint16" and theirs["splits"] == ours["splits"]
    for split in ("train", "val"):  # [BOS] ids [EOS] per document, byte for byte
        for a, b in zip(open_split(data_dir, ours, split), open_split(data, theirs, split)):
            assert np.array_equal(a, b)
    assert not (data / "tokenizer.model").exists()


def test_a_continued_run_exports_the_same_tokenizer_and_generates_the_same_text(continued, source):
    first_run, first_export = source
    data, run, again = continued
    assert (run / "hf-tokenizer.json").read_bytes() == (data / "hf-tokenizer.json").read_bytes()
    assert not (run / "tokenizer.model").exists()
    for name in (*TOKENIZER_FILES, "tokenizer.model"):  # written back as data.tokenizer held it
        assert (again / name).read_bytes() == (first_export / name).read_bytes(), name
    config = json.loads((again / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    # the weights came from the export: the first loss is the export's on that batch
    model = transformers.LlamaForCausalLM.from_pretrained(first_export, dtype=torch.float32)
    start = first_batch_loss(model.eval(), data, 4)
    assert abs(rows_of(run)[1]["loss"] - start) <= 1e-5
    assert abs(rows_of(first_run)[1]["loss"] - start) > 1e-2  # a fresh init starts elsewhere
    cfg = read_run_config(run)
    _, tok = load_run(run, cfg, plan_for(cfg))
    hf_tok = transformers.AutoTokenizer.from_pretrained(again)
    for text in TEXTS:
        assert hf_tok(text)["input_ids"] == tok.encode(text, bos=True)
        assert hf_tok.decode(tok.encode(text), skip_special_tokens=True) == text
    ours, theirs = greedy_texts(run, again, "def ", 20)
    assert ours == theirs and len(ours) > len("def \n")


def test_a_changed_tokenizer_rebuilds_the_data_and_an_unchanged_one_does_not(
    source, tmp_path, logs
):
    _, exported = source
    corpus = write_jsonl(tmp_path / "c.jsonl", random_texts(40, "doc{i:03d}"))
    data = tmp_path / "data"
    first = prepare(tokenizer_config(data, corpus, exported))
    assert first["tokenizer"]["file"] == "hf-tokenizer.json"
    assert prepare(tokenizer_config(data, corpus, exported)) == first
    assert any("is up to date" in line for line in logs)
    # the same tokenizer files, told to add no BOS: other ids, so other data
    changed = tmp_path / "no_bos"
    shutil.copytree(exported, changed)
    edit_json(changed / "tokenizer.json", post_processor=None)  # (it put BOS first)
    edit_json(changed / "tokenizer_config.json", add_bos_token=False)
    second = prepare(tokenizer_config(data, corpus, changed))
    assert second["fingerprint"] != first["fingerprint"]
    assert second["tokenizer"]["sha256"] != first["tokenizer"]["sha256"]
    assert open_split(data, second, "train")[0][0] != 1  # no BOS: the text's first id
    assert second["splits"]["train"]["tokens"] == first["splits"]["train"]["tokens"] - 36
    # back to a tokenizer prepare trains: the model's tokenizer file goes with its manifest
    cfg = tokenizer_config(data, corpus, exported)
    third = prepare(replace(cfg, data=replace(cfg.data, tokenizer=None)))
    assert third["tokenizer"]["file"] == "tokenizer.model"
    assert not (data / "hf-tokenizer.json").exists() and (data / "tokenizer.model").is_file()


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_ids_past_uint16_are_stored_as_uint32(tmp_path):
    folder = word_tokenizer(tmp_path / "words", 70_000)
    texts = [f"w{i} w{69_999 - i} w{65_600 + i}" for i in range(12)]
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    cfg = load_config(
        None,
        [
            "model.vocab_size=70003",
            f"data.source={corpus}",
            f"data.dir={tmp_path / 'data'}",
            "data.val_fraction=0.25",
            f"data.tokenizer={folder}",
        ],
    )
    manifest = prepare(cfg)
    assert manifest["dtype"] == "uint32" and manifest["tokenizer"]["vocab_size"] == 70_003
    tokens = np.concatenate(
        [*open_split(cfg.data.dir, manifest, "train"), *open_split(cfg.data.dir, manifest, "val")]
    )
    assert tokens.dtype == np.uint32 and tokens.size == 12 * 5
    documents = {tuple(tokens[i : i + 5].tolist()) for i in range(0, tokens.size, 5)}
    want = {(1, i + 3, 69_999 - i + 3, 65_600 + i + 3, 2) for i in range(12)}  # [BOS] ids [EOS]
    assert documents == want


def test_init_from_refuses_weights_of_another_tokenizer_than_the_datas(continued, source):
    data, run, again = continued
    tok = read_manifest(data)["tokenizer"]
    cfg = replace(read_run_config(run).model, init_from=str(again))
    assert init_weights(cfg, tok["sha256"], tok["files_sha256"])  # the same files: fine
    with pytest.raises(UserError, match="tokenizer files differ .* set data.tokenizer="):
        init_weights(cfg, tok["sha256"], "0" * 64)


def test_a_planted_file_name_in_the_tokenizer_bundle_is_refused(continued, tmp_path):
    """hf-tokenizer.json's files are written into an export by name: a name that is not a
    tokenizer file's (an absolute path, `..`) must be refused when the bundle is read."""
    from scale_llm.data.pretrained_tokenizer import _read_bundle
    from scale_llm.errors import UserError

    data, _, _ = continued
    for name in (str(tmp_path / "planted.sh"), "../up.txt", "config.json"):
        bundle = json.loads((data / "hf-tokenizer.json").read_text())
        bundle["files"][name] = {"text": "echo planted"}
        path = tmp_path / "hf-tokenizer.json"
        path.write_text(json.dumps(bundle))
        with pytest.raises(UserError, match="files is missing or of the wrong type"):
            _read_bundle(path)
    assert not (tmp_path / "planted.sh").exists()


def test_a_bundle_whose_encoder_does_not_read_is_named(continued, tmp_path):
    """An encoder string that is not a tokenizer (the JSON around it intact): one paragraph
    naming the file and the fix, not the tokenizers library's exception (generate, export)."""
    from scale_llm.data.pretrained_tokenizer import PretrainedTokenizer
    from scale_llm.errors import UserError

    data, _, _ = continued
    bundle = json.loads((data / "hf-tokenizer.json").read_text())
    bundle["encoder"] = "{not a tokenizer"
    path = tmp_path / "hf-tokenizer.json"
    path.write_text(json.dumps(bundle))
    with pytest.raises(UserError, match=r"its encoder does not read: .*re-run `scale-llm prepare"):
        PretrainedTokenizer(path)


def test_a_vocab_mismatch_under_init_from_names_its_tokenizer_not_a_new_prepare():
    """A padded HF vocabulary (4,096 rows) over data of a trained tokenizer (2,048 pieces): the
    message said to set model.vocab_size=2048 or prepare again with another vocabulary, which
    trains a tokenizer the weights never saw."""
    from scale_llm.train.preflight import check_vocab

    manifest = {"tokenizer": {"vocab_size": 2048, "file": "tokenizer.model", "eos_id": 2}}
    cfg = load_config(None, ["model.init_from=/models/llama", "model.vocab_size=4096"])
    with pytest.raises(UserError) as info:
        check_vocab(cfg, manifest)
    said = str(info.value)
    assert "set data.tokenizer=/models/llama and run `scale-llm prepare`" in said
    assert "set model.vocab_size=2048" not in said
    with pytest.raises(UserError, match="set model.vocab_size=2048, or re-run"):
        check_vocab(load_config(None, ["model.vocab_size=4096"]), manifest)
