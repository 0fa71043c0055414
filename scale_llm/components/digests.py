"""Checksums of checkpoint files, taken while the bytes are written (hashing after the save reads
every byte again): inside `recording()`, a file written front to back once through
`HashingFileSystem` is hashed in a second thread as it is written; others after the save."""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem

PARALLEL_MIN = 1 << 20  # buffers from 1 MiB are hashed in the helper thread during the write


class Recorded(dict):
    """{absolute path: (size, xxh3-64 hex)}, and `stalled_s`: the wall time hashing added to
    the writes (small buffers hashed inline, waits for the helper thread)."""

    stalled_s: float = 0.0


_lock = threading.Lock()
_recorded: Recorded | None = None
_pool: ThreadPoolExecutor | None = None


@contextlib.contextmanager
def recording() -> Iterator[Recorded]:
    """Collect size and digest of the files written through `HashingFileSystem` in this block."""
    global _recorded, _pool
    with _lock:
        if _recorded is not None:
            raise RuntimeError("digests.recording() does not nest")
        _recorded, _pool = Recorded(), ThreadPoolExecutor(1, thread_name_prefix="scale-llm-hash")
    try:
        yield _recorded
    finally:
        with _lock:
            pool, _recorded, _pool = _pool, None, None
        pool.shutdown(wait=True)


def file_digest(path: Path, mapped: bool = True) -> str:
    """xxh3-64 of a file: through mmap (files this process just wrote), or read in chunks (a file
    another process truncates meanwhile must not SIGBUS us)."""
    with open(path, "rb") as f:
        if mapped and os.fstat(f.fileno()).st_size > 0:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                return xxhash.xxh3_64(view).hexdigest()
        h = xxhash.xxh3_64()
        while chunk := f.read(8 << 20):
            h.update(chunk)
        return h.hexdigest()


def text_digest(text: str) -> str:
    """xxh3-64 of a string's UTF-8 bytes (e.g. a canonical JSON record)."""
    return xxhash.xxh3_64(text.encode("utf-8")).hexdigest()


_HEX16 = re.compile(r"[0-9a-f]{16}")


def is_digest(value: object) -> bool:
    """Whether `value` is an xxh3-64 digest as `file_digest` writes it (16 hex digits)."""
    return isinstance(value, str) and _HEX16.fullmatch(value) is not None


def _seconds(work: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    work()
    return time.perf_counter() - t0


class _HashingWriter:
    """A binary file opened for writing that hashes what passes through `write`."""

    def __init__(self, f: Any, pool: ThreadPoolExecutor):
        self._f, self._pool, self._hash = f, pool, xxhash.xxh3_64()
        self.written, self.sequential, self.stalled_s = 0, True, 0.0

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if view.nbytes >= PARALLEL_MIN:  # xxhash and the write both release the GIL
            hashed = self._pool.submit(self._hash.update, view)
            n = self._f.write(view)
            self.stalled_s += _seconds(hashed.result)  # the hash outlasting the write
        else:
            self.stalled_s += _seconds(lambda: self._hash.update(view))
            n = self._f.write(view)
        if n != view.nbytes:
            self.sequential = False
        self.written += view.nbytes
        return n

    def tell(self) -> int:
        pos = self._f.tell()
        if pos != self.written:
            self.sequential = False
        return pos

    def seek(self, *args: Any) -> int:
        self.sequential = False
        return self._f.seek(*args)

    def truncate(self, *args: Any) -> int:
        self.sequential = False
        return self._f.truncate(*args)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def __getattr__(self, name: str) -> Any:  # fileno, flush, close, closed, ...
        return getattr(self._f, name)


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording each file's digest while `recording()` is active."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with _lock:
            pool = _pool
        if pool is None or mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path).absolute()
        with _lock:
            if _recorded is not None:
                _recorded.pop(path, None)
        with open(path, "wb") as f:  # DCP / our savers: files inside a .tmp-step_N folder
            writer = _HashingWriter(f, pool)
            try:
                yield writer
            finally:
                with _lock:
                    if _recorded is not None:
                        _recorded.stalled_s += writer.stalled_s
        if writer.sequential:
            with _lock:
                if _recorded is not None:
                    _recorded[path] = (writer.written, writer.hexdigest())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with _lock:
            if _recorded is not None and (entry := _recorded.pop(Path(path).absolute(), None)):
                _recorded[Path(new_path).absolute()] = entry
