"""Corpus sources: where documents come from, in a fixed order, with a cheap fingerprint.
`data.source`: `builtin` (the standard library's .py files), `hf:NAME` (hf_source.py), or local
files: .txt/.md/.py (a document per file), .jsonl (per line), .parquet (per row)."""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import logging
import os
import re
import stat
import sys
import sysconfig
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from scale_llm.data.documents import MAX_DOCUMENT_CHARS, Document, text_value
from scale_llm.errors import UserError
from scale_llm.files import JSONProblem, parse_json

if TYPE_CHECKING:
    from scale_llm.config import DataConfig

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".py", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSED_SUFFIXES = (".gz", ".tgz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".zip", ".7z")
KINDS = ("text", "jsonl", "parquet")
_KIND = {
    s: k for k, ss in zip(KINDS, (TEXT_SUFFIXES, JSONL_SUFFIXES, PARQUET_SUFFIXES)) for s in ss
}
_PARQUET_BATCH = 1024  # rows per Arrow record batch


def file_kind(path: Path) -> str | None:
    """'text', 'jsonl' or 'parquet' by the lower-cased suffix; None for any other."""
    return _KIND.get(path.suffix.lower())


@dataclass(eq=False)  # (compared and hashed as itself)
class Source:
    """A fixed, ordered list of files and how to read documents out of them."""

    spec: str
    files: list[Path]
    text_field: str = "text"
    skip_undecodable: bool = False
    root: Path | None = None
    not_read: dict[str, list[str]] = field(default_factory=dict)  # reason -> paths left out
    skipped: list[str] = field(default_factory=list, init=False)  # files not UTF-8, skipped

    def kinds(self) -> dict[str, int]:
        """Files of each kind; a file or glob reads an unknown suffix as plain text."""
        counts = Counter(file_kind(f) or "text" for f in self.files)
        return {kind: counts[kind] for kind in KINDS if counts[kind]}

    def describe(self) -> str:
        kinds = self.kinds()
        if len(kinds) == 1:
            files = f"{len(self.files)} {next(iter(kinds))} files, "
        else:
            each = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
            files = f"{len(self.files)} files: {each}; "
        skipped = sum(map(len, self.not_read.values()))
        extra = f"; {skipped} skipped" if skipped else ""
        return f"{self.spec} ({files}{self.total_bytes() / 1e6:.1f} MB{extra})"

    def fingerprint(self) -> str:
        """Changes when any file is added, removed, resized or touched (no content read)."""
        h = hashlib.sha256(f"{self.spec}|{self.text_field}".encode())
        for f in self.files:
            st = f.stat()
            h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode(errors="surrogateescape"))
        return h.hexdigest()

    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def name(self, f: Path) -> str:
        """A file's name in its documents' ids (the split is drawn from them): under the root."""
        name = f.absolute().relative_to(self.root.absolute()).as_posix() if self.root else str(f)
        return os.fsencode(name).decode(errors="backslashreplace")  # (a name not UTF-8: \xff)

    def documents(self) -> Iterator[Document]:
        for f in self.files:
            name = self.name(f)
            kind = file_kind(f)
            if kind == "jsonl":
                yield from self._jsonl_documents(f, name)
            elif kind == "parquet":
                yield from self._parquet_documents(f, name)
            elif (text := self._read_text(f)) and text.strip():
                yield Document(name, text)
        if n := len(self.skipped):
            log.info(
                f"data: skipped {n} file{'' if n == 1 else 's'} that {'is' if n == 1 else 'are'} "
                f"not UTF-8 ({_examples(self.skipped, self.root)})"
            )

    def _read_text(self, f: Path) -> str | None:
        """The whole file, refused before it is read when it is over MAX_DOCUMENT_CHARS bytes."""
        with open(f, "rb") as fh:
            too_long = os.fstat(fh.fileno()).st_size > MAX_DOCUMENT_CHARS
            data = b"" if too_long else fh.read(MAX_DOCUMENT_CHARS + 1)  # it may have grown
        if too_long or len(data) > MAX_DOCUMENT_CHARS:
            raise UserError(
                f"{f} is longer than {MAX_DOCUMENT_CHARS:,} bytes, the most one document (a "
                f"text file is one) may hold; split it into smaller files, or into the lines "
                f"of a .jsonl file (one document per line)"
            )
        try:
            return data.decode("utf-8-sig")  # (a byte-order mark is no text)
        except UnicodeDecodeError as e:
            if self.skip_undecodable:
                self.skipped.append(str(f))
                return None
            raise UserError(
                f"{f} is not valid UTF-8 (byte {e.start}); convert it to UTF-8 "
                f"or remove it from data.source"
            ) from None

    def _jsonl_documents(self, f: Path, name: str) -> Iterator[Document]:
        """One record per line, streamed (a line is read at most MAX_DOCUMENT_CHARS bytes)."""
        for lineno, raw in _lines(f, lambda: self._not_jsonl_hint(f)):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # (a leading BOM)
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{f}:{lineno} is not valid UTF-8 (byte {e.start} of the line); convert "
                    f"the file to UTF-8 or remove it from data.source"
                ) from None
            if not line.strip():
                continue
            try:
                record = parse_json(line)  # (nesting bounded: a hostile line is not a crash)
            except JSONProblem as e:
                raise UserError(
                    f"{f}:{lineno} is not valid JSON ({_json_reason(e)}); fix the line or "
                    f"remove the file from data.source{self._not_jsonl_hint(f)}"
                ) from None
            if not isinstance(record, dict) or self.text_field not in record:
                keys = list(record)[:8] if isinstance(record, dict) else type(record).__name__
                raise UserError(
                    f"{f}:{lineno} has no field {self.text_field!r} (found {keys}); "
                    f"set data.text_field to the field holding the text{self._not_jsonl_hint(f)}"
                )
            if text := text_value(record[self.text_field], f"{f}:{lineno}", self.text_field):
                yield Document(f"{name}:{lineno}", text)

    def _not_jsonl_hint(self, f: Path) -> str:
        """For a .json file, read as JSON Lines: it may be a stray metadata file."""
        if f.suffix.lower() != ".json":
            return ""
        others = [p.suffix for p in self.files if p != f and file_kind(p) == "jsonl"]
        suffix = max(sorted(set(others)), key=others.count) if others else ".jsonl"
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
        batches, row = pf.iter_batches(batch_size=_PARQUET_BATCH, columns=[self.text_field]), 0
        while True:
            try:  # (a damaged page: OSError; a string column not UTF-8: UnicodeDecodeError)
                batch = next(batches, None)
                values = [] if batch is None else batch.column(0).to_pylist()
            except Exception as e:
                raise UserError(
                    f"{f}{f' past row {row:,}' if row else ''} cannot be read ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:200]}); re-export it or remove it from "
                    f"data.source"
                ) from None
            if batch is None:
                return
            for value in values:
                row += 1
                if text := text_value(value, f"{f} row {row}", self.text_field):
                    yield Document(f"{name}:{row}", text)


def _lines(f: Path, hint: Callable[[], str]) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line; one over MAX_DOCUMENT_CHARS is refused, not read whole."""
    with open(f, "rb") as fh:
        for lineno, raw in enumerate(iter(lambda: fh.readline(MAX_DOCUMENT_CHARS + 1), b""), 1):
            if len(raw) > MAX_DOCUMENT_CHARS and not raw.endswith(b"\n"):
                raise UserError(
                    f"{f}:{lineno} is longer than {MAX_DOCUMENT_CHARS:,} bytes, the most one "
                    f"document may hold; split the document into several records (lines){hint()}"
                )
            yield lineno, raw


def _json_reason(problem: JSONProblem) -> str:
    """The decoder's reason without its position (the message names the line)."""
    reason = str(problem).removeprefix("not JSON: ")
    return re.sub(r": line \d+ column \d+ \(char \d+\)$", "", reason)


def builtin_source() -> Source:
    """The standard library's own .py files: real code, on every machine, no network."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if not {"site-packages", "__pycache__"} & set(p.parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    spec = f"builtin:python{sys.version_info.major}.{sys.version_info.minor}"
    return Source(spec, files, skip_undecodable=True, root=root)


def local_source(spec: str, text_field: str) -> Source:
    listing = _list_files(spec)
    if not (paths := listing.files):
        skipped = listing.summary()
        packed = " (compressed files are not read: decompress them first)"
        note = f" it reads{packed if 'compressed' in listing.not_read else ''}"
        raise UserError(
            f"data.source={spec!r} matches no file{note if skipped else ''}"
            f"{f'; it skips {skipped}' if skipped else ''}; give an existing file, a directory "
            f"of .txt/.jsonl/.parquet files, a glob like 'corpus/*.jsonl', 'hf:NAME' for a "
            f"Hugging Face dataset, or 'builtin' for the offline corpus"
        )
    if compressed := [str(p) for p in paths if p.suffix.lower() in COMPRESSED_SUFFIXES]:
        raise UserError(
            f"data.source={spec!r} matches compressed files ({_examples(compressed, None)}), "
            f"which are not read; decompress them (e.g. gunzip -k, zstd -d, xz -dk) and point "
            f"data.source at the .txt/.jsonl/.parquet files"
        )
    empty = [p for p in paths if p.stat().st_size == 0]
    if len(empty) == len(paths):
        raise UserError(
            f"data.source={spec!r}: every matched file is empty ({', '.join(map(str, empty[:3]))})"
        )
    if listing.not_read:
        log.warning("data.source=%r skips %s", spec, listing.summary(rules=True))
    # Documents are named relative to the corpus, so the val split does not depend on where it
    # lies: a folder, a glob's folder before its first wildcard (files added below it leave the
    # names as they were), a file's own folder.
    given = Path(spec).expanduser()
    literal = _literal_parts(given.parts)
    if given.is_dir():
        root = given
    elif literal < len(given.parts) and not given.is_file():
        root = Path(*given.parts[:literal]).absolute() if literal else Path.cwd()
    else:
        root = Path(os.path.commonpath([str(p.absolute().parent) for p in paths]))
    return Source(spec, paths, text_field=text_field, root=root, not_read=listing.not_read)


def _examples(paths: list[str], root: Path | None, n: int = 3) -> str:
    shown = [Path(p).relative_to(root).as_posix() if root else p for p in paths[:n]]
    return ", ".join(shown) + (", ..." if len(paths) > n else "")


# why a directory or glob source leaves a path out: (one, several, the rule or the fix)
_SKIP_REASONS = {
    "suffix": (
        "file with an unknown suffix",
        "files with unknown suffixes",
        "a directory reads .txt/.md/.py/.text, .jsonl/.json and .parquet files (suffixes in any "
        "case); a glob that names other files reads them as plain text",
    ),
    "compressed": ("compressed file", "compressed files", "decompress them to read them"),
    "duplicate": (
        "duplicate path",
        "duplicate paths",
        "each real file is read once, under its path with the fewest symlinks",
    ),
    "loop": (
        "symlinked directory that loops back",
        "symlinked directories that loop back",
        "a symlink into a directory being walked is not followed",
    ),
    "broken": ("broken symlink", "broken symlinks", ""),
    "special": ("file that is not a regular file", "files that are not regular files", ""),
    "unreadable": ("unreadable directory", "unreadable directories", "check their permissions"),
}


class _Listing:
    """The files a directory or glob source reads, and the paths it leaves out, by reason:
    walks like `glob.glob(recursive=True)`, but never into a loop of symlinked directories, and
    keeps one path per real file."""

    def __init__(self, base: Path, include_hidden: bool):
        self.base, self.include_hidden = base, include_hidden
        self.found: dict[Path, tuple[int, tuple[int, int]]] = {}  # path -> (symlinks, file id)
        self.not_read: dict[str, list[str]] = {}
        self.files: list[Path] = []

    def skip(self, reason: str, path: Path, note: str = "") -> None:
        self.not_read.setdefault(reason, []).append(self._name(path) + note)

    def _name(self, path: Path) -> str:
        inside = path.is_relative_to(self.base)
        return path.relative_to(self.base).as_posix() if inside else str(path)

    def summary(self, rules: bool = False) -> str:
        """'3 paths: 2 files with unknown suffixes (a.csv, b.log), 1 duplicate path (...)', and
        with `rules` why each is left out."""
        parts, notes = [], []
        for reason, (one, several, note) in _SKIP_REASONS.items():
            if paths := sorted(self.not_read.get(reason, [])):
                noun = one if len(paths) == 1 else several
                parts.append(f"{len(paths)} {noun} ({_examples(paths, None)})")
                notes += [note] if note else []
        total = sum(map(len, self.not_read.values()))
        if not parts:
            return ""
        why = "; ".join(notes) if rules else ""
        why = f". {why[:1].upper()}{why[1:]}" if why else ""
        return f"{total} path{'s' if total != 1 else ''}: {', '.join(parts)}{why}"

    def walk(self, directory: Path, parts: tuple[str, ...], ancestors: frozenset, links: int):
        """Match `parts` (pattern components) below `directory`; `ancestors`: the ids of the
        directories on the way, so a link back into one is seen."""
        head, rest = parts[0], parts[1:]
        if head == "**":
            self.walk(directory, rest, ancestors, links)  # zero directories
            for entry in self._entries(directory, "*"):
                self._descend(directory, entry, parts, ancestors, links)
        elif not glob.has_magic(head):  # a literal name: no listing, as glob does
            path = directory / head
            if rest and path.is_dir():
                self.walk(path, rest, ancestors | {_dir_id(path)}, links + path.is_symlink())
            elif not rest and os.path.lexists(path):
                self._candidate(path, links + path.is_symlink())
        else:
            for entry in self._entries(directory, head):
                if rest:
                    self._descend(directory, entry, rest, ancestors, links)
                else:
                    self._candidate(directory / entry.name, links + entry.is_symlink())

    def _entries(self, directory: Path, pattern: str) -> list[os.DirEntry]:
        """Entries of `directory` matching `pattern`, by name; hidden ones only where asked for."""
        try:
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name)
        except PermissionError:
            self.skip("unreadable", directory)
            return []
        except OSError:  # gone, or not a directory: the pattern matches nothing there
            return []
        hidden_ok = self.include_hidden or pattern.startswith(".")
        shown = [e for e in entries if hidden_ok or not e.name.startswith(".")]
        return [e for e in shown if fnmatch.fnmatch(e.name, pattern)]

    def _descend(self, directory: Path, entry: os.DirEntry, parts, ancestors, links) -> None:
        """Walk into `entry` if it is a directory, but not into an ancestor (a loop, reported)."""
        try:
            if not entry.is_dir():  # follows a symlink; from the directory listing otherwise
                return
            st = entry.stat()
        except OSError:
            return  # a broken link is no directory; where a file was wanted it is reported
        path, is_link = directory / entry.name, entry.is_symlink()
        if (st.st_dev, st.st_ino) in ancestors:
            self.skip("loop", path, f" -> {os.readlink(path)}" if is_link else "")
            return
        self.walk(path, parts, ancestors | {(st.st_dev, st.st_ino)}, links + is_link)

    def _candidate(self, path: Path, links: int) -> None:
        try:
            st = path.stat()
        except OSError:
            if path.is_symlink():
                self.skip("broken", path)
            return
        if stat.S_ISDIR(st.st_mode):
            return  # the pattern named a directory: glob's match, not a file to read
        if not stat.S_ISREG(st.st_mode):
            self.skip("special", path)
            return
        if path not in self.found or links < self.found[path][0]:
            self.found[path] = (links, (st.st_dev, st.st_ino))

    def finish(self, known_suffixes_only: bool) -> _Listing:
        """Apply the suffix rule (a directory source), then keep one path per real file."""
        by_file: dict[tuple[int, int], list[tuple[int, Path]]] = {}
        for path, (links, file_id) in self.found.items():
            if known_suffixes_only and file_kind(path) is None:
                compressed = path.suffix.lower() in COMPRESSED_SUFFIXES
                self.skip("compressed" if compressed else "suffix", path)
                continue
            by_file.setdefault(file_id, []).append((links, path))
        for paths in by_file.values():
            keep, *others = sorted(paths)  # fewest symlinks, then sorted order
            self.files.append(keep[1])
            for _, other in others:
                self.skip("duplicate", other, f" = {self._name(keep[1])}")
        self.files.sort()
        return self


def _list_files(spec: str) -> _Listing:
    """The files `spec` (a file, directory or glob) names, and what it leaves out."""
    path = Path(spec).expanduser()
    if path.is_dir():
        listing = _Listing(path, include_hidden=True)
        listing.walk(path, ("**", "*"), frozenset({_dir_id(path)}), 0)
        return listing.finish(known_suffixes_only=True)
    if path.is_file():
        listing = _Listing(path.parent, include_hidden=True)
        listing.files = [path]
        return listing
    pattern = os.path.expanduser(spec)
    if pattern.endswith(os.sep):  # glob: a trailing separator matches directories only
        return _Listing(path, include_hidden=False)
    parts = list(Path(pattern).parts)
    literal = next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))
    base = Path(*parts[:literal]) if literal else Path()
    rest: list[str] = []
    for part in parts[literal:]:
        if part != "**" or rest[-1:] != ["**"]:  # **/** matches what ** does
            rest.append(part)
    if rest[-1:] == ["**"]:  # a final ** names every file below, like **/*
        rest.append("*")
    listing = _Listing(base, include_hidden=False)
    if rest and base.is_dir():
        listing.walk(base, tuple(rest), frozenset({_dir_id(base)}), 0)
    return listing.finish(known_suffixes_only=False)


def _dir_id(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


def open_source(data: DataConfig):
    """The source `data.source` names: a `Source` or an `HFSource` (same interface)."""
    if data.source == "builtin":
        return builtin_source()
    if data.source.startswith("hf:"):
        from scale_llm.data.hf_source import HFSource

        return HFSource(data)
    return local_source(data.source, data.text_field)


PREPARE_WRITES = (
    "prepare would write its tokenizer and shards into the corpus and read them back as documents "
    "the next time"
)


def refuse_overlap(
    data: DataConfig,
    written: Collection[str],
    data_dir: str | None = None,
    key: str = "data.dir",
    writes: str = PREPARE_WRITES,
    shown: str | None = None,
):
    """data.dir (or `data_dir`: a mixture's own; the run dir, `shown` in the message and set by
    `key`) apart from what the corpus reads, for prepare (it writes there): inside a source
    folder (through a symlinked folder in it too, unless `shown`: the run dir's check, at every
    launch, does not walk the corpus), or where a glob matches a name written there
    (`written`), it would write into the corpus and read its own files back as documents."""
    data_dir = data_dir or data.dir
    out = Path(os.path.realpath(Path(data_dir).expanduser()))
    spec = Path(data.source.removeprefix("hf:")).expanduser()
    if data.source == "builtin" or spec.is_file():
        return
    if spec.is_dir():  # (an hf: name that is a local folder too: its data files are read)
        inside = out.is_relative_to(os.path.realpath(spec))
        folders = {os.path.realpath(spec)} if inside or shown else _folders_read(spec)
        if not any(str(p) in folders for p in (out, *out.parents)):
            return
        where = f"lies inside the corpus folder {spec} that data.source reads"
        if not out.is_relative_to(os.path.realpath(spec)):
            where += " (through a symlinked folder in it)"
    elif data.source.startswith("hf:"):  # a dataset on the Hub
        return
    else:  # a glob: matched part by part as _Listing walks it (`**`, no hidden names)
        parts = spec.parts
        literal = _literal_parts(parts)
        base = Path(os.path.realpath(Path(*parts[:literal]) if literal else Path()))
        reach = [out.relative_to(base).parts] if out.is_relative_to(base) else []
        spans = len(parts) - literal > 1 or "**" in parts[literal:]  # (folders below base)
        if not reach and not shown and spans:  # (through a folder link)
            below = _folders_read(base).items()
            reach = [(*n, *out.relative_to(f).parts) for f, n in below if out.is_relative_to(f)]
        if not any(_glob_matches((*r, name), parts[literal:]) for r in reach for name in written):
            return
        where = "is a folder whose files the glob in data.source matches"
    shown = f"{shown} {data_dir}" if shown else f"{key}={data_dir}"
    raise UserError(
        f"{shown} {where} (data.source={data.source}): {writes}, so it stops before any work. "
        f"Point {key} at a folder outside the corpus"
    )


def _folders_read(top: Path) -> dict[str, tuple[str, ...]]:
    """The real paths of `top` and of every folder below it, through symlinked folders too (the
    walk follows them), each with the names below `top` that reach it first: the folders a
    folder source, or a glob over folders, reads."""
    seen: dict[str, tuple[str, ...]] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(os.path.realpath(top), ())]
    while todo:
        folder, names = todo.pop()
        if folder in seen:
            continue
        seen[folder] = names
        try:
            with os.scandir(folder) as entries:
                todo += [(os.path.realpath(e), (*names, e.name)) for e in entries if _folder(e)]
        except OSError:  # (unreadable: the listing names it)
            pass
    return seen


def _literal_parts(parts: tuple[str, ...]) -> int:
    """How many of a path's parts come before its first wildcard (a glob's own folder)."""
    return next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))


def _folder(entry: os.DirEntry) -> bool:
    """A folder, or a link that may become one (data.dir's own, before prepare makes it)."""
    return entry.is_dir() or (entry.is_symlink() and not os.path.exists(entry))


def _glob_matches(parts: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """Whether a path (its parts below the glob's literal folder) is one the glob reads."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return _glob_matches(parts, pattern[1:]) or (
            bool(parts) and not parts[0].startswith(".") and _glob_matches(parts[1:], pattern)
        )
    if not parts or (parts[0].startswith(".") and not pattern[0].startswith(".")):
        return False
    return fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_matches(parts[1:], pattern[1:])
