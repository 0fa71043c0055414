"""The trainer: it builds a checked run (`RunSpec`, from `preflight`) and loops: one optimizer
step (`optimizer_step`: loss/N accumulation, one clip), then the callbacks (train/callbacks.py).
Losses and norms stay on the device, read (a host sync) only on logging steps."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from scale_llm.components.checkpoint import (
    RECORDED,
    TRAINER_FORMAT,
    TRAINER_STATE,
    Checkpointer,
    CheckpointWeights,
    is_count,
    together,
)
from scale_llm.components.hardware import peak_flops
from scale_llm.components.optim import lr_at
from scale_llm.components.serialization import background_save, save_file
from scale_llm.config import Config, save_config, to_dict
from scale_llm.config.plan import RunPlan
from scale_llm.data.loader import TrainLoader
from scale_llm.data.tokenizer import run_copy_name
from scale_llm.errors import UserError
from scale_llm.files import atomic_write_bytes, atomic_write_json, atomic_write_text, make_owned_dir
from scale_llm.model import Transformer, build_model
from scale_llm.parallel.backend import build_backend
from scale_llm.parallel.step import optimizer_step
from scale_llm.train import callbacks, rng
from scale_llm.train.cadence import Cadence
from scale_llm.train.eval_tasks import remove_scratch
from scale_llm.train.guards import StopSignals, maybe_fail, out_of_memory
from scale_llm.train.init_from import load_init_weights
from scale_llm.train.metrics import MetricsLogger
from scale_llm.train.preflight import (
    COMM_TRACE,
    RUN_KIND,
    RunLock,
    RunSpec,
    preflight,
)
from scale_llm.train.profiling import StepProfiler
from scale_llm.train.resume import (
    batch_change,
    data_change,
    optimizer_change,
    saved_layout,
    schedule_change,
)
from scale_llm.train.throughput import Throughput

log = logging.getLogger(__name__)


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
    def __init__(self, spec: RunSpec):
        self.spec, self.cfg, self.plan = spec, spec.cfg, spec.plan
        self.device, self.run_dir, self.data = spec.plan.device, spec.cfg.run_dir, spec.data
        self.resume_from = spec.resume.checkpoint if spec.resume else None
        self.complete = spec.complete  # a finished run: write nothing
        self.lock = RunLock(self.run_dir)
        try:
            self._build()
        except BaseException:
            for built in (getattr(self, "metrics", None), getattr(self, "loader", None)):
                if built is not None:
                    built.close()
            self.lock.release()
            raise

    @property
    def val_windows(self):
        """The smallest validation split (a mixture's smallest source)."""
        return min(self.data.val.values(), key=len)

    def _build(self) -> None:
        cfg, plan, data = self.cfg, self.plan, self.data
        self.background = background_save(cfg.checkpoint.async_mode, plan.device)
        group = self.background.group if self.background else None
        self.checkpointer = Checkpointer(
            self.run_dir, cfg.checkpoint.keep_last, plan.is_main, group
        )
        self.backend = build_backend(cfg, plan)
        model = build_model(cfg.model)  # on the meta device: no memory, no init yet
        self._measure(model)
        self.model = self.backend.setup(model, self._initial_weights())
        self.loader = TrainLoader(
            data.train, plan, cfg.run.seed, cfg.data.prefetch, data.sources, cfg.data.repeat
        )
        self.step, self.tokens_at = 0, (0, 0)  # (a step, the tokens trained up to it)
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self.bad_streak = torch.zeros((), dtype=torch.int64, device=self.device)
        self.worst_streak = torch.zeros_like(self.bad_streak)  # the longest since a guard's check
        if self.spec.resume is not None:
            self.load_state_dict(self.spec.resume.state, self.spec.resume.exact)
        self.cadence = Cadence(cfg, self.step)
        own = self.resume_from is None or self.checkpointer.holds(self.resume_from)  # (history)
        writes = plan.is_main and not self.complete
        if writes:
            self.lock.acquire()  # every check passed: from here on this launch owns the dir
            remove_scratch(self.run_dir)  # eval.tasks' of a killed launch
            if self.resume_from is not None:
                self.checkpointer.abandon_after(self.step, self.resume_from)
            self._write_run_dir()
        self.metrics = MetricsLogger(self.run_dir, writes, cfg, self.step, self.step if own else 0)
        self.collector = callbacks.GarbageCollector(cfg.train.gc_every)
        self.nan_guard = callbacks.NaNGuard()
        self.callbacks: list[callbacks.Callback] = [
            callbacks.TrainMetrics(),
            self.nan_guard,
            callbacks.Validation(),
            callbacks.Samples(),
            callbacks.TaskScores(),
            callbacks.CommTimeouts(),
            self.collector,
            callbacks.Checkpoints(),
            callbacks.WriteMetrics(),
            callbacks.ThroughputWindow(),
            StepProfiler(cfg.train.profile, plan, self.run_dir, self.step),
        ]

    def _measure(self, model: Transformer) -> None:
        """The model's size in the log, and what MFU divides by."""
        m, plan = self.cfg.model, self.plan
        log.info(
            f"model: {model.num_params() / 1e6:.2f}M parameters ({model.num_params(True) / 1e6:.2f}"
            f"M without embeddings), {m.n_layers} layers, d_model {m.d_model}"
        )
        self.flops_per_token = model.flops_per_token()  # MFU's convention: attention whole
        self.causal_flops_per_token = model.flops_per_token(causal=True)  # the work done
        self.peak_flops = peak_flops(plan.device, plan.precision, self.cfg.logging.peak_tflops)
        if self.peak_flops is None:
            log.info(
                f"mfu: not reported: no known peak FLOP/s for {plan.device} in {plan.precision} "
                f"(set logging.peak_tflops to the device's dense peak to report it)"
            )

    def _initial_weights(self) -> Mapping[str, torch.Tensor] | None:
        """Weights that replace the seeded init, read one parameter at a time: a checkpoint this
        backend cannot restore exactly (the optimizer starts afresh), or model.init_from's."""
        resume = self.spec.resume
        if resume is not None and not resume.exact:
            plan, layout = resume.state["plan"], resume.state["backend"]["layout"]
            log.warning(
                f"resume: {resume.checkpoint} was written by {plan['backend']} on "
                f"{plan['world_size']} ranks (layout {layout}); loading its model weights only: "
                f"the optimizer moments start again from zero"
            )
            shapes = build_model(self.cfg.model).state_dict()  # (meta tensors: no memory)
            return CheckpointWeights(resume.checkpoint, shapes)
        if self.spec.init_from is not None:
            return load_init_weights(self.cfg.model, self.spec.init_from)
        return None

    def fit(self) -> TrainResult:
        """Train to train.max_steps, or stop early with a checkpoint (exit_at_step, a signal)."""
        t = self.cfg.train
        self.result = result = TrainResult(self.run_dir, self.step, start_step=self.step)
        if self.complete:
            log.info(
                f"run already complete: {self.resume_from} is at step {self.step} of train."
                f"max_steps={t.max_steps}; nothing to do (raise train.max_steps to train further, "
                f"or start a new run: --run-name NAME)"
            )
            result.complete = True
            self.loader.close()
            self.lock.release()
            return result
        log.info("plan: %s", self.plan.describe())
        self.clock = Throughput(self.plan.tokens_per_step, t.max_steps, self.step)
        started: list[callbacks.Callback] = []
        # a stop signal while the end runs (the last save written) is taken as the first was
        with StopSignals() as signals:
            self.signals = signals
            try:
                for callback in self.callbacks:
                    callback.start(self)
                    started.append(callback)
                while self.step < t.max_steps:
                    try:
                        loss, grad_norm, lr = self.train_step()
                    except torch.OutOfMemoryError as e:
                        raise UserError(out_of_memory(e, self.cfg, self.plan, self.step)) from None
                    self.step += 1
                    maybe_fail("after_step", self.step, self.plan.rank)
                    self.clock.step_done(self.step)
                    end = callbacks.StepEnd(self.step, loss, grad_norm, lr, self.stop_reason())
                    try:
                        for callback in self.callbacks:
                            callback.step_end(self, end)
                    except torch.OutOfMemoryError as e:
                        said = out_of_memory(e, self.cfg, self.plan, self.step, after=True)
                        raise UserError(said) from None
                    if end.stop:
                        then = f"launch again to continue to step {t.max_steps}"
                        if end.stop == "train.exit_at_step":  # (preflight refuses it again)
                            then += f", with train.exit_at_step above {self.step} or null"
                        if self.step >= t.max_steps:
                            then = "the run is complete"
                        log.info(f"stop: {end.stop} after step {self.step}; {then}")
                        result.stopped = end.stop
                        break
            finally:
                signals.ending = True
                try:
                    self._end(started, failing=sys.exc_info()[0] is not None)
                finally:
                    result.seconds = self.clock.elapsed()
                    self.loader.close()
                    self.checkpointer.drain()  # (a save left running by a second Ctrl-C)
                    self.lock.release()  # (not after a Ctrl-C in the drain: held until exit)
        result.steps = self.step
        return result

    def _end(self, started: list[callbacks.Callback], failing: bool) -> None:
        """Every started callback's `end`, last first, each even when another's raised (the
        first error is raised after all have run: GC back on, the profiler stopped)."""
        error: BaseException | None = None
        for callback in reversed(started):
            try:
                callback.end(self, failing or error is not None)
            except BaseException as e:  # (as nested `with` blocks would exit)
                error = error or e
        if error is not None:
            raise error

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step; returns (loss, grad_norm, lr). A non-finite global norm (the same on
        every rank, unlike the loss) marks a skipped step, counted on the device."""
        lr = lr_at(self.step, self.cfg.train)
        self.backend.set_lr(lr)
        loss, grad_norm = optimizer_step(self.backend, self.model, self.loader.next_batches())
        bad = (~torch.isfinite(grad_norm)).long()
        self.skipped_steps += bad
        self.bad_streak = (self.bad_streak + 1) * bad
        self.worst_streak = torch.maximum(self.worst_streak, self.bad_streak)
        return loss, grad_norm, lr

    def stop_reason(self) -> str | None:
        """Why to stop after this step, agreed by every rank: the signal flag is all-reduced only
        on steps that sync anyway, so a SIGTERM acts within `logging.every` steps."""
        received = self.signals.received
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

    def save_checkpoint(self) -> Path:
        """Save (atomically). A skipped step changed no weight or optimizer state, so a checkpoint
        due on one holds the last good weights; train.max_bad_steps of them stop here instead."""
        streak = int(self.bad_streak.item())
        if streak:
            self.nan_guard.check(self, warn=False)  # raises at train.max_bad_steps
            log.warning(
                f"checkpoint: step {self.step} was skipped (not finite): step "
                f"{self.step - streak}'s weights and optimizer state are saved as step {self.step}"
            )
        fault = partial(maybe_fail, "mid_save", self.step, self.plan.rank)
        background = self.background and replace(self.background, on_written=fault)

        def write(tmp: Path) -> None:
            if not background:
                with together():  # (a rank it failed on: known to all before the next collective)
                    self.backend.save(tmp)
                fault()
            state = self.state_dict()  # a collective (every rank's generators)
            if self.plan.is_main:
                save_file(state, tmp / TRAINER_STATE)

        def start(tmp: Path) -> Future:  # once every rank wrote: copied, written in a thread
            return self.backend.save(tmp, background)

        path = self.checkpointer.save(self.step, write, start if background else None)
        what = f"writing {path} in the background" if background else f"saved {path}"
        log.info(f"checkpoint: {what}")
        return path

    def tokens(self, step: int) -> int:
        """The tokens trained up to `step` (a resume with another batch: each step's own)."""
        return self.tokens_at[1] + self.plan.tokens_per_step * (step - self.tokens_at[0])

    def state_dict(self) -> dict[str, Any]:
        """Everything but the model and optimizer (which the backend writes itself)."""
        return {
            "format": TRAINER_FORMAT,
            "step": self.step,
            "data": self.loader.state_dict(),
            "rng": rng.gather_all_ranks(),  # one entry per rank (a collective)
            "skipped_steps": int(self.skipped_steps.item()),
            "tokens": self.tokens(self.step),
            # a checkpoint can fall inside a run of skipped steps: a resume continues its count
            "bad_streak": int(self.bad_streak.item()),
            "config": to_dict(self.cfg),
            "plan": self.plan.to_json(),
            "tokenizer_sha256": self.data.manifest["tokenizer"]["sha256"],
            "data_fingerprint": self.data.prepared,  # (a resume says when data.dir changed)
            "data_shards": self.data.shards,
            "backend": self.backend.state_dict(),  # its checkpoint layout and scaler
            RECORDED: True,  # the checkpoint carries integrity.json: without it, it is damaged
        }

    def load_state_dict(self, state: dict[str, Any], exact: bool) -> None:
        """Restore a checkpoint's trainer state (`exact`: the backend's model and optimizer too)."""
        if exact:
            self.backend.load(self.resume_from, saved_layout(state))
            self.backend.load_state_dict(state["backend"])
        self.step = int(state["step"])
        per_step = state["plan"].get("tokens_per_step")  # (a run's tokens before they were kept)
        per_step = per_step if is_count(per_step) else self.plan.tokens_per_step
        self.tokens_at = (self.step, int(state.get("tokens", per_step * self.step)))
        self.loader.load_state_dict(state["data"])
        self.skipped_steps.fill_(int(state["skipped_steps"]))
        self.bad_streak.fill_(int(state["bad_streak"]))
        self.worst_streak.fill_(int(state["bad_streak"]))
        rng.restore_for_rank(state["rng"], self.plan.rank)
        if self.step < self.cfg.train.max_steps:  # (a finished run says so, and stops, in fit)
            log.info(f"resume: continuing from {self.resume_from} at step {self.step}")
        for changed in (
            schedule_change(state, self.cfg.train, self.step),
            batch_change(state, self.plan),
            data_change(state, self.data.prepared, self.data.shards),
            optimizer_change(state, self.backend.optimizer, self.cfg.train) if exact else None,
        ):
            if changed and self.plan.is_main:
                log.warning("resume: %s", changed)

    def _write_run_dir(self) -> None:
        """The run's own files, each replaced whole (in the locked, preflight-checked run dir),
        the mark first: what lets a later launch write here."""
        make_owned_dir(self.run_dir, RUN_KIND, exists=True)
        (self.run_dir / COMM_TRACE).mkdir(parents=True, exist_ok=True)  # (a timeout's dumps)
        save_config(self.spec.asked, self.run_dir / "config.yaml")  # as given (`auto` kept)
        atomic_write_json(self.run_dir / "plan.json", self.plan.to_json())
        for name, text in self.backend.run_files().items():
            atomic_write_text(self.run_dir / name, text)
        name = run_copy_name(self.spec.tokenizer.name)
        atomic_write_bytes(self.run_dir / name, self.spec.tokenizer.read_bytes())


def train(cfg: Config, plan: RunPlan) -> TrainResult:
    """Preflight, build, loop."""
    return Trainer(preflight(cfg, plan)).fit()
