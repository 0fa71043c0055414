"""Python's garbage collector, run by the loop instead of by allocation counts.

The cyclic collector pauses the process for as long as a scan takes, whenever enough objects
were allocated: on one rank of many, mid-step, that pause stalls every other rank at the next
collective. During training it is off; the loop collects the young generations at the end of
every `train.gc_every`-th step (every rank at the same step), and everything before a
checkpoint; what was alive when training began (modules, the dataset's index, imports) is
frozen out of every scan. `train.gc_every: 0` leaves Python's automatic collection on.
"""

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
        """At the end of an optimizer step: the young generations every `every` steps."""
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
