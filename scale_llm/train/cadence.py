"""Which steps log, evaluate, sample, checkpoint and read device values, in one place. Steps
count finished optimizer steps; a launch's first step and the run's last always log."""

from __future__ import annotations

from dataclasses import dataclass

from scale_llm.config import Config


@dataclass(frozen=True)
class Cadence:
    cfg: Config
    start_step: int  # the step this launch began from (a resume's checkpoint step, else 0)

    def logs(self, step: int) -> bool:
        return step % self.cfg.logging.every == 0 or step == self.start_step + 1 or self._last(step)

    def evaluates(self, step: int) -> bool:
        e = self.cfg.eval
        return bool(e.every and e.steps and (step % e.every == 0 or self._last(step)))

    def samples(self, step: int) -> bool:
        every = self.cfg.eval.sample_every
        return bool(every and (step % every == 0 or self._last(step)))

    def checkpoints(self, step: int) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every and step % every == 0) or self._last(step)

    def syncs(self, step: int) -> bool:
        """Steps that read device values or save anyway: where a collective costs nothing."""
        exits = step == self.cfg.train.exit_at_step
        return self.logs(step) or self.evaluates(step) or self.checkpoints(step) or exits

    def _last(self, step: int) -> bool:
        return step == self.cfg.train.max_steps
