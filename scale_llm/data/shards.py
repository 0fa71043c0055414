"""Token shards on disk: flat uint16/uint32 arrays plus a manifest.json that says what is complete.

A directory is prepared only when every shard its manifest lists has its size and the tokenizer
its SHA-256. progress.json records a point an interrupted prepare can continue from."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from scale_llm.data.tokenizer import file_sha256
from scale_llm.errors import UserError
from scale_llm.files import atomic_write_text, describe_kind, read_json

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
PROGRESS = "progress.json"  # checkpoint of a prepare in progress; removed when it finishes
FORMAT_VERSION = 1
DTYPES = ("uint16", "uint32")
_COUNTS = ("partial_tokens", "documents", "last_doc")  # a split's state beside its shards


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends token ids to shards <split>_<index>.bin of `shard_tokens` in `out_dir` (prepare's
    own build folder), each filled as .bin.partial and renamed when complete. What `sync()`
    returns is a point an interrupted prepare can continue from."""

    def __init__(
        self, out_dir: Path, split: str, shard_tokens: int, dtype: np.dtype, state: dict | None
    ):
        self.out_dir, self.split, self.dtype = out_dir, split, np.dtype(dtype)
        self.shard_tokens = shard_tokens
        state = state or {"shards": [], **dict.fromkeys(_COUNTS, 0)}
        self.shards: list[dict[str, Any]] = [dict(s) for s in state["shards"]]
        # last_doc: tokens of the last document added
        self.partial_tokens, self.documents, self.last_doc = (int(state[k]) for k in _COUNTS)
        self._file: Any = None
        self._restore()

    @property
    def partial_path(self) -> Path:
        return self.out_dir / f"{self.split}_{len(self.shards):05d}.bin.partial"

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> int:
        """Append whole documents (`lengths` tokens each); returns the shards completed."""
        self.documents += len(lengths)
        if len(lengths):
            self.last_doc = int(lengths[-1])
        completed = 0
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            n = min(tokens.size, self.shard_tokens - self.partial_tokens)
            self._open().write(tokens[:n].tobytes())
            self.partial_tokens += n
            tokens = tokens[n:]
            if self.partial_tokens == self.shard_tokens:
                self._complete()
                completed += 1
        return completed

    def sync(self) -> dict[str, Any]:
        """Everything added so far is on disk; returns the state to continue from."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        return {"shards": [dict(s) for s in self.shards], **{k: getattr(self, k) for k in _COUNTS}}

    def pop_last_document(self) -> np.ndarray | None:
        """Take back the last document added, if it lies wholly in the unfinished shard."""
        n = self.last_doc
        if not n or n > self.partial_tokens:
            return None
        self.sync()
        keep = (self.partial_tokens - n) * self.dtype.itemsize
        data = np.fromfile(self.partial_path, dtype=self.dtype, offset=keep)
        os.truncate(self.partial_path, keep)  # the file is opened for append: writes follow
        self.partial_tokens -= n
        self.documents -= 1
        self.last_doc = 0
        return data

    def close(self) -> dict[str, Any]:
        """Finish the last (shorter) shard; returns the split's entry for the manifest."""
        if self.partial_tokens:
            self._complete()
        elif self._file is not None:
            self._file.close()
            self._file = None
            self.partial_path.unlink(missing_ok=True)
        tokens = sum(s["tokens"] for s in self.shards)  # (none left in a partial shard)
        return {"documents": self.documents, "tokens": tokens, "shards": self.shards}

    def _open(self) -> Any:
        if self._file is None:  # stays open across add() calls: closed in _complete / close
            self._file = open(self.partial_path, "ab")  # noqa: SIM115
        return self._file

    def _complete(self) -> None:
        f = self._open()
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._file = None
        final = self.partial_path.with_suffix("")  # drop ".partial"
        self.partial_path.replace(final)
        with open(final, "rb") as f:  # (read back from the page cache: what a resume compares)
            sha = hashlib.file_digest(f, "sha256").hexdigest()
        self.shards.append({"file": final.name, "tokens": self.partial_tokens, "sha256": sha})
        self.partial_tokens = 0

    def _restore(self) -> None:
        """Bring the files back to the state given (StaleProgress where they cannot)."""
        itemsize = self.dtype.itemsize
        for shard in self.shards:
            path = self.out_dir / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["tokens"] * itemsize:
                raise StaleProgress(f"shard {path} is missing or has the wrong size")
        partial, want = self.partial_path, self.partial_tokens * itemsize
        completed_since = partial.with_suffix("")  # the shard was finished after the checkpoint
        if not partial.exists() and completed_since.exists() and want:
            completed_since.replace(partial)
        for extra in self.out_dir.glob(f"{self.split}_*.bin*"):
            if extra.name not in {s["file"] for s in self.shards} | {partial.name}:
                extra.unlink()  # written after the checkpoint: it will be written again
        if want:
            if not partial.is_file() or partial.stat().st_size < want:
                raise StaleProgress(f"{partial} holds fewer tokens than the checkpoint says")
            os.truncate(partial, want)
        else:  # (tokens written after the checkpoint: written again, never appended to)
            partial.unlink(missing_ok=True)


class StaleProgress(Exception):
    """The checkpoint of an interrupted prepare does not match the files: start afresh."""


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    """Into prepare's own build folder: the last file of a complete build."""
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2))


# The state files are read back only after every field is checked for its type and range: a
# record edited by hand or cut short must never reach numpy or a path join.
_MISSING = object()


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _file_name(x: Any) -> bool:
    """A plain name inside data.dir (no folder, nothing that leaves it)."""
    return isinstance(x, str) and x not in ("", ".", "..") and not re.search(r"[/\\\0]", x)


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:30] + "..."


class _Shape:
    """Collects where a JSON tree lacks a key or holds a value of another type."""

    def __init__(self) -> None:
        self.missing: list[str] = []
        self.wrong: list[str] = []

    def get(self, tree: Any, key: str, ok: Callable[[Any], bool], what: str, at: str = "") -> Any:
        """tree[key] if it passes `ok` (else _MISSING, with the problem recorded at `at`.key)."""
        where, value = f"{at}.{key}" if at else key, tree.get(key, _MISSING)
        if value is _MISSING:
            self.missing.append(where)
        elif not ok(value):
            self.wrong.append(f"{where} is {_shown(value)}, not {what}")
            return _MISSING
        return value

    def shards(self, split: dict, where: str, name_ok: Callable[[Any], bool]) -> None:
        shards = self.get(split, "shards", lambda x: isinstance(x, list), "a list", where)
        for i, shard in enumerate([] if shards is _MISSING else shards):
            at = f"{where}.shards[{i}]"
            if not isinstance(shard, dict):
                self.wrong.append(f"{at} is {_shown(shard)}, not a mapping of file and tokens")
                return
            self.get(shard, "file", name_ok, "a shard's file name in the folder", at)
            self.get(
                shard, "tokens", lambda x: _count(x) and x > 0, "a count of tokens, 1 or more", at
            )
            if self.wrong:
                return  # one bad shard is enough to name

    def problems(self) -> list[str]:
        return ([f"lacks {', '.join(self.missing)}"] if self.missing else []) + self.wrong


def manifest_problems(manifest: dict[str, Any]) -> list[str]:
    """What in a manifest is missing or of another type than prepare writes (["lacks a", ...])."""
    shape = _Shape()
    is_dict = lambda x: isinstance(x, dict)
    shape.get(manifest, "dtype", lambda x: x in DTYPES, " or ".join(DTYPES))
    if (tok := shape.get(manifest, "tokenizer", is_dict, "a mapping")) is not _MISSING:
        shape.get(tok, "file", _file_name, "a file name in the folder", "tokenizer")
        shape.get(tok, "sha256", lambda x: isinstance(x, str), "a SHA-256", "tokenizer")
        shape.get(
            tok, "vocab_size", lambda x: _count(x) and x > 0, "a count of pieces", "tokenizer"
        )
    if (splits := shape.get(manifest, "splits", is_dict, "a mapping")) is not _MISSING:
        for name in sorted({"train", "val", *splits}, key=str):
            if (split := shape.get(splits, name, is_dict, "a mapping", "splits")) is _MISSING:
                continue
            for key in ("documents", "tokens"):
                shape.get(split, key, _count, "a count", f"splits.{name}")
            shape.shards(split, f"splits.{name}", _file_name)
    if not shape.problems() and manifest["dtype"] != token_dtype(tok["vocab_size"]).name:
        shape.wrong.append(  # (ids above 65,535 stored in uint16 read back as others)
            f"dtype is {manifest['dtype']}, but its tokenizer's {tok['vocab_size']:,} ids are "
            f"stored as {token_dtype(tok['vocab_size'])}"
        )
    return shape.problems()


def progress_problems(progress: Any) -> list[str]:
    """What in prepare's progress.json is missing or of another type than prepare writes."""
    if not isinstance(progress, dict):
        return [f"it holds a JSON {type(progress).__name__}, not an object"]
    shape = _Shape()
    for key in ("fingerprint", "tokenizer_sha256"):
        shape.get(progress, key, lambda x: isinstance(x, str), "a string")
    shape.get(progress, "dtype", lambda x: x in DTYPES, " or ".join(DTYPES))
    for key in ("documents_read", "tokens"):
        shape.get(progress, key, _count, "a count")
    shape.get(progress, "capped", lambda x: isinstance(x, bool), "true or false")
    is_splits = lambda x: isinstance(x, dict) and set(x) == {"train", "val"}
    splits = shape.get(progress, "splits", is_splits, "a mapping of train and val")
    for name, state in ({} if splits is _MISSING else splits).items():
        if state is None:
            continue  # (no shard written yet)
        where = f"splits.{name}"
        if not isinstance(state, dict):
            shape.wrong.append(f"{where} is {_shown(state)}, not a mapping")
            continue
        for key in _COUNTS:
            shape.get(state, key, _count, "a count", where)
        own = re.compile(rf"{re.escape(name)}_\d+\.bin")  # ShardWriter's names, nothing else
        shape.shards(state, where, lambda x, own=own: isinstance(x, str) and own.fullmatch(x))
    return shape.problems()


def manifest_files(manifest: Any) -> set[str]:
    """The names in data.dir a manifest accounts for (its shards and tokenizer), from whatever it
    holds: an entry of another shape accounts for nothing."""
    if not isinstance(manifest, dict):
        return set()
    entries, splits = [manifest.get("tokenizer")], manifest.get("splits")
    for split in splits.values() if isinstance(splits, dict) else ():
        shards = split.get("shards") if isinstance(split, dict) else None
        entries += shards if isinstance(shards, list) else []
    files = [e.get("file") for e in entries if isinstance(e, dict)]
    return {Path(file).name for file in files if isinstance(file, str)}


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """The manifest of a prepared data dir, every field checked, and its shards' sizes."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not (path.exists() or path.is_symlink()):
        raise UserError(
            f"data.dir={data_dir} holds no prepared shards ({MANIFEST} missing); run `scale-llm "
            f"prepare CONFIG` first, or point data.dir at a prepared directory"
        )
    unreadable = (
        f"it cannot say which files in data.dir={data_dir} are prepare's, so prepare will not "
        f"replace them: prepare into a new folder (another data.dir), or move this folder's "
        f"{MANIFEST}, shards (train_*.bin, val_*.bin) and tokenizer.model away and run "
        f"`scale-llm prepare CONFIG` again"
    )
    if not path.is_file():  # (a named pipe would block the read)
        raise UserError(
            f"{path} is {describe_kind(path)}, not the manifest prepare writes; {unreadable}"
        )
    what = f"the manifest of data.dir={data_dir}"
    manifest = read_json(path, what, unreadable, kind=object)  # (bounded: size, nesting)
    if not isinstance(manifest, dict):
        kind = type(manifest).__name__
        raise UserError(f"{path} ({what}) holds a JSON {kind}, not an object; {unreadable}")
    if manifest.get("format") != FORMAT_VERSION or isinstance(manifest.get("format"), bool):
        raise UserError(
            f"{path} has format {_shown(manifest.get('format'))}, this version reads "
            f"{FORMAT_VERSION}; run `scale-llm prepare CONFIG` again"
        )
    if problems := manifest_problems(manifest):
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise UserError(
            f"{path} {'; '.join(problems[:4])}{more} (edited by hand, or cut short); run "
            f"`scale-llm prepare CONFIG --force` to rebuild data.dir={data_dir}"
        )
    if problems := shard_problems(data_dir, manifest):
        raise UserError(
            f"data.dir={data_dir} is incomplete: {problems[0]}"
            f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; "
            f"run `scale-llm prepare CONFIG` again to rebuild it"
        )
    check_tokenizer(data_dir, manifest)
    return manifest


def check_tokenizer(data_dir: Path, manifest: dict[str, Any]) -> None:
    """Refuse shards whose tokenizer file is not the one they were encoded with."""
    if problem := tokenizer_problem(data_dir, manifest):
        raise UserError(
            f"{problem}: every token id would mean something else. Restore the original "
            f"file or run `scale-llm prepare CONFIG --force` to rebuild"
        )


def tokenizer_problem(data_dir: Path, manifest: dict[str, Any]) -> str | None:
    """Why the tokenizer file of a well-formed manifest is not the one it records (None: it is)."""
    path = Path(data_dir) / manifest["tokenizer"]["file"]
    want = manifest["tokenizer"]["sha256"]
    got = file_sha256(path) if path.is_file() else None
    if got == want:
        return None
    found = f"SHA-256 {got[:12]}" if got else "missing"
    return (
        f"{path} is not the tokenizer the shards in data.dir={data_dir} were made with "
        f"({found}; {MANIFEST} says {want[:12]})"
    )


def read_progress(out_dir: Path) -> dict[str, Any] | None:
    """The record of an interrupted prepare in its build folder, or None: none there, or
    damaged (starting afresh, said in one line). A folder or pipe in its place is an error."""
    path = out_dir / PROGRESS
    if not (path.exists() or path.is_symlink()):
        return None
    if not path.is_file():
        raise UserError(
            f"{path} is {describe_kind(path)}, where prepare keeps its progress record (a "
            f"file); move it away and run `scale-llm prepare CONFIG` again"
        )
    what = "prepare's progress record"
    try:  # (any JSON value: progress_problems names a wrong type)
        progress = read_json(path, what, "starting afresh", kind=object)
    except UserError as e:  # its reason, without the path and the fix repeated
        problems = [str(e).removeprefix(f"{path} ({what}) ").removesuffix("; starting afresh")]
    else:
        problems = progress_problems(progress)
    if problems:
        log.info("data: %s is damaged (%s); starting the prepare afresh", path, problems[0])
        return None
    return progress


def write_progress(out_dir: Path, progress: dict[str, Any]) -> None:
    atomic_write_text(out_dir / PROGRESS, json.dumps(progress, indent=1))  # (the build's)


def shard_problems(data_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """Why the shards a manifest lists are not all there at their sizes (empty: they are)."""
    shape = manifest_problems(manifest) if isinstance(manifest, dict) else ["not a mapping"]
    if shape:
        return [f"{MANIFEST} {shape[0]}"]
    itemsize = np.dtype(manifest["dtype"]).itemsize
    problems = []
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            path = data_dir / shard["file"]
            want = shard["tokens"] * itemsize
            if not path.is_file():
                problems.append(f"shard {path} is missing")
            elif path.stat().st_size != want:
                problems.append(
                    f"shard {path} has {path.stat().st_size} bytes, expected {want} "
                    f"(truncated or overwritten)"
                )
    return problems


def open_split(data_dir: str | Path, manifest: dict[str, Any], split: str) -> list[np.ndarray]:
    """Read-only memory maps of one split's shards, in order."""
    dtype = np.dtype(manifest["dtype"])
    if split not in manifest["splits"] or not manifest["splits"][split]["shards"]:
        raise UserError(
            f"data.dir={data_dir} has no '{split}' tokens; run `scale-llm prepare` "
            f"with a larger corpus or a different data.val_fraction"
        )
    return [
        np.memmap(Path(data_dir) / s["file"], dtype=dtype, mode="r", shape=(s["tokens"],))
        for s in manifest["splits"][split]["shards"]
    ]
