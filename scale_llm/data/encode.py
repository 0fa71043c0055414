"""Parallel, ordered tokenization: batches of documents go to `num_proc` worker processes and
come back in input order with a bounded number in flight, so memory stays flat and the output is
the same for every `num_proc`. This module imports no torch: workers start fast."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import multiprocessing
import os
import signal
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np

from scale_llm.data.documents import Document
from scale_llm.data.pretrained_tokenizer import PretrainedTokenizer
from scale_llm.data.shards import token_dtype
from scale_llm.data.tokenizer import Tokenizer, load_tokenizer
from scale_llm.errors import UserError

BATCH_CHARS = 1 << 20  # characters of text per batch sent to a worker
BATCH_DOCS = 1024  # and at most this many documents


def is_val_document(doc_id: str, val_fraction: float) -> bool:
    """Stable split: the same document lands in the same split whatever else the corpus holds."""
    digest = hashlib.blake2b(doc_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class EncodedBatch:
    tokens: np.ndarray  # every document as [BOS] ids [EOS] (doc_start ids doc_end), in order
    lengths: np.ndarray  # (documents,) int64: tokens of each document
    is_val: np.ndarray  # (documents,) bool: the document belongs to the validation split
    chars: int  # characters of text encoded


def encode_batch(
    tok: Tokenizer | PretrainedTokenizer, docs: list[tuple[str, str]], val_fraction: float
) -> EncodedBatch:
    """doc_start ids doc_end for each (doc_id, text), in one single-threaded encode call."""
    encoded = tok.encode_many([text for _, text in docs])
    dtype = token_dtype(tok.vocab_size)
    start, end = np.array(tok.doc_start, dtype=dtype), np.array(tok.doc_end, dtype=dtype)
    a, b = len(start), len(end)
    lengths = np.fromiter((len(ids) + a + b for ids in encoded), dtype=np.int64, count=len(docs))
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for ids, n in zip(encoded, lengths.tolist()):
        tokens[pos : pos + a] = start
        tokens[pos + a : pos + n - b] = ids
        tokens[pos + n - b : pos + n] = end
        pos += n
    is_val = np.array([is_val_document(doc_id, val_fraction) for doc_id, _ in docs], dtype=bool)
    return EncodedBatch(tokens, lengths, is_val, sum(len(text) for _, text in docs))


def batched(docs: Iterable[Document]) -> Iterator[list[tuple[str, str]]]:
    """Groups of (doc_id, text) of about BATCH_CHARS characters (at least one document each)."""
    batch: list[tuple[str, str]] = []
    chars = 0
    for d in docs:
        batch.append((d.doc_id, d.text))
        chars += len(d.text)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


_worker: dict = {}


def _init_worker(model_path: str, val_fraction: float, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # Linux: the kernel kills this worker when its parent dies, so no orphan keeps working
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    _worker.update(tok=load_tokenizer(model_path), val_fraction=val_fraction)


def _encode_in_worker(docs: list[tuple[str, str]]) -> EncodedBatch:
    return encode_batch(_worker["tok"], docs, _worker["val_fraction"])


@contextlib.contextmanager
def _stop_signals_after_spawn(spawning: bool):
    """SIGINT / SIGTERM held while a worker is spawned, delivered after: one landing between a
    worker's start and the parent's write of its start-up data ends that worker with an
    EOFError traceback (the handlers in place then run as usual, right after)."""
    if not spawning or threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda n, _: held.append(n)) for sig in stops}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(held):
            signal.raise_signal(sig)


class WorkersEnded(UserError):
    """An encoding worker ended before its batch was done (not the input's fault)."""


class Encoder:
    """Ordered map of `encode_batch` in `num_proc` processes (0: one per core) for over a batch."""

    def __init__(self, model_path: str | os.PathLike, val_fraction: float, num_proc: int = 0):
        self.model_path, self.val_fraction = str(model_path), val_fraction
        self.num_proc = num_proc or cpu_count()
        self._pool: ProcessPoolExecutor | None = None
        self.processes = 1  # worker processes used by the last map: 1 means this process

    def map(self, batches: Iterable[list[tuple[str, str]]]) -> Iterator[EncodedBatch]:
        batches = iter(batches)
        head = list(itertools.islice(batches, 2))
        if self.num_proc == 1 or len(head) < 2:
            tok = load_tokenizer(self.model_path)
            for batch in itertools.chain(head, batches):
                yield encode_batch(tok, batch, self.val_fraction)
            return
        self.processes = self.num_proc
        # spawn, not fork: the parent may hold torch / OpenMP threads that fork would copy
        self._pool = ProcessPoolExecutor(
            self.num_proc,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(self.model_path, self.val_fraction, os.getpid()),
        )
        pending: deque[Future] = deque()
        for batch in itertools.chain(head, batches):
            with _stop_signals_after_spawn(len(pending) < self.num_proc):
                pending.append(self._pool.submit(_encode_in_worker, batch))  # (may spawn one)
            if len(pending) >= 2 * self.num_proc:  # bounded: reading never runs far ahead
                yield self._result(pending.popleft())
        while pending:
            yield self._result(pending.popleft())

    def _result(self, future: Future) -> EncodedBatch:
        try:
            return future.result()
        except BrokenProcessPool:  # (a worker ended without a word to the pool: its own error
            raise WorkersEnded(  # went to stderr above, or the kernel's OOM killer ended it)
                f"data: a worker process of prepare's {self.num_proc} ended before its batch "
                f"was encoded (what it printed is above; without a message, the system may have "
                f"ended it for lack of memory). Fix what it printed, or set data.num_proc=1 to "
                f"encode in this process"
            ) from None

    def close(self, stopped: bool = False) -> None:
        """The workers' end: awaited, or (`stopped`: a Ctrl-C or SIGTERM, whose batches in flight
        are not kept) ended at once, so that a second signal finds nothing left to wait for."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if stopped:
            processes = list((getattr(pool, "_processes", None) or {}).values())
            for process in processes:
                process.terminate()
            for process in processes:  # (gone before the pool is shut: nothing left to feed)
                process.join(timeout=10)
            # a worker ended mid-send leaves the pool's reader waiting for the rest: this
            # process's end of the results pipe closed, the reader sees its end
            writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)
            with contextlib.suppress(OSError, AttributeError):
                writer.close()
        pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Encoder:
        return self

    def __exit__(self, kind: type | None, *exc) -> None:
        self.close(stopped=kind is not None and issubclass(kind, KeyboardInterrupt))
