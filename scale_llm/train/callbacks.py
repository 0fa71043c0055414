"""What happens around a training step: small callbacks on the loop (`Trainer.fit`), each
handed a `StepEnd` after every optimizer step, in order; they may add to the step's metric row,
which `WriteMetrics` writes. A feature around the step is a callback here, not a loop edit."""

from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from scale_llm.components.distributed import mean_over_ranks, shorten_timeouts, start_timeouts
from scale_llm.components.hardware import cuda_memory_gib
from scale_llm.components.loss import perplexity
from scale_llm.data.loader import TokenWindows, eval_batches
from scale_llm.data.tokenizer import continuation, load_tokenizer
from scale_llm.train.guards import TrainingDiverged, diverged_message

log = logging.getLogger(__name__)
Trainer = Any  # train/trainer.py's, which imports this module: named, not imported


@dataclass
class StepEnd:
    """One finished optimizer step, as the callbacks see it."""

    step: int
    loss: torch.Tensor  # this rank's, on the device (read on logging steps only)
    grad_norm: torch.Tensor  # the global pre-clip norm, on the device
    lr: float
    stop: str | None  # why the launch stops after this step (every rank agrees), or None
    row: dict[str, Any] = field(default_factory=dict)  # the step's metric row, if any


class Callback:
    """A hook on the loop; each method does nothing unless overridden."""

    def start(self, trainer: Trainer) -> None:
        """Before the first step of this launch."""

    def step_end(self, trainer: Trainer, s: StepEnd) -> None:
        """After each optimizer step."""

    def end(self, trainer: Trainer, failing: bool) -> None:
        """After the last step of this launch, or when the loop fails (`failing`)."""


class TrainMetrics(Callback):
    """Logging steps (and a stop's step, so that its checkpoint, `runs` and the done: line
    name one step): loss, LR, gradient norm, tokens/s and MFU to the row and the console."""

    def step_end(self, trainer: Trainer, s: StepEnd) -> None:
        if not (trainer.cadence.logs(s.step) or s.stop):
            return
        tokens_per_s = trainer.clock.tokens_per_s(s.step)
        row = {
            "loss": mean_over_ranks(s.loss).item(),
            "lr": s.lr,
            "grad_norm": s.grad_norm.item(),
            "tokens_per_s": tokens_per_s,
            "tokens": trainer.tokens(s.step),
            "skipped_steps": int(trainer.skipped_steps.item()),
        }
        for name, sequences in trainer.loader.drawn().items():  # a mixture's, cumulative
            row[f"tokens/{name}"] = sequences * trainer.cfg.model.seq_len
        if (scale := trainer.backend.loss_scale()) is not None:
            row["loss_scale"] = scale  # fp16: halved by an overflow, doubled after 2000 good steps
        if trainer.peak_flops:
            per_gpu = tokens_per_s / trainer.plan.world_size / trainer.peak_flops
            row["mfu"] = trainer.flops_per_token * per_gpu
            row["mfu_causal"] = trainer.causal_flops_per_token * per_gpu
        last = trainer.cfg.train.max_steps
        mfu = f" | mfu {row['mfu']:.1%} (causal {row['mfu_causal']:.1%})" if "mfu" in row else ""
        log.info(
            f"step {s.step}/{last} ({s.step / last:.0%}) | loss {row['loss']:.4f} | lr {s.lr:.2e} "
            f"| grad_norm {row['grad_norm']:.3f} | {tokens_per_s:.0f} tok/s{mfu} | "
            f"{trainer.clock.progress(s.step)}"
        )
        trainer.result.losses[s.step] = row["loss"]
        trainer.result.grad_norms[s.step] = row["grad_norm"]
        s.row.update(row)


class NaNGuard(Callback):
    """Runs of skipped (non-finite) steps, read on logging, checkpoint and stop steps (before
    the step's row is written): train.max_bad_steps in a row stop the run (exit 3) naming the
    last good checkpoint."""

    def step_end(self, trainer: Trainer, s: StepEnd) -> None:
        if trainer.cadence.logs(s.step) or trainer.cadence.checkpoints(s.step) or s.stop:
            self.check(trainer, row=s.row)

    def check(self, trainer: Trainer, warn: bool = True, row: dict | None = None) -> None:
        """Stop at train.max_bad_steps skipped steps in a row; below, warn (unless told not to:
        a save on a skipped step, whose step end warns). `row`: the step's metrics so far."""
        # (and the longest run since the last check: one that ended before it is no less long)
        streak, worst = torch.stack([trainer.bad_streak, trainer.worst_streak]).tolist()
        trainer.worst_streak.fill_(streak)  # (a run still going on is counted on)
        step, cfg = trainer.step, trainer.cfg
        if worst >= cfg.train.max_bad_steps:
            trainer.checkpointer.wait(failing=True)  # a save in flight is published (and prunes)
            saved = trainer.checkpointer.complete()  # before the message names the newest
            good = step - streak  # the last step whose update was applied
            holds = good if saved and saved[-1][0] > good else None  # saved inside the streak
            stopped = {**(row or {}), "skipped_steps": int(trainer.skipped_steps.item())}
            stopped["stopped"] = "diverged"  # (what `scale-llm runs` reads)
            trainer.metrics.log(step, stopped)
            last, precision = saved[-1][1] if saved else None, trainer.plan.precision
            ended = streak < cfg.train.max_bad_steps
            said = diverged_message(worst, step, cfg, precision, last, holds, recovered=ended)
            raise TrainingDiverged(said)
        if worst and warn:
            ended = "" if worst == streak else " (a run that ended since the last check)"
            log.warning(
                f"step {step}: {worst} consecutive steps skipped{ended} (non-finite loss or "
                f"gradients)"
            )


class Validation(Callback):
    """Evaluation steps: the mean loss over eval.steps global batches of validation windows, over
    all ranks; a mixture's per source, and their mean weighted by data.sources."""

    def step_end(self, trainer: Trainer, s: StepEnd) -> None:
        if not trainer.cadence.evaluates(s.step):
            return
        losses = self.evaluate(trainer)
        val = trainer.result.val_losses[s.step] = s.row["val_loss"] = losses.pop("")
        ppl = s.row["val_perplexity"] = perplexity(val)
        s.row.update({f"val_loss/{n}": v for n, v in losses.items()})
        log.info(f"step {s.step} | val_loss {val:.4f} | val_perplexity {ppl:.2f}")
        if losses:
            shown = " | ".join(f"{n} {v:.4f}" for n, v in losses.items())
            log.info("step %d | val_loss by source: %s", s.step, shown)

    @torch.no_grad()
    def evaluate(self, trainer: Trainer) -> dict[str, float]:
        """{"": the validation loss, and a mixture's sources by name}."""
        trainer.model.eval()
        losses = {name: self._loss(trainer, w) for name, w in trainer.data.val.items()}
        trainer.model.train()
        sources = trainer.data.sources
        if sources is None:
            return losses
        return {"": sum(sources[n][0] * loss for n, loss in losses.items()), **losses}

    def _loss(self, trainer: Trainer, windows: TokenWindows) -> float:
        """The mean loss of the windows one evaluation scores, each once (`eval_batches`: the
        rows of a batch in part past the last window are run, not scored), over all ranks."""
        backend = trainer.backend
        total = torch.zeros(2, device=trainer.device)  # (sum of window losses, windows)
        for inputs, targets, rows in eval_batches(windows, trainer.plan, trainer.cfg.eval.steps):
            with backend.forward_context():  # every rank, every batch: the same collectives
                total[0] += backend.eval_loss(trainer.model, inputs, targets, rows)
            total[1] += rows
        loss_sum, scored = mean_over_ranks(total).tolist()  # (a ratio of sums: means will do)
        return loss_sum / scored


class Samples(Callback):
    """Sample steps: a greedy continuation of eval.sample_prompt, decoded by every rank in lockstep
    (full windows of the compiled shape, a fixed token count); cut at the first EOS."""

    def step_end(self, trainer: Trainer, s: StepEnd) -> None:
        if trainer.cadence.samples(s.step):
            s.row["samples_text"] = self.sample(trainer)
            log.info("step %d | sample: %r", s.step, s.row["samples_text"][:200])

    def sample(self, trainer: Trainer) -> str:
        cfg, backend = trainer.cfg, trainer.backend
        tokenizer = load_tokenizer(trainer.spec.tokenizer)
        T = cfg.model.seq_len
        ids = tokenizer.encode(cfg.eval.sample_prompt, bos=True)[-(T - 1) :]
        rows = trainer.plan.micro_batch_size if backend.compile else 1  # compiled: its shape
        window = torch.full((rows, T), tokenizer.eos_id, dtype=torch.long)
        window[:, : len(ids)] = torch.tensor(ids)
        window, filled, new = window.to(trainer.device), len(ids), []
        trainer.model.eval()
        for _ in range(cfg.eval.sample_tokens):
            with torch.no_grad(), backend.forward_context():
                logits = backend.next_token_logits(trainer.model, window, filled - 1)
            token = int(logits[: tokenizer.vocab_size].float().argmax().item())  # (a token's)
            new.append(token)
            if filled < T:
                window[:, filled] = token
                filled += 1
            else:  # a full window slides: the oldest token leaves
                window = torch.roll(window, -1, dims=1)
                window[:, -1] = token
        trainer.model.train()
        if tokenizer.eos_id in new:
            new = new[: new.index(tokenizer.eos_id)]
        return cfg.eval.sample_prompt + continuation(tokenizer, ids, new)


class TaskScores(Callback):
    """eval.tasks' steps: lm-eval's scores of the model (train/eval_tasks.py)."""

    def step_end(self, trainer: Trainer, s: StepEnd) -> None:
        if trainer.spec.tasks.due(s.step):
            s.row.update(trainer.spec.tasks.run(trainer.model, trainer.run_dir, s.step))


class WriteMetrics(Callback):
    """A step's metric row, with the peak CUDA memory so far, to metrics.jsonl, TensorBoard, W&B
    (after the step's save: a stop that came during it adds the step's numbers to the row)."""

    def step_end(self, trainer: Trainer, s: StepEnd) -> None:
        if s.row:
            for key, value in cuda_memory_gib(trainer.device).items():  # (a saved step's:
                s.row.setdefault(key, value)  # taken before its save, by Checkpoints)
            trainer.metrics.log(s.step, s.row)

    def end(self, trainer: Trainer, failing: bool) -> None:
        trainer.metrics.close()


class CommTimeouts(Callback):
    """After this launch's first step (compiled, loaded, every collective seen once), a stuck
    collective times out in SCALE_LLM_STEP_TIMEOUT_MIN, not the start-up's timeout."""

    def step_end(self, trainer: Trainer, s: StepEnd) -> None:
        first = s.step == trainer.result.start_step + 1
        if first and (timeout := shorten_timeouts()) is not None:
            minutes = timeout.total_seconds() / 60
            log.info(
                f"dist: collectives time out after {minutes:.3g} min from here on "
                "(SCALE_LLM_STEP_TIMEOUT_MIN)"
            )


class Checkpoints(Callback):
    """checkpoint.every, the last step and a stop's step: a checkpoint; at the end, a save still
    being written is published and the host copy kept for background saves is freed."""

    def step_end(self, trainer: Trainer, s: StepEnd) -> None:
        if not (trainer.cadence.checkpoints(s.step) or s.stop):
            return
        if s.row:  # the step's peak memory, not the save's
            s.row.update(cuda_memory_gib(trainer.device))
        try:  # (no step's time: tokens/s leaves it out, on a metric row's step or between two)
            with trainer.clock.aside(), start_timeouts():  # (ranks wait while one writes)
                trainer.collector.before_checkpoint()
                trainer.result.checkpoint = trainer.save_checkpoint()
        except TrainingDiverged:  # (its own row, written by NaNGuard.check)
            raise
        except BaseException:  # the step's row still reaches metrics.jsonl and the trackers
            with contextlib.suppress(Exception):  # (the save's error is the one to see)
                WriteMetrics().step_end(trainer, s)
            raise
        if s.stop or not (stop := trainer.stop_reason()):
            return
        s.stop = stop  # (one that came while it saved: this step is the stop's, its save the last)
        if "loss" not in s.row:  # the stop's step has its numbers (alike on every rank)
            TrainMetrics().step_end(trainer, s)  # (in its row, which WriteMetrics writes next)

    def end(self, trainer: Trainer, failing: bool) -> None:
        trainer.checkpointer.wait(failing=failing)
        if trainer.background and trainer.background.stager:
            trainer.background.stager.close()


class ThroughputWindow(Callback):
    """After a metric row's step ends (its evaluation, save and collection done): the next row's
    tokens/s counts from here, so a step's own work is left out of both rows, as evaluation is."""

    def step_end(self, trainer: Trainer, s: StepEnd) -> None:
        if s.row:
            trainer.clock.row_written(s.step)


class GarbageCollector(Callback):
    """Python's garbage collector, run by the loop every train.gc_every steps on all ranks alike
    (a mid-step scan on one rank stalls every rank at the next collective), with the set-up's
    objects frozen out of every scan; gc_every 0 leaves it automatic."""

    def __init__(self, every: int):
        self.every = every
        self.collecting = False  # inside one of our collections (the test's witness)

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
