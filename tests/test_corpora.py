"""Local corpora are read exactly as written: which files a file / directory / glob source reads
(symlinks, loops, duplicates, suffixes in any case), what it skips and how it says so, the
per-document size limit, and text that is not valid Unicode."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from scale_llm.config import load_config
from scale_llm.data import sources
from scale_llm.data.prepare import prepare
from scale_llm.data.sources import Source, local_source, open_source
from scale_llm.errors import UserError
from tests.helpers import env, prep_config, random_texts


def write(path, text="", data=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if data is not None else text.encode())
    return path


def jsonl(path, texts):
    return write(path, "".join(json.dumps({"text": t}) + "\n" for t in texts))


def documents(spec):
    return {d.doc_id: d.text for d in local_source(str(spec), "text").documents()}


def old_fingerprint(spec, files, text_field="text"):
    """The fingerprint as it was computed before files were read by their kind in any case:
    prepared data whose corpus keeps these files is still current."""
    h = hashlib.sha256(f"{spec}|{text_field}".encode())
    for f in files:
        h.update(f"{f}|{f.stat().st_size}|{f.stat().st_mtime_ns}\n".encode())
    return h.hexdigest()


def warnings(caplog):
    return " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


@pytest.fixture
def warned(caplog):
    with caplog.at_level(logging.WARNING, logger="scale_llm"):
        yield caplog


# ----------------------------------------------------------------------------- symlinks
def test_a_glob_through_a_symlink_loop_reads_each_file_once(tmp_path, warned):
    """`**` used to follow sub/loop -> .. until the kernel's 40-link limit: every file 40 times,
    the same text in train and validation."""
    corpus = tmp_path / "corpus"
    write(corpus / "a.txt", "alpha")
    write(corpus / "sub" / "b.txt", "beta")
    (corpus / "sub" / "loop").symlink_to("..")
    assert documents(f"{corpus}/**/*.txt") == {"a.txt": "alpha", "sub/b.txt": "beta"}
    assert "1 symlinked directory that loops back (sub/loop -> ..)" in warnings(warned)


def test_two_symlink_loops_do_not_hang_a_glob(tmp_path):
    """Two links back to the top made the glob walk 2^40 paths: it never returned."""
    corpus = tmp_path / "corpus"
    write(corpus / "a.txt", "alpha")
    (corpus / "one").symlink_to(".")
    (corpus / "two").symlink_to(".")
    code = (
        "import sys; from scale_llm.data.sources import local_source; "
        "print(sorted(d.doc_id for d in local_source(sys.argv[1], 'text').documents()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, f"{corpus}/**/*.txt"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['a.txt']"
    assert "2 symlinked directories that loop back (one -> ., two -> .)" in done.stderr


def test_a_directory_source_follows_symlinked_folders_and_reads_each_file_once(tmp_path, warned):
    """rglob did not follow linked/ (its files were left out without a word); now it is
    followed, a second path to the same file is read once (the path without symlinks wins,
    whatever the sort order), and a loop, a broken link and a pipe are reported."""
    outside = tmp_path / "outside"
    write(outside / "y.txt", "from a linked folder")
    corpus = tmp_path / "corpus"
    write(corpus / "z" / "x.txt", "real")
    (corpus / "linked").symlink_to(outside)
    (corpus / "a_alias").symlink_to("z")  # sorts before z/: z/x.txt is still the one kept
    (corpus / "z" / "back").symlink_to("..")
    os.link(corpus / "z" / "x.txt", corpus / "zz_hard.txt")
    (corpus / "gone.txt").symlink_to("nowhere.txt")
    os.mkfifo(corpus / "pipe.txt")
    assert documents(corpus) == {"z/x.txt": "real", "linked/y.txt": "from a linked folder"}
    said = warnings(warned)
    assert f"data.source='{corpus}' skips 6 paths:" in said
    assert "2 duplicate paths (a_alias/x.txt = z/x.txt, zz_hard.txt = z/x.txt)" in said
    assert "2 symlinked directories that loop back (a_alias/back -> .., z/back -> ..)" in said
    assert "1 broken symlink (gone.txt)" in said
    assert "1 file that is not a regular file (pipe.txt)" in said


# ----------------------------------------------------------------------------- suffixes
def test_suffixes_decide_the_kind_in_any_case_and_unknown_ones_are_reported(tmp_path, warned):
    corpus = tmp_path / "corpus"
    write(corpus / "A.TXT", "upper-case text")
    jsonl(corpus / "b.JSONL", ["first line", "second line"])
    write(corpus / "c.Json", json.dumps({"text": "a json line"}) + "\n")
    pq.write_table(pa.Table.from_pylist([{"text": "a row"}]), write(corpus / "d.PARQUET"))
    write(corpus / "e.csv", "a,b\n")
    write(corpus / "f.log", "log line")
    write(corpus / "g.jsonl.gz", data=b"\x1f\x8b")
    source = local_source(str(corpus), "text")
    assert {d.doc_id: d.text for d in source.documents()} == {
        "A.TXT": "upper-case text",
        "b.JSONL:1": "first line",
        "b.JSONL:2": "second line",
        "c.Json:1": "a json line",
        "d.PARQUET:1": "a row",
    }
    assert "(4 files: 1 text, 2 jsonl, 1 parquet; " in source.describe()
    assert "; 3 skipped)" in source.describe()
    said = warnings(warned)
    assert "2 files with unknown suffixes (e.csv, f.log)" in said
    assert "1 compressed file (g.jsonl.gz)" in said and "decompress" in said


def test_a_glob_of_upper_case_jsonl_reads_the_field_not_the_raw_json(tmp_path):
    jsonl(tmp_path / "c" / "part.JSONL", ["the text"])
    assert documents(f"{tmp_path}/c/*.JSONL") == {"part.JSONL:1": "the text"}
    # the same files read another way: data prepared from the raw JSON is rebuilt
    lower = tmp_path / "l" / "part.jsonl"
    jsonl(lower, ["the text"])
    old_way = old_fingerprint(f"{tmp_path}/c/*.JSONL", [tmp_path / "c" / "part.JSONL"])
    assert local_source(f"{tmp_path}/c/*.JSONL", "text").fingerprint() != old_way
    assert local_source(str(lower), "text").fingerprint() == old_fingerprint(str(lower), [lower])
    # upper-case plain text was read as plain text before too: its data stays current
    write(tmp_path / "u" / "A.TXT", "text")
    upper = f"{tmp_path}/u/*.TXT"
    assert local_source(upper, "text").fingerprint() == old_fingerprint(
        upper, [tmp_path / "u" / "A.TXT"]
    )


def test_a_plain_corpus_keeps_its_files_ids_and_fingerprint(tmp_path):
    """Lower-case suffixes and no symlinks: the same files, in the same order, under the same
    ids and fingerprint as the plain rglob / glob listing (prepared data stays valid)."""
    corpus = tmp_path / "corpus"
    for i, text in enumerate(random_texts(6, "doc{i}", length=5)):
        write(corpus / f"d{i % 2}" / f"{i}.txt", text)
    jsonl(corpus / "d-1" / "x.jsonl", ["one", "two"])
    write(corpus / ".hidden" / "h.md", "hidden file in a hidden folder")
    write(corpus / "d0" / ".h.txt", "hidden file")
    write(corpus / "skip.csv", "not read")
    known = (".txt", ".md", ".py", ".text", ".jsonl", ".json", ".parquet")
    for spec in [str(corpus), f"{corpus}/**/*.txt", f"{corpus}/*/*", f"{corpus}/**"]:
        if spec == str(corpus):  # what the listing was: rglob, then the known suffixes
            old = [p for p in corpus.rglob("*") if p.is_file() and p.suffix in known]
        else:
            old = [Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file()]
        src = local_source(spec, "text")
        assert src.files == sorted(old), spec
        assert src.fingerprint() == old_fingerprint(spec, sorted(old)), spec
    ids = [d.doc_id for d in local_source(str(corpus), "text").documents()]
    assert ids[:3] == [".hidden/h.md", "d-1/x.jsonl:1", "d-1/x.jsonl:2"]


def test_a_prepare_over_a_looping_glob_reads_each_document_once(tmp_path):
    corpus = tmp_path / "corpus"
    texts = random_texts(8, "doc{i:03d}marker", length=60)
    for i, text in enumerate(texts):
        write(corpus / f"{i}.txt", text)
    (corpus / "loop").symlink_to(".")
    cfg = prep_config(f"{corpus}/**/*.txt", tmp_path / "out", "data.num_proc=1")
    manifest = prepare(cfg)
    assert manifest["documents_read"] == 8
    assert sum(s["documents"] for s in manifest["splits"].values()) == 8


def test_a_folder_with_nothing_readable_says_what_it_skipped(tmp_path):
    write(tmp_path / "c" / "a.csv", "x")
    write(tmp_path / "c" / "b.jsonl.zst", "x")
    with pytest.raises(UserError, match=r"matches no file it reads \(compressed files are not"):
        local_source(str(tmp_path / "c"), "text")
    with pytest.raises(UserError, match=r"1 file with an unknown suffix \(a.csv\)"):
        local_source(str(tmp_path / "c"), "text")


# ----------------------------------------------------------------------------- size limit
@pytest.fixture
def small_limit(monkeypatch):
    monkeypatch.setattr(sources, "MAX_DOCUMENT_CHARS", 1000)


def test_a_jsonl_line_over_the_limit_is_refused_before_it_is_read_whole(tmp_path, small_limit):
    ok = "x" * (1000 - len('{"text": ""}'))  # a line of exactly the limit is read
    path = write(
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
    big = write(tmp_path / "t" / "big.txt", "z" * 1001)
    write(tmp_path / "t" / "fits.txt", "z" * 1000)
    with pytest.raises(UserError, match=r"big.txt is longer than 1,000 bytes.*split"):
        list(local_source(str(big.parent), "text").documents())
    assert len(documents(tmp_path / "t" / "fits.txt")) == 1
    rows = write(tmp_path / "r.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": "ok"}, {"text": "é" * 1001}]), rows)
    with pytest.raises(UserError, match=r"r.parquet row 2: .* 1,001 characters.*1,000"):
        documents(rows)


# ----------------------------------------------------------------------------- not Unicode
def test_a_lone_surrogate_in_a_jsonl_record_names_the_file_and_line(tmp_path):
    """Valid JSON, but not text: it used to reach the tokenizer and fail there as a TypeError
    from a worker process, naming no file."""
    path = write(tmp_path / "s.jsonl", '{"text": "fine"}\n{"text": "a\\ud800b"}\n')
    with pytest.raises(UserError, match=r"s.jsonl:2: field 'text' holds a lone surrogate"):
        documents(path)
    pair = write(tmp_path / "p.jsonl", '{"text": "smile \\ud83d\\ude00"}\n')
    assert documents(pair) == {"p.jsonl:1": "smile \U0001f600"}  # a whole pair is text


def test_a_lone_surrogate_stops_prepare_with_the_place_not_a_worker_traceback(tmp_path):
    texts = random_texts(40, "doc{i}", length=60)
    path = write(
        tmp_path / "c.jsonl",
        "".join(json.dumps({"text": t}) + "\n" for t in texts) + '{"text": "x\\udc00"}\n',
    )
    with pytest.raises(UserError, match=r"c.jsonl:41: field 'text' holds a lone surrogate"):
        prepare(prep_config(path, tmp_path / "out", "data.num_proc=1"))


@pytest.mark.parametrize("streaming", [True, False])
def test_a_hf_folder_with_a_lone_surrogate_names_the_problem_and_the_way_to_find_it(
    tmp_path, monkeypatch, streaming
):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    jsonl(tmp_path / "ds" / "train.jsonl", random_texts(5, "doc{i}", length=20))
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


def test_skipped_files_that_are_not_utf8_are_counted(tmp_path, caplog):
    """The builtin corpus skips its few Latin-1 files; it now says which."""
    good = write(tmp_path / "good.py", "x = 1\n")
    bad = write(tmp_path / "bad.py", data=b"s = '\xe9'\n")
    src = Source("builtin:test", [bad, good], skip_undecodable=True, root=tmp_path)
    with caplog.at_level(logging.INFO, logger="scale_llm"):
        assert [d.doc_id for d in src.documents()] == ["good.py"]
    assert "skipped 1 file that is not UTF-8 (bad.py)" in caplog.text
