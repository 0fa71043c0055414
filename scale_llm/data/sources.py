"""Corpus sources: where documents come from, in a fixed order, with a cheap fingerprint.

`data.source` selects one:
  builtin          the running interpreter's standard library .py files (tens of MB, offline)
  PATH | DIR | GLOB  local .txt files (one document per file) or .jsonl files (one per line)
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

from scale_llm.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class Document:
    doc_id: str  # stable name: the file (and line) it came from; decides the train/val split
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
            name = str(f.relative_to(self.root)) if self.root else str(f)
            if f.suffix in JSONL_SUFFIXES:
                yield from self._jsonl_documents(f, name)
                continue
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
        text = self._read_text(f)
        for lineno, line in enumerate((text or "").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{f}:{lineno} is not valid JSON ({e.msg}); fix the line or "
                    f"remove the file from data.source"
                ) from None
            if not isinstance(record, dict) or self.text_field not in record:
                keys = list(record)[:8] if isinstance(record, dict) else type(record).__name__
                raise UserError(
                    f"{f}:{lineno} has no field {self.text_field!r} (found {keys}); "
                    f"set data.text_field to the field holding the text"
                ) from None
            value = record[self.text_field]
            if isinstance(value, str) and value.strip():
                yield Document(f"{name}:{lineno}", value)


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
        raise UserError(
            f"data.source={spec!r} matches no file; give an existing file, a "
            f"directory of .txt/.jsonl files, a glob like 'corpus/*.jsonl', or "
            f"'builtin' for the offline corpus"
        )
    empty = [p for p in paths if p.stat().st_size == 0]
    if len(empty) == len(paths):
        raise UserError(
            f"data.source={spec!r}: every matched file is empty ({', '.join(map(str, empty[:3]))})"
        )
    return Source(spec, paths, text_field=text_field)


def _expand(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    if path.is_dir():
        found = (p for p in path.rglob("*") if p.is_file())
        return sorted(p for p in found if p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES)
    if path.is_file():
        return [path]
    return sorted(
        Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file()
    )


def open_source(spec: str, text_field: str = "text") -> Source:
    if spec == "builtin":
        return builtin_source()
    if spec.startswith("hf:"):
        raise UserError(
            f"data.source={spec!r}: Hugging Face datasets are not supported in this "
            f"version; use 'builtin' or local .txt/.jsonl files"
        )
    return local_source(spec, text_field)
