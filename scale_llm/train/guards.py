"""What stops a run early, on purpose or not: stop signals, runs of non-finite steps, and the
fault injection the crash-safety tests (and fire drills) use."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from scale_llm.analysis.memory import estimate
from scale_llm.components.checkpoint import Checkpointer
from scale_llm.config import Config
from scale_llm.config.plan import RunPlan
from scale_llm.errors import UserError, note_stop

log = logging.getLogger(__name__)


class StopSignals:
    """While active, SIGTERM / SIGINT only set `received`; the trainer then checkpoints at the end
    of the current step and exits cleanly. A second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.received = 0
        self.ending = False  # (set while the run ends: its last save)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        note_stop(signum)  # (what a command around the run reads: check's curves)
        name = signal.Signals(signum).name
        if self.ending:
            log.warning(f"received {name} while the run ends; its end goes on")
        else:
            log.warning(f"received {name}: saving a checkpoint after this step, then stopping")


def stop_line(signal_name: str, run_dir: Path, max_steps: int, again: str) -> str:
    """A launcher's last line after a stop signal: the checkpoint to continue from, and `again`."""
    complete = Checkpointer(run_dir, 1).complete()
    if not complete:
        return f"stopped by {signal_name} before the first checkpoint; start again with: {again}"
    step, latest = complete[-1]
    if step >= max_steps:
        return f"stopped by {signal_name} after the last step: checkpoint {latest}; run complete"
    return (
        f"stopped by {signal_name}: checkpoint {latest} (step {step} of {max_steps}); "
        f"continue with: {again}"
    )


class TrainingDiverged(UserError):
    """Too many consecutive optimizer steps with a non-finite loss or gradient norm."""

    exit_code = 3


def diverged_message(
    streak: int,
    step: int,
    cfg: Config,
    precision: str,
    last_good: Path | None,
    held: int | None,
    recovered: bool = False,
) -> str:
    """`held`: the step whose weights `last_good` holds when it was saved inside the run of
    skipped steps (a skipped step changes none). `recovered`: the run of skipped steps ended
    before this check read it."""
    holds = f" (it holds step {held}'s weights)" if held is not None else ""
    resume = (
        f"The last good checkpoint is {last_good}{holds}; resume from it with "
        f"--set checkpoint.resume={last_good} after changing the cause."
        if last_good
        else "No checkpoint was saved before the problem began."
    )
    return (
        f"training stopped at step {step}: "
        + (
            f"{streak} optimizer steps in a row since the check before had a non-finite loss or "
            f"gradient norm (they were skipped; train.max_bad_steps={cfg.train.max_bad_steps}; "
            f"the steps after them were finite again). Likely causes: a learning "
            if recovered
            else f"the last {streak} optimizer steps had a non-finite loss or gradient norm "
            f"(they were skipped). Likely causes: a learning "
        )
        + f"rate too high for this model (train.lr={cfg.train.lr:g}); fp16 overflow (train."
        f"precision={precision}; bf16 has fp32's range); or bad data (check data.dir="
        f"{cfg.data.dir} with `scale-llm prepare --force`). {resume}"
    )


FAULT_VARIABLE = "SCALE_LLM_FAULT"
FAULT_POINTS = ("after_step", "mid_save")


def fault_spec() -> tuple[str, int, int | None] | None:
    """SCALE_LLM_FAULT as (point, step, rank or None for every rank); None when unset. A
    malformed value is a UserError: a drill that silently injects nothing would pass for one."""
    spec = os.environ.get(FAULT_VARIABLE, "")
    if not spec.strip():
        return None
    parts = spec.split(":")
    numbers = [p.strip() for p in parts[1:]]
    if (
        len(parts) not in (2, 3)
        or parts[0].strip() not in FAULT_POINTS
        or not all(n.isdigit() and n.isascii() for n in numbers)
        or int(numbers[0]) < 1
    ):
        raise UserError(
            f"{FAULT_VARIABLE}={spec[:60]!r} is not a fault to inject; use after_step:STEP or "
            f"mid_save:STEP, optionally :RANK (STEP >= 1, RANK >= 0; e.g. after_step:3:1 "
            f"kills rank 1 after step 3), or unset {FAULT_VARIABLE} (it is for fire drills "
            f"and the crash-safety tests)"
        )
    return parts[0].strip(), int(numbers[0]), int(numbers[1]) if len(numbers) > 1 else None


def maybe_fail(point: str, step: int, rank: int) -> None:
    """Fault injection: SCALE_LLM_FAULT=POINT:STEP[:RANK] makes this process SIGKILL itself at
    POINT of step STEP, on the first launch only (torchrun restarts run clean)."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    fault = fault_spec()
    if fault is not None and fault[:2] == (point, step) and fault[2] in (None, rank):
        log.warning(f"fault injection: killing rank {rank} at {point} of step {step}")
        os.kill(os.getpid(), signal.SIGKILL)


def out_of_memory(
    error: Exception, cfg: Config, plan: RunPlan, step: int, after: bool = False
) -> str:
    """What a device's out-of-memory error in step `step + 1` (`after`: in the work after step
    `step`: evaluation, samples, eval.tasks, a save) becomes: the estimate, and fixes."""
    import torch

    est, gib = estimate(cfg, plan), 2**30
    what = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
    size, capacity = "SIZE", ""
    if plan.device.type == "cuda":
        total = torch.cuda.get_device_properties(plan.device).total_memory
        size, capacity = f"{total / gib:.0f}GiB", f" of its {total / gib:.1f} GiB"
    config = cfg.run_dir / "config.yaml"
    where, then = f"in step {step + 1}", ""
    if after:  # (the step itself fit)
        tasks = ", eval.tasks" if cfg.eval.tasks else ""
        where = f"after step {step}, in its evaluation, samples{tasks} or save"
    if after and cfg.eval.tasks:
        then = (
            " eval.tasks holds a second copy of the model (a Hugging Face export) on the "
            "device: set eval.tasks: null and run `scale-llm eval` on a checkpoint instead."
        )
    return (
        f"rank {plan.rank} ran out of {plan.device.type.upper()} memory{capacity} {where} "
        f"({what}).{then} The estimate for these settings is {est.gpu['total'] / gib:,.1f} "
        f"GiB per device (micro-batch {plan.micro_batch_size} x seq_len {cfg.model.seq_len}, "
        f"activation_checkpointing.mode={cfg.activation_checkpointing.mode}, backend "
        f"{plan.backend}, {plan.world_size} process(es)); `scale-llm estimate {config} --fit "
        f"{size}` prints settings that fit, as --set overrides, and `train --fit auto` applies "
        f"them at launch. By hand: a smaller train.micro_batch_size (with train.grad_accum "
        f"raised to keep the batch), activation_checkpointing.mode=full, or "
        f"parallel.backend=fsdp to shard the model over more GPUs."
    )
