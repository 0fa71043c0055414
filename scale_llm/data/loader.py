"""Batches from memory-mapped token shards, fixed by (seed, position) and resumable.

Windows of seq_len + 1 tokens are visited once per epoch in an order drawn from (seed, epoch); a
step's global batch is the next windows of that stream, rank r reading its contiguous slice, so a
step's sequences do not depend on the layout. The state is the stream position (docs/data.md)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from scale_llm.config.data import normalized_weights
from scale_llm.config.plan import RunPlan
from scale_llm.errors import UserError

log = logging.getLogger(__name__)


class TokenWindows:
    """Window i: tokens [i*seq_len, i*seq_len + seq_len + 1) of one shard; none cross shards."""

    def __init__(
        self,
        shards: list[np.ndarray],
        seq_len: int,
        vocab_size: int | None = None,
        names: list[str] | None = None,
    ):
        self.shards, self.seq_len, self.vocab_size, self.names = shards, seq_len, vocab_size, names
        counts = [max(0, (len(s) - 1) // seq_len) for s in shards]
        self.offsets = np.cumsum([0] + counts)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def get(self, indices: np.ndarray) -> torch.Tensor:
        """(len(indices), seq_len + 1) int64 tokens."""
        rows = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        shard_ids = np.searchsorted(self.offsets, indices, side="right") - 1
        for row, (i, s) in enumerate(zip(indices, shard_ids)):
            start = int(i - self.offsets[s]) * self.seq_len
            rows[row] = self.shards[s][start : start + self.seq_len + 1]
        if self.vocab_size is not None and len(rows) and int(rows.max()) >= self.vocab_size:
            # a damaged or foreign shard: the embedding would fail deep inside (a CUDA assert)
            row = int(np.argmax(rows.max(axis=1)))
            s = int(shard_ids[row])
            name = self.names[s] if self.names else f"shard {s}"
            raise UserError(
                f"{name} holds token id {int(rows[row].max())} at window {int(indices[row])}, "
                f"beyond model.vocab_size={self.vocab_size}: the shard is damaged or from "
                f"another tokenizer; run `scale-llm prepare CONFIG --force`"
            )
        return torch.from_numpy(rows)


PERIOD = 4096  # sequences after which a mixture's interleave of sources repeats


def period_counts(weights: list[float]) -> list[int]:
    """Each source's sequences in a period of PERIOD: its share by largest remainder, at least
    one (an overfilled period takes back from counts above one, smallest remainder first; a
    count raised to one is past its share, so it is the last to get a leftover slot)."""
    if len(weights) > PERIOD:
        raise ValueError(f"{len(weights)} sources: at most {PERIOD} fit in a period")
    exact = [share * PERIOD for share in normalized_weights(weights)]
    counts = [max(1, int(x)) for x in exact]
    short = PERIOD - sum(counts)
    if short > 0:
        by_remainder = sorted(range(len(weights)), key=lambda s: (counts[s] - exact[s], s))
        for s in by_remainder[:short]:
            counts[s] += 1
    while short < 0:  # (only when tiny weights were raised to one)
        above = [s for s in range(len(weights)) if counts[s] > 1]
        for s in sorted(above, key=lambda s: (exact[s] - int(exact[s]), s))[:-short]:
            counts[s] -= 1
            short += 1
    return counts


class SourceSchedule:
    """Which source stream position p reads, and which of that source's draws it is: each period
    holds `counts[s]` of source s at positions (j + 1/2) * PERIOD / counts[s], so any stretch
    of a period holds each share to within a sequence or two. Fixed by the weights alone."""

    def __init__(self, weights: list[float]):
        self.counts = np.array(period_counts(weights), dtype=np.int64)
        counts = self.counts.tolist()
        slots = sorted(((j + 0.5) * PERIOD / c, s) for s, c in enumerate(counts) for j in range(c))
        self.pattern = np.array([s for _, s in slots], dtype=np.int64)  # (PERIOD,)
        # before[s, r]: positions < r of the period that read source s
        onehot = self.pattern[None, :] == np.arange(len(counts))[:, None]
        self.before = np.concatenate(
            [np.zeros((len(counts), 1), np.int64), np.cumsum(onehot, axis=1)], axis=1
        )

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw) of each stream position: draw k is source's k-th sequence."""
        period, r = np.divmod(positions, PERIOD)
        source = self.pattern[r]
        return source, period * self.counts[source] + self.before[source, r]

    def drawn(self, position: int) -> np.ndarray:
        """How many sequences of each source the positions before `position` read."""
        period, r = divmod(position, PERIOD)
        return period * self.counts + self.before[:, r]


class TrainLoader:
    """This rank's micro-batches of each step's global batch, in a seeded, resumable order. With
    `prefetch` > 0 a thread reads the next batches ahead (the state never counts them)."""

    def __init__(
        self,
        windows: TokenWindows,
        plan: RunPlan,
        seed: int,
        prefetch: int = 0,
        sources: dict[str, tuple[float, int]] | None = None,
        repeat: bool = True,
    ):
        """`sources`: a mixture's {name: (weight, training windows)}, in `windows` in this order."""
        if len(windows) == 0:
            raise ValueError("no training windows")
        self.windows, self.seed, self.device, self.mixture = windows, seed, plan.device, sources
        sources = sources or {"": (1.0, len(windows))}
        self.names = list(sources)
        self.sizes = np.array([n for _, n in sources.values()], dtype=np.int64)
        self.bases = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        if self.sizes.sum() != len(windows) or not self.sizes.all():
            raise ValueError("the sources' windows do not add up to the windows given")
        self.schedule = SourceSchedule([w for w, _ in sources.values()])
        self.repeat, self.prefetch = repeat, prefetch
        self.micro_batch_size, self.grad_accum = plan.micro_batch_size, plan.grad_accum
        self.rank = plan.dp_rank  # this rank's place among the data-parallel ranks
        self.global_batch = plan.sequences_per_step
        self.position = 0  # sequences of the stream consumed so far, over all ranks
        self._perm: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, order)
        self._perm_lock = threading.Lock()
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="data-prefetch") if prefetch > 0 else None
        )
        self._ahead: deque[tuple[int, Future]] = deque()  # (stream position, its batch)

    def next_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """grad_accum pairs (inputs, targets), each (micro_batch_size, seq_len), on device."""
        tokens = self._take(self.position)  # (micro_batch_size * grad_accum, seq_len + 1)
        self._log_epoch_start(self.position)
        self.position += self.global_batch
        tokens = tokens.to(self.device, non_blocking=tokens.is_pinned())  # (async when pinned)
        return [(p[:, :-1], p[:, 1:]) for p in tokens.split(self.micro_batch_size)]

    def _read(self, position: int) -> torch.Tensor:
        """This rank's slice of the global batch that starts at stream `position`."""
        per_rank = self.micro_batch_size * self.grad_accum
        tokens = self.windows.get(self._stream_indices(position + self.rank * per_rank, per_rank))
        return tokens.pin_memory() if self.device.type == "cuda" else tokens

    def _take(self, position: int) -> torch.Tensor:
        if self._executor is None:
            return self._read(position)
        if not self._ahead or self._ahead[0][0] != position:  # first call, or after a reload
            self._drop_ahead()
            self._ahead.append((position, self._executor.submit(self._read, position)))
        _, future = self._ahead.popleft()
        while len(self._ahead) < self.prefetch:
            nxt = (self._ahead[-1][0] if self._ahead else position) + self.global_batch
            self._ahead.append((nxt, self._executor.submit(self._read, nxt)))
        return future.result()

    def _drop_ahead(self) -> None:
        for _, future in self._ahead:
            future.cancel()
        self._ahead.clear()

    def _log_epoch_start(self, position: int) -> None:
        before = self.schedule.drawn(position)  # (one source: `position` itself)
        after = self.schedule.drawn(position + self.global_batch)
        for s, name in enumerate(self.names):
            # the epochs of the draws before this batch and of its last one (-1: none yet)
            n = int(self.sizes[s])
            prev, last = int(before[s] - 1) // n, int(after[s] - 1) // n
            if last <= prev or last < 1:
                continue
            what = "the training data" if self.mixture is None else f"source {name}"
            if not self.repeat:
                raise UserError(
                    f"data.repeat=false: {what} ({n:,} training windows) is used up at stream "
                    f"position {position:,}; prepare more data, lower train.max_steps, or set "
                    f"data.repeat=true to read it again in a new order"
                )
            if self.mixture is None:
                log.info(
                    f"data: epoch {last} of {n} training windows begins (stream position "
                    f"{last * n}); the windows repeat in a new order"
                )
            else:
                log.warning(
                    f"data: {what} ran out after {last} epoch(s) of its {n} training windows; it "
                    f"is read again in a new order (stream position {position})"
                )

    def _stream_indices(self, first: int, count: int) -> np.ndarray:
        sources, draws = self.schedule.locate(np.arange(first, first + count))
        out = np.empty(count, dtype=np.int64)
        for j, (s, k) in enumerate(zip(sources.tolist(), draws.tolist())):
            n = int(self.sizes[s])
            out[j] = self.bases[s] + self._permutation(s, k // n)[k % n]
        return out

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        with self._perm_lock:  # the prefetch thread and the caller may both read
            cached = self._perm.get(source)
            if cached is None or cached[0] != epoch:
                # source 0 keeps the one-source key: a mixture of one source reads that stream
                rng = np.random.default_rng([self.seed, epoch] + ([source] if source else []))
                cached = self._perm[source] = (epoch, rng.permutation(int(self.sizes[source])))
            return cached[1]

    def drawn(self) -> dict[str, int]:
        """Sequences each source has given so far (a mixture's; one source: {})."""
        if self.mixture is None:
            return {}
        return dict(zip(self.names, self.schedule.drawn(self.position).tolist()))

    def epochs(self, steps: int, start: int = 0) -> dict[str, float]:
        """Epochs of each source's training windows that the stream to `steps` optimizer steps
        past position `start` (a resume's) reads."""
        drawn = self.schedule.drawn(start + steps * self.global_batch)
        return {name: float(drawn[s] / self.sizes[s]) for s, name in enumerate(self.names)}

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch `next_batches` returns (read-ahead not counted)."""
        state = {"position": self.position, "seed": self.seed, "num_windows": len(self.windows)}
        if self.mixture is not None:
            state["sources"] = {n: [float(w), int(k)] for n, (w, k) in self.mixture.items()}
            state["period_counts"] = self.schedule.counts.tolist()
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the saved stream position, whatever the world size or batch layout now."""
        if state["num_windows"] != len(self.windows) or state["seed"] != self.seed:
            log.warning(
                f"data: the checkpoint's data order (seed {state['seed']}, {state['num_windows']} "
                f"windows) differs from now (seed {self.seed}, {len(self.windows)} windows); "
                f"continuing at the same position of the new order"
            )
        saved, now = state.get("sources"), self.state_dict().get("sources")
        counts, counts_now = state.get("period_counts"), self.state_dict().get("period_counts")
        if saved == now and None not in (counts, counts_now) and counts != counts_now:
            log.warning(
                f"data: the checkpoint read its mixture's sources {counts} times in each "
                f"{PERIOD:,} sequences, this version {counts_now} times (the same weights, "
                f"rounded otherwise); continuing at the same stream position"
            )
        elif saved != now:
            log.warning(
                f"data: the checkpoint's mixture ({saved or 'one source'}) differs from now "
                f"({now or 'one source'}); continuing at the same stream position of the new "
                f"mixture"
            )
        self._drop_ahead()
        self.position = int(state["position"])

    def close(self) -> None:
        """Stop the prefetch thread (idempotent)."""
        self._drop_ahead()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def eval_batches(windows: TokenWindows, plan: RunPlan, steps: int):
    """(inputs, targets, rows to score) of `steps` global batches of validation windows, laid out
    like training batches, so the loss does not depend on the layout. Rows past the last window
    are computed (every rank runs the same shapes) but not scored."""
    n, mb = len(windows), plan.micro_batch_size
    scored = min(n, steps * plan.sequences_per_step)  # every window once where there are fewer
    per_rank = mb * plan.grad_accum
    for b in range(-(-scored // plan.sequences_per_step)):
        first = b * plan.sequences_per_step + plan.dp_rank * per_rank
        for k in range(plan.grad_accum):
            start = first + k * mb
            tokens = windows.get(np.arange(start, start + mb) % n).to(plan.device)
            yield tokens[:, :-1], tokens[:, 1:], min(mb, max(0, scored - start))
