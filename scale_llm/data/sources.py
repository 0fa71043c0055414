"""Corpus sources: where documents come from, in a fixed order, with a cheap fingerprint.

`data.source` selects one:
  builtin            the running interpreter's standard library .py files (tens of MB, offline)
  hf:NAME            a Hugging Face dataset, from the Hub or a local dataset folder (hf_source.py)
  PATH | DIR | GLOB  local files: .txt/.md/.py (one document per file), .jsonl (one per line),
                     .parquet (one per row); text in data.text_field

Every source yields its documents as a stream (never the whole corpus in memory), each with a
stable id that decides its train/val split.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scale_llm.errors import UserError

if TYPE_CHECKING:
    from scale_llm.config import DataConfig

TEXT_SUFFIXES = (".txt", ".md", ".py", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSED_SUFFIXES = (".gz", ".tgz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".zip", ".7z")
_PARQUET_BATCH = 1024  # rows per Arrow record batch


@dataclass(frozen=True)
class Document:
    doc_id: str  # stable name: the file (and line or row) it came from; decides the split
    text: str


class Source:
    """A fixed, ordered list of files and how to read documents out of them."""

    def __init__(
        self,
        spec: str,
        files: list[Path],
        text_field: str = "text",
        skip_undecodable: bool = False,
        root: Path | None = None,
    ):
        self.spec = spec
        self.files = files
        self.text_field = text_field
        self.skip_undecodable = skip_undecodable
        self.root = root
        self.skipped: list[str] = []

    def describe(self) -> str:
        return f"{self.spec} ({len(self.files)} files, {self.total_bytes() / 1e6:.1f} MB)"

    def fingerprint(self) -> str:
        """Changes when any file is added, removed, resized or touched (no content read)."""
        h = hashlib.sha256(f"{self.spec}|{self.text_field}".encode())
        for f in self.files:
            st = f.stat()
            h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        return h.hexdigest()

    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def documents(self) -> Iterator[Document]:
        for f in self.files:
            name = (
                f.absolute().relative_to(self.root.absolute()).as_posix() if self.root else str(f)
            )
            if f.suffix in JSONL_SUFFIXES:
                yield from self._jsonl_documents(f, name)
            elif f.suffix in PARQUET_SUFFIXES:
                yield from self._parquet_documents(f, name)
            else:
                text = self._read_text(f)
                if text is not None and text.strip():
                    yield Document(name, text)

    def _read_text(self, f: Path) -> str | None:
        try:
            return f.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            if self.skip_undecodable:
                self.skipped.append(str(f))
                return None
            raise UserError(
                f"{f} is not valid UTF-8 (byte {e.start}); convert it to UTF-8 "
                f"or remove it from data.source"
            ) from None

    def _jsonl_documents(self, f: Path, name: str) -> Iterator[Document]:
        """One record per line, read line by line: a file of any size streams."""
        with open(f, "rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise UserError(
                        f"{f}:{lineno} is not valid UTF-8 (byte {e.start} of the line); convert "
                        f"the file to UTF-8 or remove it from data.source"
                    ) from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(
                        f"{f}:{lineno} is not valid JSON ({e.msg}); fix the line or "
                        f"remove the file from data.source{self._not_jsonl_hint(f)}"
                    ) from None
                if not isinstance(record, dict) or self.text_field not in record:
                    keys = list(record)[:8] if isinstance(record, dict) else type(record).__name__
                    raise UserError(
                        f"{f}:{lineno} has no field {self.text_field!r} (found {keys}); "
                        f"set data.text_field to the field holding the text"
                        f"{self._not_jsonl_hint(f)}"
                    )
                text = text_value(record[self.text_field], f"{f}:{lineno}", self.text_field)
                if text:
                    yield Document(f"{name}:{lineno}", text)

    def _not_jsonl_hint(self, f: Path) -> str:
        """For a .json file: it was read as JSON Lines, and may be a stray metadata file (a
        prepared data dir's manifest.json, a dataset's dataset_info.json) in a directory."""
        if f.suffix != ".json":
            return ""
        others = [p.suffix for p in self.files if p != f and p.suffix in JSONL_SUFFIXES]
        suffix = max(set(others), key=others.count) if others else ".jsonl"
        is_dir = Path(self.spec).expanduser().is_dir()
        base = self.spec.rstrip("/") if is_dir else (self.root or Path(".")).as_posix()
        return (
            f". Every .json file in data.source is read as JSON Lines (one JSON object per "
            f"line); if {f.name} is not part of the corpus (e.g. a dataset's metadata), point "
            f"data.source at a glob that names only the data files, e.g. '{base}/**/*{suffix}'"
        )

    def _parquet_documents(self, f: Path, name: str) -> Iterator[Document]:
        import pyarrow.parquet as pq  # a dependency of `datasets`

        try:
            pf = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises several types for a damaged or foreign file
            raise UserError(
                f"{f} is not a readable Parquet file ({type(e).__name__}: {e}); "
                f"re-export it or remove it from data.source"
            ) from None
        columns = pf.schema_arrow.names
        if self.text_field not in columns:
            raise UserError(
                f"{f} has no column {self.text_field!r} (found {columns[:8]}); "
                f"set data.text_field to the column holding the text"
            )
        row = 0
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, columns=[self.text_field]):
            for value in batch.column(0).to_pylist():
                row += 1
                text = text_value(value, f"{f} row {row}", self.text_field)
                if text:
                    yield Document(f"{name}:{row}", text)


def text_value(value: Any, where: str, field: str) -> str | None:
    """The text of one record; None for null or blank; a clear error for a non-string."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise UserError(
            f"{where}: field {field!r} holds {type(value).__name__}, not text; set "
            f"data.text_field to a string field"
        )
    return value if value.strip() else None


def builtin_source() -> Source:
    """The standard library's own .py files: real code, on every machine, no network."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (
            p
            for p in root.rglob("*.py")
            if "site-packages" not in p.parts and "__pycache__" not in p.parts
        ),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    spec = f"builtin:python{sys.version_info.major}.{sys.version_info.minor}"
    return Source(spec, files, skip_undecodable=True, root=root)


def local_source(spec: str, text_field: str) -> Source:
    paths = _expand(spec)
    if not paths:
        folder = Path(spec).expanduser()
        packed = folder.is_dir() and any(
            p.suffix.lower() in COMPRESSED_SUFFIXES for p in folder.rglob("*")
        )
        note = " it reads (compressed files are not read: decompress them first)" if packed else ""
        raise UserError(
            f"data.source={spec!r} matches no file{note}; give an existing file, a directory of "
            f".txt/.jsonl/.parquet files, a glob like 'corpus/*.jsonl', 'hf:NAME' for a "
            f"Hugging Face dataset, or 'builtin' for the offline corpus"
        )
    compressed = [p for p in paths if p.suffix.lower() in COMPRESSED_SUFFIXES]
    if compressed:
        raise UserError(
            f"data.source={spec!r} matches compressed files ({', '.join(map(str, compressed[:3]))}"
            f"{', ...' if len(compressed) > 3 else ''}), which are not read; decompress them "
            f"(e.g. gunzip -k, zstd -d, xz -dk) and point data.source at the .txt/.jsonl/.parquet "
            f"files"
        )
    empty = [p for p in paths if p.stat().st_size == 0]
    if len(empty) == len(paths):
        raise UserError(
            f"data.source={spec!r}: every matched file is empty ({', '.join(map(str, empty[:3]))})"
        )
    # Documents are named relative to the corpus, so the val split does not depend on where it lies.
    root = Path(spec).expanduser() if Path(spec).expanduser().is_dir() else _common_parent(paths)
    return Source(spec, paths, text_field=text_field, root=root)


def _common_parent(paths: list[Path]) -> Path:
    return Path(os.path.commonpath([str(p.absolute().parent) for p in paths]))


def _expand(spec: str) -> list[Path]:
    suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
    path = Path(spec).expanduser()
    if path.is_dir():
        found = (p for p in path.rglob("*") if p.is_file())
        return sorted(p for p in found if p.suffix in suffixes)
    if path.is_file():
        return [path]
    return sorted(
        Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file()
    )


def open_source(data: DataConfig):
    """The source `data.source` names: a `Source` or an `HFSource` (same interface)."""
    if data.source == "builtin":
        return builtin_source()
    if data.source.startswith("hf:"):
        from scale_llm.data.hf_source import HFSource

        return HFSource(data)
    return local_source(data.source, data.text_field)
