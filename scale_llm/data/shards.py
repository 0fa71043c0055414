"""Token shards on disk: flat uint16/uint32 arrays plus a manifest.json that says what is complete.

A shard is written to a temporary name and renamed; the manifest is written last. A directory is
taken as prepared only when its manifest exists and every shard it lists has exactly the size the
manifest states, so an interrupted prepare is never mistaken for a finished one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from scale_llm.errors import UserError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends token ids to fixed-size shards named <split>_<index>.bin in `out_dir`."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, dtype: np.dtype):
        self.out_dir, self.split, self.dtype = out_dir, split, dtype
        self.buffer = np.empty(shard_tokens, dtype=dtype)
        self.filled = 0
        self.shards: list[dict[str, Any]] = []
        self.documents = 0

    def add(self, ids: list[int]) -> None:
        self.documents += 1
        arr = np.asarray(ids, dtype=self.dtype)
        while arr.size:
            n = min(arr.size, self.buffer.size - self.filled)
            self.buffer[self.filled : self.filled + n] = arr[:n]
            self.filled += n
            arr = arr[n:]
            if self.filled == self.buffer.size:
                self._flush()

    def close(self) -> dict[str, Any]:
        if self.filled:
            self._flush()
        return {
            "documents": self.documents,
            "tokens": sum(s["tokens"] for s in self.shards),
            "shards": self.shards,
        }

    def _flush(self) -> None:
        name = f"{self.split}_{len(self.shards):05d}.bin"
        write_atomic(self.out_dir / name, self.buffer[: self.filled].tobytes())
        self.shards.append({"file": name, "tokens": int(self.filled)})
        self.filled = 0


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    write_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=2).encode())


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
    if check_shards:
        problems = shard_problems(data_dir, manifest)
        if problems:
            raise UserError(
                f"data.dir={data_dir} is incomplete: {problems[0]}"
                f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; "
                f"run `scale-llm prepare CONFIG` again to rebuild it"
            )
    return manifest


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
