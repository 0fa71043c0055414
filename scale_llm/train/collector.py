"""Python's garbage collector, run by the loop (every train.gc_every steps, all ranks alike)
instead of by allocation counts: a mid-step scan on one rank stalls every rank at the next
collective. The set-up's objects are frozen out of every scan; gc_every 0 leaves it automatic."""

from __future__ import annotations

import gc

from scale_llm.train.callbacks import Callback, StepEnd, Trainer


class GarbageCollector(Callback):
    def __init__(self, every: int):
        self.every = every
        self.collecting = False  # inside one of our collections (the test's witness)
        self._was_enabled = gc.isenabled()

    def start(self, trainer: Trainer) -> None:
        if self.every:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self.collect(2)
            gc.freeze()  # the objects of the set-up: never scanned again

    def step_end(self, trainer: Trainer, s: StepEnd) -> None:
        if self.every and s.step % self.every == 0:
            self.collect(1)

    def before_checkpoint(self) -> None:
        if self.every:
            self.collect(2)

    def collect(self, generation: int) -> None:
        self.collecting = True
        try:
            gc.collect(generation)
        finally:
            self.collecting = False

    def end(self, trainer: Trainer, failing: bool) -> None:
        if self.every:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
