"""train.profile: `torch.profiler` traces of chosen steps (each step a `record_function` named
`scale_llm step N`; a stopped launch writes the steps that ran) and a CUDA memory snapshot, per
rank: `rank<R>_steps<A>-<B>.pt.trace.json` for TensorBoard or Perfetto, a pickle for memory_viz."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from scale_llm.config.plan import RunPlan
from scale_llm.config.profile import ProfileConfig
from scale_llm.errors import UserError
from scale_llm.files import absent, describe_kind, stamped_name, temporary_sibling
from scale_llm.train.callbacks import Callback, StepEnd, Trainer

log = logging.getLogger(__name__)
SNAPSHOT_ENTRIES = 100_000  # allocator events kept (torchtitan's default)
NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS}  # a file system without them


def check_profile(p: ProfileConfig, run_dir: Path) -> None:
    """Before any work: train.profile.folder is missing or a folder (a memory snapshot off a GPU
    is refused with the plan: config/plan.py)."""
    folder = run_dir / p.folder
    if not (p.enabled or p.memory_snapshot_step is not None):
        return
    inside = Path(p.folder)  # the folder and those above it, inside the run dir
    for at in (run_dir / q for q in (inside, *inside.parents) if q != Path(".")):
        if (at.is_symlink() or at.exists()) and not at.is_dir():
            raise UserError(
                f"train.profile.folder: {at} is {describe_kind(at)}, not a directory; the "
                f"profiler writes its traces in {folder}: move it away or set another "
                f"train.profile.folder"
            )


class StepProfiler(Callback):
    """A context around the loop: traces the configured steps and writes the memory snapshot."""

    def __init__(self, p: ProfileConfig, plan: RunPlan, run_dir: Path, start_step: int):
        self.p, self.rank, self.start_step = p, plan.rank, start_step
        self.folder = run_dir / p.folder
        self.cuda = plan.device.type == "cuda"
        self.prof: Any = None
        self.step_label: Any = None
        self.last_step = start_step  # the last step done (what a stopped trace holds)
        self.snapshot_step = p.memory_snapshot_step
        if self.snapshot_step is not None and self.snapshot_step <= start_step:
            log.info(
                f"train.profile: no memory snapshot: this launch starts after step {start_step}, "
                f"and the snapshot is of step {self.snapshot_step}"
            )
            self.snapshot_step = None

    def start(self, trainer: Trainer) -> None:
        if self.snapshot_step is not None:
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
        p, first = self.p, self.p.start_step - self.p.warmup_steps
        if not p.enabled:
            return
        if first <= self.start_step:
            log.info(
                f"train.profile: not traced: this launch starts after step {self.start_step}, and "
                f"the profiler's warm-up begins at step {first} (set train.profile.start_step "
                f"above {self.start_step + p.warmup_steps} to trace this launch)"
            )
            return
        kinds, wait = torch.profiler.ProfilerActivity, first - self.start_step - 1
        self.prof = torch.profiler.profile(
            activities=[kinds.CPU, kinds.CUDA] if self.cuda else [kinds.CPU],
            schedule=torch.profiler.schedule(
                wait=wait, warmup=p.warmup_steps, active=p.active_steps, repeat=1
            ),
            on_trace_ready=self._write_trace,
            record_shapes=True,
            profile_memory=True,
        )
        self.prof.start()
        self._label(self.start_step + 1)

    def _label(self, step: int) -> None:
        self.step_label = torch.profiler.record_function(f"scale_llm step {step}")
        self.step_label.__enter__()

    def _end_label(self) -> None:
        if self.step_label is not None:
            self.step_label.__exit__(None, None, None)
            self.step_label = None

    def step_end(self, trainer: Trainer, s: StepEnd) -> None:
        """Optimizer step `s.step` (its logging, eval and checkpoint included) is over: what it
        writes is left out of tokens/s."""
        with trainer.clock.aside():
            self._step_end(trainer, s)

    def _step_end(self, trainer: Trainer, s: StepEnd) -> None:
        """`last`: the launch runs no further step (a stop, or train.max_steps)."""
        step, last = s.step, bool(s.stop) or s.step == trainer.cfg.train.max_steps
        self.last_step = step
        if self.prof is not None:
            if last or step >= self.p.start_step + self.p.active_steps - 1:
                if step < self.p.start_step:  # (stopped in the wait or warm-up: no trace)
                    log.info(
                        f"train.profile: not traced: the launch stopped after step {step}, before "
                        f"step {self.p.start_step}"
                    )
                self._stop_trace()  # writes what was traced, opening no next step
            else:
                self._end_label()
                self.prof.step()
                self._label(step + 1)
        if step == self.snapshot_step:
            name = f"memory_snapshot_rank{self.rank}_step{step}.pickle"
            path = self._write(name, torch.cuda.memory._dump_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot_step = None
            log.info(f"train.profile: CUDA memory snapshot after step {step} written to {path}")

    def _write(self, name: str, dump: Callable[[str], Any]) -> Path:
        """`dump` writes a temporary sibling, given `name` in the folder once whole; a file
        already named so (an earlier launch's trace of the same steps, or a file of the user's in
        a linked folder) is kept, and the new one gets a time-stamped name beside it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = temporary_sibling(self.folder / name)
        path, (stem, dot, suffix) = self.folder / name, name.partition(".")
        try:
            dump(str(tmp))
            while True:
                try:
                    os.link(tmp, path)  # (never replaces: a name taken meanwhile raises)
                    return path
                except FileExistsError:
                    path = stamped_name(self.folder, stem, dot + suffix)
                except OSError as e:
                    if e.errno not in NO_HARD_LINKS:
                        raise
                    if not absent(path):  # renamed to a name found free
                        path = stamped_name(self.folder, stem, dot + suffix)
                    os.rename(tmp, path)
                    return path
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        first, last = self.p.start_step, self.last_step
        name = f"rank{self.rank}_steps{first}-{last}.pt.trace.json"
        path = self._write(name, prof.export_chrome_trace)
        log.info(f"train.profile: steps {first}-{last} traced to {path}")

    def _stop_trace(self) -> None:
        self._end_label()
        self.prof.stop()  # inside the traced steps (a stop, an error): what was traced is written
        self.prof = None

    def end(self, trainer: Trainer, failing: bool) -> None:
        if self.prof is not None:
            self._stop_trace()
        if self.snapshot_step is not None:  # stopped before the snapshot's step
            torch.cuda.memory._record_memory_history(enabled=None)
