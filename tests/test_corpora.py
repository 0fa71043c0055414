"""Local corpora are read exactly as written: which files a file / directory / glob source reads
(symlinks, loops, duplicates, suffixes in any case) and what it skips and how it says so, each
real file once. (A source that cannot be read, a document over the size limit and text that is
not valid Unicode: tests/test_errors.py.)"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from scale_llm.data.prepare import prepare
from scale_llm.data.sources import local_source
from tests.helpers import (
    documents_of,
    env,
    prep_config,
    random_texts,
    write_file,
    write_jsonl,
)


def listing_fingerprint(spec, files, text_field="text"):
    """The fingerprint of a corpus: its files' paths, sizes and times (prepared data whose
    corpus keeps these files is still current)."""
    h = hashlib.sha256(f"{spec}|{text_field}".encode())
    for f in files:
        h.update(f"{f}|{f.stat().st_size}|{f.stat().st_mtime_ns}\n".encode())
    return h.hexdigest()


def warnings(logs) -> str:
    return " ".join(r.getMessage() for r in logs.records if r.levelno >= logging.WARNING)


@pytest.fixture
def warned(logs):
    return logs


# ----------------------------------------------------------------------------- symlinks
def test_a_glob_through_a_symlink_loop_reads_each_file_once(tmp_path, warned):
    """`**` used to follow sub/loop -> .. until the kernel's 40-link limit: every file 40 times,
    the same text in train and validation."""
    corpus = tmp_path / "corpus"
    write_file(corpus / "a.txt", "alpha")
    write_file(corpus / "sub" / "b.txt", "beta")
    (corpus / "sub" / "loop").symlink_to("..")
    assert documents_of(f"{corpus}/**/*.txt") == {"a.txt": "alpha", "sub/b.txt": "beta"}
    assert "1 symlinked directory that loops back (sub/loop -> ..)" in warnings(warned)


def test_two_symlink_loops_do_not_hang_a_glob(tmp_path):
    """Two links back to the top made the glob walk 2^40 paths: it never returned."""
    corpus = tmp_path / "corpus"
    write_file(corpus / "a.txt", "alpha")
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
    write_file(outside / "y.txt", "from a linked folder")
    corpus = tmp_path / "corpus"
    write_file(corpus / "z" / "x.txt", "real")
    (corpus / "linked").symlink_to(outside)
    (corpus / "a_alias").symlink_to("z")  # sorts before z/: z/x.txt is still the one kept
    (corpus / "z" / "back").symlink_to("..")
    os.link(corpus / "z" / "x.txt", corpus / "zz_hard.txt")
    (corpus / "gone.txt").symlink_to("nowhere.txt")
    os.mkfifo(corpus / "pipe.txt")
    assert documents_of(corpus) == {"z/x.txt": "real", "linked/y.txt": "from a linked folder"}
    said = warnings(warned)
    assert f"data.source='{corpus}' skips 6 paths:" in said
    assert "2 duplicate paths (a_alias/x.txt = z/x.txt, zz_hard.txt = z/x.txt)" in said
    assert "2 symlinked directories that loop back (a_alias/back -> .., z/back -> ..)" in said
    assert "1 broken symlink (gone.txt)" in said
    assert "1 file that is not a regular file (pipe.txt)" in said


# ----------------------------------------------------------------------------- suffixes
def test_suffixes_decide_the_kind_in_any_case_and_unknown_ones_are_reported(tmp_path, warned):
    corpus = tmp_path / "corpus"
    write_file(corpus / "A.TXT", "upper-case text")
    write_jsonl(corpus / "b.JSONL", ["first line", "second line"])
    write_file(corpus / "c.Json", json.dumps({"text": "a json line"}) + "\n")
    pq.write_table(pa.Table.from_pylist([{"text": "a row"}]), write_file(corpus / "d.PARQUET"))
    write_file(corpus / "e.csv", "a,b\n")
    write_file(corpus / "f.log", "log line")
    write_file(corpus / "g.jsonl.gz", data=b"\x1f\x8b")
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
    write_jsonl(tmp_path / "c" / "part.JSONL", ["the text"])
    assert documents_of(f"{tmp_path}/c/*.JSONL") == {"part.JSONL:1": "the text"}
    # no mark of the kind in the fingerprint: data prepared from the raw JSON (before c7b771c)
    # lacks prepare's mark (697de94) too, and is refused (tests/bad_input_cases.py, COMPAT)
    part = [tmp_path / "c" / "part.JSONL"]
    assert local_source(f"{tmp_path}/c/*.JSONL", "text").fingerprint() == listing_fingerprint(
        f"{tmp_path}/c/*.JSONL", part
    )
    write_file(tmp_path / "u" / "A.TXT", "text")
    upper = f"{tmp_path}/u/*.TXT"
    assert local_source(upper, "text").fingerprint() == listing_fingerprint(
        upper, [tmp_path / "u" / "A.TXT"]
    )


def test_a_plain_corpus_keeps_its_files_ids_and_fingerprint(tmp_path):
    """Lower-case suffixes and no symlinks: the same files, in the same order, under the same
    ids and fingerprint as the plain rglob / glob listing (prepared data stays valid)."""
    corpus = tmp_path / "corpus"
    for i, text in enumerate(random_texts(6, "doc{i}", length=5)):
        write_file(corpus / f"d{i % 2}" / f"{i}.txt", text)
    write_jsonl(corpus / "d-1" / "x.jsonl", ["one", "two"])
    write_file(corpus / ".hidden" / "h.md", "hidden file in a hidden folder")
    write_file(corpus / "d0" / ".h.txt", "hidden file")
    write_file(corpus / "skip.csv", "not read")
    known = (".txt", ".md", ".py", ".text", ".jsonl", ".json", ".parquet")
    for spec in [str(corpus), f"{corpus}/**/*.txt", f"{corpus}/*/*", f"{corpus}/**"]:
        if spec == str(corpus):  # what the listing was: rglob, then the known suffixes
            old = [p for p in corpus.rglob("*") if p.is_file() and p.suffix in known]
        else:
            old = [Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file()]
        src = local_source(spec, "text")
        assert src.files == sorted(old), spec
        assert src.fingerprint() == listing_fingerprint(spec, sorted(old)), spec
    ids = [d.doc_id for d in local_source(str(corpus), "text").documents()]
    assert ids[:3] == [".hidden/h.md", "d-1/x.jsonl:1", "d-1/x.jsonl:2"]


def test_a_prepare_over_a_looping_glob_reads_each_document_once(tmp_path):
    corpus = tmp_path / "corpus"
    texts = random_texts(8, "doc{i:03d}marker", length=60)
    for i, text in enumerate(texts):
        write_file(corpus / f"{i}.txt", text)
    (corpus / "loop").symlink_to(".")
    cfg = prep_config(f"{corpus}/**/*.txt", tmp_path / "out", "data.num_proc=1")
    manifest = prepare(cfg)
    assert manifest["documents_read"] == 8
    assert sum(s["documents"] for s in manifest["splits"].values()) == 8


# ----------------------------------------------------------------------------- damaged records
def test_a_jsonl_record_nested_100000_deep_is_refused_naming_its_line(tmp_path):
    """A record nested deeper than any corpus needs is not JSON this reader takes: refused as a
    damaged line is (a RecursionError from the decoder before)."""
    from scale_llm.errors import UserError

    deep = json.dumps({"text": "ok"}) + "\n" + '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    write_file(tmp_path / "c.jsonl", deep)
    with pytest.raises(UserError, match=r"c\.jsonl:2 is not valid JSON \(nested deeper than 64"):
        documents_of(tmp_path / "c.jsonl")
    write_file(tmp_path / "d" / "c.jsonl", '{"text": "a", }\n')  # (the decoder's reason, as before)
    with pytest.raises(UserError, match=r"c\.jsonl:1 is not valid JSON \(Expecting property name"):
        documents_of(tmp_path / "d" / "c.jsonl")
