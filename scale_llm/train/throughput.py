"""The loop's clock: tokens/s since the last metric row, elapsed time, and an ETA measured from
the end of the first SETTLE steps (they hold one-off costs: compiling, first allocations)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

SETTLE = 2  # a launch's first steps, left out of the ETA


class Throughput:
    def __init__(
        self,
        tokens_per_step: int,
        max_steps: int,
        start_step: int,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.tokens_per_step, self.max_steps, self.clock = tokens_per_step, max_steps, clock
        now = clock()
        self.started, self.start_step = now, start_step
        self._window = (now, start_step)  # since the last metric row
        self._settled: tuple[float, int] | None = None

    def step_done(self, step: int) -> None:
        if self._settled is None and step >= self.start_step + SETTLE:
            self._settled = (self.clock(), step)

    def tokens_per_s(self, step: int) -> float:
        since, first = self._window
        return self.tokens_per_step * (step - first) / max(self.clock() - since, 1e-9)

    def row_written(self, step: int) -> None:
        self._window = (self.clock(), step)

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Time spent inside (a trace written between steps) is no step's: tokens/s leaves it
        out, on a metric row's step or any other."""
        t0 = self.clock()
        try:
            yield
        finally:
            since, first = self._window
            self._window = (since + self.clock() - max(t0, since), first)

    def elapsed(self) -> float:
        return self.clock() - self.started

    def eta(self, step: int) -> float | None:
        """Seconds to max_steps at the mean step time since the launch settled; None before."""
        if self._settled is None or step <= self._settled[1]:
            return None
        since, first = self._settled
        return (self.clock() - since) / (step - first) * (self.max_steps - step)

    def progress(self, step: int) -> str:
        eta = self.eta(step)
        return f"elapsed {duration(self.elapsed())} | eta {'?' if eta is None else duration(eta)}"


def duration(seconds: float) -> str:
    """2h03m, 4m05s, 12s."""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{sec:02d}s" if m else f"{sec}s"
