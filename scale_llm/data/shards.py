"""Token shards on disk: flat uint16/uint32 arrays plus a manifest.json that says what is complete.

A shard is filled under a `.partial` name and renamed when complete; the manifest is written last.
A directory is taken as prepared only when its manifest exists, every shard it lists has exactly
the size the manifest states and the tokenizer file has the recorded SHA-256, so an interrupted
prepare is never mistaken for a finished one. While prepare runs, progress.json records a point it
can continue from (shards done, tokens in the partial shard, documents read).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from scale_llm.data.tokenizer import file_sha256
from scale_llm.errors import UserError

MANIFEST = "manifest.json"
PROGRESS = "progress.json"  # checkpoint of a prepare in progress; removed when it finishes
FORMAT_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends token ids to fixed-size shards <split>_<index>.bin in `out_dir`.

    The shard being filled is written to <split>_<index>.bin.partial and renamed only once it
    holds exactly `shard_tokens` tokens (or the split ends), so a complete name always means a
    complete shard. `state()` after `sync()` is a point an interrupted prepare can continue from.
    """

    def __init__(
        self,
        out_dir: Path,
        split: str,
        shard_tokens: int,
        dtype: np.dtype,
        state: dict[str, Any] | None = None,
    ):
        self.out_dir, self.split, self.dtype = out_dir, split, np.dtype(dtype)
        self.shard_tokens = shard_tokens
        state = state or {"shards": [], "partial_tokens": 0, "documents": 0, "last_doc": 0}
        self.shards: list[dict[str, Any]] = [dict(s) for s in state["shards"]]
        self.partial_tokens = int(state["partial_tokens"])
        self.documents = int(state["documents"])
        self.last_doc = int(state["last_doc"])  # tokens of the last document added
        self._file: Any = None
        self._restore()

    @property
    def partial_path(self) -> Path:
        return self.out_dir / f"{self.split}_{len(self.shards):05d}.bin.partial"

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self.partial_tokens

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
        return self.state()

    def state(self) -> dict[str, Any]:
        return {
            "shards": [dict(s) for s in self.shards],
            "partial_tokens": self.partial_tokens,
            "documents": self.documents,
            "last_doc": self.last_doc,
        }

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
        return {"documents": self.documents, "tokens": self.tokens, "shards": self.shards}

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
        self.shards.append({"file": final.name, "tokens": self.partial_tokens})
        self.partial_tokens = 0

    def _restore(self) -> None:
        """Bring the files back to the state given: shards listed, partial cut to its length.

        Raises StaleProgress when the files on disk cannot give that state.
        """
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


class StaleProgress(Exception):
    """The checkpoint of an interrupted prepare does not match the files: start afresh."""


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    write_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=2).encode())


def _missing_keys(manifest: dict[str, Any]) -> list[str]:
    """The keys training reads from a manifest that this one lacks (or holds in another shape)."""
    missing = [k for k in ("dtype", "splits", "tokenizer") if k not in manifest]
    tok = manifest.get("tokenizer")
    if isinstance(tok, dict):
        missing += [f"tokenizer.{k}" for k in ("file", "sha256", "vocab_size") if k not in tok]
    elif "tokenizer" in manifest:
        missing.append("tokenizer (a mapping)")
    splits = manifest.get("splits")
    if isinstance(splits, dict):
        for name in ("train", "val"):
            split = splits.get(name)
            shards = split.get("shards") if isinstance(split, dict) else None
            if not isinstance(shards, list) or not all(
                isinstance(x, dict) and "file" in x and "tokens" in x for x in shards
            ):
                missing.append(f"splits.{name}.shards (files and token counts)")
    elif "splits" in manifest:
        missing.append("splits (a mapping)")
    return missing


def read_manifest(data_dir: str | Path, check_shards: bool = True) -> dict[str, Any]:
    """The manifest of a prepared data dir, with every listed shard checked for its size."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not path.is_file():
        raise UserError(
            f"data.dir={data_dir} holds no prepared shards ({MANIFEST} missing); "
            f"run `scale-llm prepare CONFIG` first, or point data.dir at a prepared "
            f"directory"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(
            f"{path} is corrupt ({e.msg}); delete it and run `scale-llm prepare CONFIG` again"
        ) from None
    if manifest.get("format") != FORMAT_VERSION:
        raise UserError(
            f"{path} has format {manifest.get('format')}, this version reads "
            f"{FORMAT_VERSION}; run `scale-llm prepare CONFIG` again"
        )
    missing = _missing_keys(manifest)
    if missing:
        raise UserError(
            f"{path} lacks {', '.join(missing)} (edited by hand, or cut short); run "
            f"`scale-llm prepare CONFIG --force` to rebuild data.dir={data_dir}"
        )
    if check_shards:
        problems = shard_problems(data_dir, manifest)
        if problems:
            raise UserError(
                f"data.dir={data_dir} is incomplete: {problems[0]}"
                f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; "
                f"run `scale-llm prepare CONFIG` again to rebuild it"
            )
        check_tokenizer(data_dir, manifest)
    return manifest


def check_tokenizer(data_dir: Path, manifest: dict[str, Any]) -> None:
    """Refuse shards whose tokenizer file is not the one they were encoded with."""
    problem = tokenizer_problem(data_dir, manifest)
    if problem:
        raise UserError(
            f"{problem}: every token id would mean something else. Restore the original "
            f"file or run `scale-llm prepare CONFIG --force` to rebuild"
        )


def tokenizer_problem(data_dir: Path, manifest: dict[str, Any]) -> str | None:
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
    try:
        return json.loads((out_dir / PROGRESS).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_progress(out_dir: Path, progress: dict[str, Any]) -> None:
    write_atomic(out_dir / PROGRESS, json.dumps(progress, indent=1).encode())


def shard_problems(data_dir: Path, manifest: dict[str, Any]) -> list[str]:
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
