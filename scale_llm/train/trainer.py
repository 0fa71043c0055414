"""The trainer: it builds a checked run (`RunSpec`, from `preflight`) and loops.

Build: the backend parallelizes, shards and materializes the meta-device model; the loader, the
run dir's files and the callbacks follow. Loop, per optimizer step: set the LR; for each of
grad_accum micro-batches run forward under the backend's precision context, divide the loss by
grad_accum and backward (gradients are synced only on the last micro-step); then one global-norm
clip and one optimizer step; then the callbacks (metrics, validation, samples, eval.tasks,
checkpoints, GC, the profiler; train/callbacks.py). Losses and norms stay on the device and are
read (a host sync) only on logging steps.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import signal
import sys
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scale_llm.components.checkpoint import (
    RECORDED,
    TRAINER_FORMAT,
    TRAINER_STATE,
    Checkpointer,
    CheckpointWeights,
)
from scale_llm.components.hardware import peak_flops
from scale_llm.components.optim import lr_at
from scale_llm.components.serialization import background_save, save_file
from scale_llm.config import Config, save_config, to_dict
from scale_llm.config.plan import RunPlan
from scale_llm.data.loader import TrainLoader
from scale_llm.data.tokenizer import run_copy_name
from scale_llm.errors import UserError
from scale_llm.files import atomic_write_bytes, atomic_write_json, atomic_write_text
from scale_llm.model import Transformer, build_model
from scale_llm.parallel.backend import build_backend
from scale_llm.parallel.step import optimizer_step
from scale_llm.train import callbacks
from scale_llm.train.cadence import Cadence
from scale_llm.train.collector import GarbageCollector
from scale_llm.train.eval_tasks import remove_scratch
from scale_llm.train.guards import StopSignals, maybe_fail, out_of_memory
from scale_llm.train.init_from import load_init_weights
from scale_llm.train.lock import RunLock
from scale_llm.train.metrics import MetricsLogger
from scale_llm.train.preflight import COMM_TRACE, RunSpec, preflight
from scale_llm.train.profiling import StepProfiler
from scale_llm.train.resume import foreign_layout, schedule_change
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
    def __init__(self, spec: RunSpec):
        self.spec, self.cfg, self.plan = spec, spec.cfg, spec.plan
        self.device, self.run_dir, self.data = spec.plan.device, spec.cfg.run_dir, spec.data
        self.resume_from = spec.resume.checkpoint if spec.resume else None
        self.complete = spec.complete  # a finished run: write nothing
        self.lock = RunLock(self.run_dir)
        try:
            self._build()
        except BaseException:
            self.lock.release()
            raise

    @property
    def val_windows(self):
        """The smallest validation split (a mixture's smallest source)."""
        return min(self.data.val.values(), key=len)

    # ----------------------------------------------------------------- build
    def _build(self) -> None:
        cfg, plan = self.cfg, self.plan
        # checkpoint.async_mode: how saves copy the state and where its files are written
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
            self.data.train,
            plan,
            cfg.run.seed,
            cfg.data.prefetch,
            self.data.sources,
            cfg.data.repeat,
        )
        self.generators = Generators(plan.rank)
        self.step = 0
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self.bad_streak = torch.zeros((), dtype=torch.int64, device=self.device)
        if self.spec.resume is not None:
            self.load_state_dict(self.spec.resume.state, self.spec.resume.exact)
        self.cadence = Cadence(cfg, self.step)
        if plan.is_main and not self.complete:
            self.lock.acquire()  # every check passed: from here on this launch owns the dir
            remove_scratch(self.run_dir)  # eval.tasks' of a killed launch
            if self.resume_from is not None:
                self.checkpointer.abandon_after(self.step)
            self._write_run_dir()
        self.metrics = MetricsLogger(
            self.run_dir, plan.is_main and not self.complete, cfg, self.step
        )
        self.collector = GarbageCollector(cfg.train.gc_every)
        self.profiler = StepProfiler(cfg.train.profile, plan, self.run_dir, self.step)
        self.nan_guard = callbacks.NaNGuard()
        self.callbacks: list[callbacks.Callback] = [
            callbacks.TrainMetrics(),
            self.nan_guard,
            callbacks.Validation(),
            callbacks.Samples(),
            callbacks.TaskScores(),
            callbacks.WriteMetrics(),
            callbacks.CommTimeouts(),
            self.collector,
            callbacks.Checkpoints(),
            self.profiler,
        ]

    def _measure(self, model: Transformer) -> None:
        """The model's size in the log, and what MFU divides by."""
        log.info(
            "model: %.2fM parameters (%.2fM without embeddings), %d layers, d_model %d",
            model.num_params() / 1e6,
            model.num_params(exclude_embeddings=True) / 1e6,
            self.cfg.model.n_layers,
            self.cfg.model.d_model,
        )
        self.flops_per_token = model.flops_per_token()  # MFU's convention: attention whole
        self.causal_flops_per_token = model.flops_per_token(causal=True)  # the work done
        plan = self.plan
        self.peak_flops = peak_flops(plan.device, plan.precision, self.cfg.logging.peak_tflops)
        if self.peak_flops is None:
            log.info(
                "mfu: not reported: no known peak FLOP/s for %s in %s (set "
                "logging.peak_tflops to the device's dense peak to report it)",
                plan.device,
                plan.precision,
            )

    def _initial_weights(self) -> Mapping[str, torch.Tensor] | None:
        """Weights that replace the seeded init, each read when the backend asks for it (a
        sharded backend takes one whole parameter at a time): a checkpoint this backend
        cannot restore exactly (another backend, or DeepSpeed with another ZeRO stage or world
        size: the optimizer starts afresh), or model.init_from's."""
        resume = self.spec.resume
        if resume is not None and not resume.exact:
            log.warning("resume: %s", foreign_layout(resume.state, resume.checkpoint))
            shapes = build_model(self.cfg.model).state_dict()  # (meta tensors: no memory)
            return CheckpointWeights(resume.checkpoint, shapes)
        if self.spec.init_from is not None:
            return load_init_weights(self.cfg.model, self.spec.init_from)
        return None

    # ----------------------------------------------------------------- loop
    def fit(self) -> TrainResult:
        """Train to train.max_steps; stop early (with a checkpoint) at train.exit_at_step or on
        SIGTERM / SIGINT. The callbacks log, evaluate and checkpoint on the way."""
        t = self.cfg.train
        self.result = result = TrainResult(self.run_dir, self.step, start_step=self.step)
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
        started: list[callbacks.Callback] = []
        try:
            with StopSignals() as signals:
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
                    end = callbacks.StepEnd(self.step, loss, grad_norm, lr, self._stop(signals))
                    for callback in self.callbacks:
                        callback.step_end(self, end)
                    if end.stop:
                        self._say_stop(end.stop)
                        result.stopped = end.stop
                        break
        finally:
            try:
                self._end(started, failing=sys.exc_info()[0] is not None)
            finally:
                result.seconds = self.clock.elapsed()
                self.loader.close()
                self.lock.release()
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
        """One optimizer step over grad_accum micro-batches; returns (loss, grad_norm, lr).

        A non-finite norm means the step was skipped (a non-finite loss makes its gradients
        non-finite too); runs of them are counted on the device (no host sync) for the NaN
        guard. The verdict comes from the global norm alone, the same on every rank (this
        rank's own loss is not), so every rank decides alike whether to stop.
        """
        lr = lr_at(self.step, self.cfg.train)
        self.backend.set_lr(lr)
        loss, grad_norm = optimizer_step(self.backend, self.model, self.loader.next_batches())
        bad = (~torch.isfinite(grad_norm)).long()
        self.skipped_steps += bad
        self.bad_streak = (self.bad_streak + 1) * bad
        return loss, grad_norm, lr

    def _stop(self, signals: StopSignals) -> str | None:
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

    def _say_stop(self, why: str) -> None:
        t = self.cfg.train
        then = (
            f"launch again to continue to step {t.max_steps}"
            if self.step < t.max_steps
            else "the run is complete"
        )
        log.info("stop: %s after step %d; %s", why, self.step, then)

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Save (atomically). A skipped step changed no weight and no optimizer state, so a
        checkpoint due on one is still written (the final one, a stop's, an fp16 overflow's):
        it holds the last good weights, with the data position past the skipped batches. A run
        of train.max_bad_steps skipped steps stops here instead (TrainingDiverged)."""
        streak = int(self.bad_streak.item())
        if streak:
            self.nan_guard.check(self)  # raises at train.max_bad_steps
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
            "format": TRAINER_FORMAT,
            "step": self.step,
            "data": self.loader.state_dict(),
            "rng": self.generators.state_dict(),  # one entry per rank
            "skipped_steps": int(self.skipped_steps.item()),
            # a checkpoint can fall inside a run of skipped steps: a resume continues its count
            "bad_streak": int(self.bad_streak.item()),
            "config": to_dict(self.cfg),
            "plan": self.plan.to_json(),
            "tokenizer_sha256": self.data.manifest["tokenizer"]["sha256"],
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
        self.generators.load_state_dict(state["rng"])
        if self.step < self.cfg.train.max_steps:  # (a finished run says so, and stops, in fit)
            log.info("resume: continuing from %s at step %d", self.resume_from, self.step)
        changed = schedule_change(state, self.cfg.train, self.step)
        if changed and self.plan.is_main:
            log.warning("resume: %s", changed)

    # ----------------------------------------------------------------- run dir
    def _write_run_dir(self) -> None:
        """The run's own files, each replaced whole (the run dir is this launch's: locked, and
        checked to be new, empty or a run's by the preflight)."""
        (self.run_dir / COMM_TRACE).mkdir(parents=True, exist_ok=True)  # (a timeout's dumps)
        save_config(self.cfg, self.run_dir / "config.yaml")  # as the user wrote it
        atomic_write_json(self.run_dir / PLAN_FILE, self.plan.to_json())
        for name, text in self.backend.run_files().items():
            atomic_write_text(self.run_dir / name, text)
        name = run_copy_name(self.spec.tokenizer.name)
        atomic_write_bytes(self.run_dir / name, self.spec.tokenizer.read_bytes())


def train(cfg: Config, plan: RunPlan) -> TrainResult:
    """Preflight, build, loop."""
    return Trainer(preflight(cfg, plan)).fit()
