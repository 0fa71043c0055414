"""The training loop: one code path for every backend and precision.

Per optimizer step: set the LR; for each of grad_accum micro-batches run forward under the
backend's precision context, divide the loss by grad_accum and backward (gradients are synced only
on the last micro-step); then one global-norm clip and one optimizer step. Losses and norms stay on
the device and are read (a host sync) only on logging steps.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import signal
import sys
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scale_llm.analysis.memory import check_host_memory
from scale_llm.components.checkpoint import (
    RECORDED,
    TRAINER_FORMAT,
    TRAINER_STATE,
    Checkpointer,
    load_model_weights,
    read_trainer_state,
    resolve_resume,
)
from scale_llm.components.distributed import mean_over_ranks
from scale_llm.components.hardware import cuda_memory_gib, peak_flops
from scale_llm.components.optim import lr_at
from scale_llm.components.serialization import background_save, save_file
from scale_llm.config import Config, save_config, to_dict
from scale_llm.config.plan import RunPlan
from scale_llm.data.loader import TokenWindows, TrainLoader, eval_batches
from scale_llm.data.mixture import check_epochs, open_training_data
from scale_llm.data.tokenizer import load_tokenizer, run_copy_name
from scale_llm.errors import UserError
from scale_llm.files import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    require_writable_dir,
)
from scale_llm.model import Transformer, build_model, empty_state_dict
from scale_llm.parallel.backend import build_backend
from scale_llm.parallel.step import optimizer_step
from scale_llm.train.cadence import Cadence
from scale_llm.train.collector import GarbageCollector
from scale_llm.train.eval_tasks import TaskEval, remove_scratch
from scale_llm.train.guards import (
    StopSignals,
    TrainingDiverged,
    check_fault_spec,
    diverged_message,
    maybe_fail,
)
from scale_llm.train.init_from import load_init_weights
from scale_llm.train.lock import RunLock
from scale_llm.train.metrics import MetricsLogger
from scale_llm.train.preflight import check_run_dir, check_vocab, check_windows, out_of_memory
from scale_llm.train.profiling import StepProfiler, check_profile
from scale_llm.train.resume import (
    check_finished_run,
    check_resume_state,
    foreign_layout,
    schedule_change,
)
from scale_llm.train.rng import Generators
from scale_llm.train.throughput import Throughput

log = logging.getLogger(__name__)
PLAN_FILE = "plan.json"


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: dict[int, float] = field(default_factory=dict)  # logged step -> train loss
    val_losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    checkpoint: Path | None = None
    stopped: str | None = None  # why the run stopped before max_steps, if it did
    start_step: int = 0  # the step this launch began at (a resume's checkpoint step)
    seconds: float = 0.0  # this launch's training time
    complete: bool = False  # the run had already reached train.max_steps: nothing was done


class Trainer:
    def __init__(self, cfg: Config, plan: RunPlan):
        check_fault_spec()  # a malformed SCALE_LLM_FAULT stops the launch before any work
        self.cfg, self.plan = cfg, plan
        self.device = plan.device
        self.run_dir = cfg.run_dir
        self.data = open_training_data(cfg)  # one source, or each of a mixture's
        self.manifest = self.data.manifest
        check_vocab(cfg, self.manifest)
        check_profile(cfg.train.profile, plan, self.run_dir)
        tokenizer = Path(cfg.data.dir) / self.manifest["tokenizer"]["file"]
        self.task_eval = TaskEval(cfg, plan, tokenizer)  # eval.tasks looked up: before any work
        if plan.is_main:
            require_writable_dir(self.run_dir, "run.dir / run.name")  # before the model is built
            check_run_dir(self.run_dir)  # e.g. a file where checkpoints/ belongs: before any work
        self.lock = RunLock(self.run_dir)
        if plan.is_main:
            self.lock.check()  # a live launch on this run dir: stop before any work
        try:
            self._setup(cfg, plan)
        except BaseException:
            self.lock.release()
            raise

    def _setup(self, cfg: Config, plan: RunPlan) -> None:
        # checkpoint.async_mode: how saves copy the state and where its files are written
        self.background = background_save(cfg.checkpoint.async_mode, plan.device)
        self.checkpointer = Checkpointer(
            self.run_dir,
            cfg.checkpoint.keep_last,
            plan.is_main,
            self.background.group if self.background else None,
        )
        self.resume_from = resolve_resume(cfg.checkpoint.resume, self.checkpointer)
        resume_state = self._read_resume_state()

        self.train_windows = self.data.train
        self.val_windows = min(self.data.val.values(), key=len)  # (a mixture: its smallest)
        check_windows(cfg, plan, self.train_windows, self.val_windows)  # before memory checks
        check_host_memory(cfg, plan)
        self.backend = build_backend(cfg, plan)
        model = build_model(cfg.model)  # on the meta device: no memory, no init yet
        _log_model(model, cfg)
        self.flops_per_token = model.flops_per_token()  # MFU's convention: attention counted whole
        self.causal_flops_per_token = model.flops_per_token(causal=True)  # the work done
        self.peak_flops = peak_flops(plan.device, plan.precision, cfg.logging.peak_tflops)
        if self.peak_flops is None:
            log.info(
                "mfu: not reported: no known peak FLOP/s for %s in %s (set "
                "logging.peak_tflops to the device's dense peak to report it)",
                plan.device,
                plan.precision,
            )
        exact = resume_state is not None and self.backend.can_restore(
            resume_state["backend"]["layout"]
        )
        initial = None
        if resume_state is not None and not exact:
            initial = self._foreign_weights(resume_state)
        if resume_state is None and cfg.model.init_from:
            tok = self.manifest["tokenizer"]
            initial = load_init_weights(cfg.model, tok["sha256"], tok.get("files_sha256"))
        elif cfg.model.init_from:
            log.info("init_from: not used: resuming %s (newer weights)", self.resume_from)
        self.model = self.backend.setup(model, initial)

        self.loader = TrainLoader(
            self.train_windows,
            plan,
            cfg.run.seed,
            cfg.data.prefetch,
            self.data.sources,
            cfg.data.repeat,
        )
        check_epochs(cfg, self.loader, self.data, plan.is_main)  # data.repeat; the mixture
        self.collector = GarbageCollector(cfg.train.gc_every)
        self.generators = Generators(plan.rank)
        self.step = 0
        self.source_val_losses: dict[str, float] = {}  # a mixture's, at the last evaluation
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self.bad_streak = torch.zeros((), dtype=torch.int64, device=self.device)
        if resume_state is not None:
            self.load_state_dict(resume_state, exact)
        self.cadence = Cadence(cfg, self.step)
        self.profiler = StepProfiler(cfg.train.profile, plan, self.run_dir, self.step)
        self.complete = self.step >= cfg.train.max_steps  # a finished run: write nothing
        if plan.is_main and not self.complete:
            self.lock.acquire()  # every check passed: from here on this launch owns the dir
            remove_scratch(self.run_dir)  # eval.tasks' of a killed launch
            if self.resume_from is not None:
                self.checkpointer.abandon_after(self.step)
            self._write_run_dir()
        try:
            self.metrics = MetricsLogger(
                self.run_dir, plan.is_main and not self.complete, cfg, self.step
            )
        except BaseException:  # e.g. W&B cannot start: a relaunch must find the dir free
            if plan.is_main and not self.complete:
                self.lock.release()
            raise
        self._warn_about_warmup()
        self._warn_about_validation()

    # ----------------------------------------------------------------- loop
    def fit(self) -> TrainResult:
        """Train to train.max_steps, logging, evaluating and checkpointing on the way; stop early
        (with a checkpoint) at train.exit_at_step or on SIGTERM / SIGINT."""
        t = self.cfg.train
        result = TrainResult(self.run_dir, self.step, start_step=self.step)
        if self.complete:
            log.info(
                "run already complete: %s is at step %d of train.max_steps=%d; nothing to do "
                "(raise train.max_steps to train further, or start a new run: --run-name NAME)",
                self.resume_from,
                self.step,
                t.max_steps,
            )
            result.complete = True
            self.loader.close()
            self.lock.release()
            return result
        log.info("plan: %s", self.plan.describe())
        self.clock = Throughput(self.plan.tokens_per_step, t.max_steps, self.step)
        try:
            with StopSignals() as signals, self.collector as collector, self.profiler as profiler:
                while self.step < t.max_steps:
                    try:
                        loss, grad_norm, lr = self.train_step()
                    except torch.OutOfMemoryError as e:
                        raise UserError(out_of_memory(e, self.cfg, self.plan, self.step)) from None
                    self.step += 1
                    maybe_fail("after_step", self.step, self.plan.rank)
                    self.clock.step_done(self.step)
                    stop = self._stop_reason(signals)  # first: a stop's step is logged too
                    self._record(loss, grad_norm, lr, result, stop is not None)
                    collector.step_done(self.step)
                    if self.cadence.checkpoints(self.step) or stop:
                        collector.before_checkpoint()
                        result.checkpoint = self.save_checkpoint()
                    profiler.step_done(self.step, last=bool(stop) or self.step == t.max_steps)
                    if stop:
                        self._say_stop(stop)
                        result.stopped = stop
                        break
        finally:
            try:  # a save still being written is published (an error exit logs its failure)
                self.checkpointer.wait(failing=sys.exc_info()[0] is not None)
                if self.background and self.background.stager:
                    self.background.stager.close()  # the kept host copy is freed
            finally:
                result.seconds = self.clock.elapsed()
                self.loader.close()
                self.metrics.close()
                self.lock.release()
        result.steps = self.step
        return result

    def _say_stop(self, why: str) -> None:
        t = self.cfg.train
        then = (
            f"launch again to continue to step {t.max_steps}"
            if self.step < t.max_steps
            else "the run is complete"
        )
        log.info("stop: %s after step %d; %s", why, self.step, then)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over grad_accum micro-batches; returns (loss, grad_norm, lr).

        A non-finite norm means the step was skipped (a non-finite loss makes its gradients
        non-finite too); runs of them are counted on the device (no host sync) and checked on
        logging steps and before checkpoints. The verdict comes from the global norm alone, the
        same on every rank (this rank's own loss is not), so every rank decides alike whether
        to stop.
        """
        lr = lr_at(self.step, self.cfg.train)
        self.backend.set_lr(lr)
        loss, grad_norm = optimizer_step(self.backend, self.model, self.loader.next_batches())
        bad = (~torch.isfinite(grad_norm)).long()
        self.skipped_steps += bad
        self.bad_streak = (self.bad_streak + 1) * bad
        return loss, grad_norm, lr

    def _record(
        self,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        lr: float,
        result: TrainResult,
        stopping: bool = False,
    ) -> None:
        """Metric row for logging and eval steps (the only places that read device values).
        The step a launch stops at is logged: its checkpoint, `runs` and the `done:` line then
        name the same step."""
        row: dict[str, Any] = {}
        if self.cadence.logs(self.step) or stopping:
            row = self._train_metrics(loss, grad_norm, lr)
            result.losses[self.step] = row["loss"]
            result.grad_norms[self.step] = row["grad_norm"]
            self._check_divergence()
        if self.cadence.evaluates(self.step):
            row["val_loss"] = result.val_losses[self.step] = self.evaluate()
            row["val_perplexity"] = math.exp(min(row["val_loss"], 80.0))
            row.update({f"val_loss/{n}": v for n, v in self.source_val_losses.items()})
            log.info(
                "step %d | val_loss %.4f | val_perplexity %.2f",
                self.step,
                row["val_loss"],
                row["val_perplexity"],
            )
            if self.source_val_losses:
                shown = " | ".join(f"{n} {v:.4f}" for n, v in self.source_val_losses.items())
                log.info("step %d | val_loss by source: %s", self.step, shown)
        if self.cadence.samples(self.step):
            row["samples_text"] = self.sample()
            log.info("step %d | sample: %r", self.step, row["samples_text"][:200])
        if self.task_eval.due(self.step):  # every rank: the weights are gathered collectively
            row.update(self.task_eval.run(self.model, self.run_dir, self.step))
        if row:  # logging and eval rows carry the peak CUDA memory so far
            row.update(cuda_memory_gib(self.device))
            self.metrics.log(self.step, row)
            self.clock.row_written(self.step)

    def _train_metrics(
        self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float
    ) -> dict[str, Any]:
        tokens_per_s = self.clock.tokens_per_s(self.step)
        row = {
            "loss": mean_over_ranks(loss).item(),
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tokens_per_s,
            "tokens": self.plan.tokens_per_step * self.step,
            "skipped_steps": int(self.skipped_steps.item()),
        }
        for name, sequences in self.loader.drawn().items():  # a mixture's, cumulative
            row[f"tokens/{name}"] = sequences * self.cfg.model.seq_len
        scale = self.backend.loss_scale()
        if scale is not None:  # fp16: halved by an overflow, doubled after 2000 good steps
            row["loss_scale"] = scale
        peak = self.peak_flops
        if peak:
            per_gpu = tokens_per_s / self.plan.world_size / peak
            row["mfu"] = self.flops_per_token * per_gpu
            row["mfu_causal"] = self.causal_flops_per_token * per_gpu
        log.info(
            "step %d/%d (%s) | loss %.4f | lr %.2e | grad_norm %.3f | %.0f tok/s%s | %s",
            self.step,
            self.cfg.train.max_steps,
            f"{self.step / self.cfg.train.max_steps:.0%}",
            row["loss"],
            lr,
            row["grad_norm"],
            tokens_per_s,
            f" | mfu {row['mfu']:.1%} (causal {row['mfu_causal']:.1%})" if "mfu" in row else "",
            self.clock.progress(self.step),
        )
        return row

    def sample(self) -> str:
        """A greedy continuation of eval.sample_prompt, decoded on every rank in lockstep.

        Every forward is a full seq_len window (right-padded: causal attention never sees the
        padding), so sharded backends run the same collectives on each rank; with train.compile
        the prompt row is repeated to (micro_batch_size, seq_len), the shape the blocks were
        compiled for; a fixed number of tokens is generated (no early stop that ranks could disagree
        on), and the text is cut at the first EOS."""
        cfg = self.cfg
        tokenizer = load_tokenizer(Path(cfg.data.dir) / self.manifest["tokenizer"]["file"])
        T = cfg.model.seq_len
        ids = tokenizer.encode(cfg.eval.sample_prompt, bos=True)[-(T - 1) :]
        rows = self.plan.micro_batch_size if self.backend.compile else 1  # compiled: its shape
        window = torch.full((rows, T), tokenizer.eos_id, dtype=torch.long)
        window[:, : len(ids)] = torch.tensor(ids)
        window, filled, new = window.to(self.device), len(ids), []
        self.model.eval()
        for _ in range(cfg.eval.sample_tokens):
            with torch.no_grad(), self.backend.forward_context():
                logits = self.backend.logits_for_sampling(self.model(window))
            token = int(logits[0, filled - 1].float().argmax().item())
            new.append(token)
            if filled < T:
                window[:, filled] = token
                filled += 1
            else:  # a full window slides: the oldest token leaves
                window = torch.roll(window, -1, dims=1)
                window[:, -1] = token
        self.model.train()
        if tokenizer.eos_id in new:
            new = new[: new.index(tokenizer.eos_id)]
        return cfg.eval.sample_prompt + tokenizer.decode(new)

    def _check_divergence(self) -> None:
        streak = int(self.bad_streak.item())
        if streak >= self.cfg.train.max_bad_steps:
            self.checkpointer.wait(failing=True)  # a save in flight is published (and prunes)
            saved = self.checkpointer.complete()  # before the message names the newest
            good = self.step - streak  # the last step whose update was applied
            holds = good if saved and saved[-1][0] > good else None  # saved inside the streak
            self.metrics.log(self.step, {"stopped": "diverged"})  # (what `scale-llm runs` reads)
            raise TrainingDiverged(
                diverged_message(
                    streak,
                    self.step,
                    self.cfg.train.lr,
                    self.plan.precision,
                    self.cfg.data.dir,
                    saved[-1][1] if saved else None,
                    holds,
                )
            )
        if streak:
            log.warning(
                "step %d: %d consecutive steps skipped (non-finite loss or gradients)",
                self.step,
                streak,
            )

    def _stop_reason(self, signals: StopSignals) -> str | None:
        """Why to stop after this step, agreed by every rank.

        With several ranks the signal flag is all-reduced (a host sync) only on logging steps
        and before a checkpoint, which already sync: a SIGTERM is acted on within
        `logging.every` steps, and every rank sees it at the same step."""
        received = signals.received
        if self.plan.world_size > 1:
            if not self.cadence.syncs(self.step):
                return None
            flag = torch.tensor([received], device=self.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            received = int(flag.item())
        if received:
            return f"signal {signal.Signals(received).name}"
        if self.step == self.cfg.train.exit_at_step:
            return "train.exit_at_step"
        return None

    def _warn_about_warmup(self) -> None:
        """warmup >= max_steps: the LR never reaches train.lr (fine for smoke runs; say so)."""
        t = self.cfg.train
        if t.warmup_steps >= t.max_steps and not self.complete and self.plan.is_main:
            log.warning(
                "train.warmup_steps=%d >= train.max_steps=%d: the learning rate rises to %.3g "
                "at the last step (train.lr=%g) and never decays; fine for a smoke run",
                t.warmup_steps,
                t.max_steps,
                lr_at(t.max_steps - 1, t),
                t.lr,
            )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over eval.steps global batches of validation windows, over all ranks. A
        mixture's: each source's (kept in source_val_losses), weighted by data.sources."""
        self.model.eval()
        losses = {name: self._val_loss(windows) for name, windows in self.data.val.items()}
        self.model.train()
        if self.data.sources is None:
            return losses[""]
        self.source_val_losses = losses
        return sum(self.data.sources[n][0] * loss for n, loss in losses.items())

    def _val_loss(self, windows: TokenWindows) -> float:
        """The mean loss of the windows one evaluation scores, each once (`eval_batches`: the
        rows of a batch in part past the last window are run, not scored), over all ranks."""
        total = torch.zeros(2, device=self.device)  # (sum of window losses, windows)
        for inputs, targets, rows in eval_batches(windows, self.plan, self.cfg.eval.steps):
            with self.backend.forward_context():
                logits = self.model(inputs)  # every rank, every batch: the same collectives
                if rows:
                    part = logits if rows == len(inputs) else logits[:rows]
                    total[0] += self.backend.loss_fn(part, targets[:rows]) * rows
            total[1] += rows
        loss_sum, scored = mean_over_ranks(total).tolist()  # (a ratio of sums: means will do)
        return loss_sum / scored

    def _warn_about_validation(self) -> None:
        """Validation smaller than one evaluation (eval.steps global batches): each window is
        scored once, so an evaluation scores fewer sequences than asked; said once, here."""
        e, per_batch = self.cfg.eval, self.plan.sequences_per_step
        asked = e.steps * per_batch
        small = {name or "data.dir": len(w) for name, w in self.data.val.items() if len(w) < asked}
        if not (e.every and e.steps and small and self.plan.is_main and not self.complete):
            return
        held = ", ".join(f"{n:,} in {name}" for name, n in small.items())
        whole = min(small.values()) // per_batch  # whole global batches the smallest holds
        log.warning(
            "eval: eval.steps=%d global batches of %d sequences ask for %d validation windows, "
            "but there are fewer (%s): each evaluation scores those once each; prepare more "
            "validation data (data.val_fraction)%s",
            e.steps,
            per_batch,
            asked,
            held,
            f" or set eval.steps={whole} to score whole batches" if whole else "",
        )

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Save (atomically). A skipped step changed no weight and no optimizer state, so a
        checkpoint due on one is still written (the final one, a stop's, an fp16 overflow's):
        it holds the last good weights, with the data position past the skipped batches. A run
        of train.max_bad_steps skipped steps stops here instead (TrainingDiverged)."""
        streak = int(self.bad_streak.item())
        if streak:
            self._check_divergence()  # raises at train.max_bad_steps
            log.warning(
                "checkpoint: step %d was skipped (not finite): step %d's weights and optimizer "
                "state are saved as step %d",
                self.step,
                self.step - streak,
                self.step,
            )

        fault = functools.partial(maybe_fail, "mid_save", self.step, self.plan.rank)
        background = self.background and dataclasses.replace(self.background, on_written=fault)

        def write_trainer_state(tmp: Path) -> None:
            state = self.state_dict()  # a collective (every rank's generators)
            if self.plan.is_main:
                save_file(state, tmp / TRAINER_STATE)

        def write(tmp: Path) -> Future | None:
            if background:  # started last: once the write runs, nothing here can fail
                write_trainer_state(tmp)
                return self.backend.save(tmp, background)  # copied; written in a thread
            self.backend.save(tmp)
            fault()
            write_trainer_state(tmp)
            return None

        path = self.checkpointer.save(self.step, write)
        if background:
            log.info("checkpoint: writing %s in the background", path)
        else:
            log.info("checkpoint: saved %s", path)
        return path

    def state_dict(self) -> dict[str, Any]:
        """Everything but the model and optimizer (which the backend writes itself)."""
        return {
            "format": TRAINER_FORMAT,  # read_trainer_state brings older formats to this one
            "step": self.step,
            "data": self.loader.state_dict(),
            "rng": self.generators.state_dict(),  # one entry per rank
            "skipped_steps": int(self.skipped_steps.item()),
            # a checkpoint can fall inside a run of skipped steps: a resume continues its count
            "bad_streak": int(self.bad_streak.item()),
            "config": to_dict(self.cfg),
            "plan": self.plan.to_json(),
            "tokenizer_sha256": self.manifest["tokenizer"]["sha256"],
            "backend": self.backend.state_dict(),  # its checkpoint layout and scaler
            RECORDED: True,  # the checkpoint carries integrity.json: without it, it is damaged
        }

    def load_state_dict(self, state: dict[str, Any], exact: bool) -> None:
        """Restore from a checkpoint's trainer state; with `exact`, the backend also restores
        model and optimizer from its own files (otherwise only the weights were loaded)."""
        if exact:
            self.backend.load(self.resume_from)
            self.backend.load_state_dict(state["backend"])
        self.step = int(state["step"])
        self.loader.load_state_dict(state["data"])
        self.skipped_steps.fill_(int(state["skipped_steps"]))
        self.bad_streak.fill_(int(state["bad_streak"]))
        if state["rng"] is not None:  # (None: an older checkpoint's, of one process only)
            self.generators.load_state_dict(state["rng"])
        if self.step < self.cfg.train.max_steps:  # (a finished run says so, and stops, in fit)
            log.info("resume: continuing from %s at step %d", self.resume_from, self.step)
        changed = schedule_change(state, self.cfg.train, self.step)
        if changed and self.plan.is_main:
            log.warning("resume: %s", changed)

    def _read_resume_state(self) -> dict[str, Any] | None:
        """The checkpoint's trainer state, every field checked before it is used, and refused
        when it belongs to another run."""
        if self.resume_from is None:
            return None
        state = read_trainer_state(self.resume_from)
        check_resume_state(
            state,
            self.resume_from,
            self.cfg,
            self.manifest["tokenizer"]["sha256"],
            self.checkpointer.dir,
        )
        check_finished_run(state, self.resume_from, self.cfg)  # other settings: a new run
        return state

    def _foreign_weights(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Model weights of a checkpoint this backend cannot restore exactly (another backend,
        or DeepSpeed with another ZeRO stage or world size): the optimizer starts afresh."""
        log.warning("resume: %s", foreign_layout(state, self.resume_from))
        return load_model_weights(self.resume_from, empty_state_dict(self.cfg.model))

    # ----------------------------------------------------------------- run dir
    def _write_run_dir(self) -> None:
        """The run's own files, each replaced whole (the run dir is this launch's: locked, and
        checked to be new, empty or a run's by `check_run_dir`)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.run_dir / "config.yaml")  # as the user wrote it
        atomic_write_json(self.run_dir / PLAN_FILE, self.plan.to_json())
        for name, text in self.backend.run_files().items():
            atomic_write_text(self.run_dir / name, text)
        src = Path(self.cfg.data.dir) / self.manifest["tokenizer"]["file"]
        name = run_copy_name(self.manifest["tokenizer"]["file"])
        atomic_write_bytes(self.run_dir / name, src.read_bytes())


def train(cfg: Config, plan: RunPlan) -> TrainResult:
    return Trainer(cfg, plan).fit()


def _log_model(model: Transformer, cfg: Config) -> None:
    log.info(
        "model: %.2fM parameters (%.2fM without embeddings), %d layers, d_model %d",
        model.num_params() / 1e6,
        model.num_params(exclude_embeddings=True) / 1e6,
        cfg.model.n_layers,
        cfg.model.d_model,
    )
