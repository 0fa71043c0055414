"""The training loop: one code path for every backend and precision.

Per optimizer step: set the LR; for each of grad_accum micro-batches run forward under the
backend's precision context, divide the loss by grad_accum and backward (gradients are synced only
on the last micro-step); then one global-norm clip and one optimizer step. Losses and norms stay on
the device and are read (a host sync) only on logging steps.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scale_llm.components.checkpoint import (
    RECORDED,
    TRAINER_STATE,
    Checkpointer,
    load_model_weights,
    read_trainer_state,
    resolve_resume,
    saved_section,
)
from scale_llm.components.distributed import mean_over_ranks
from scale_llm.components.hardware import cuda_memory_gib, peak_flops
from scale_llm.components.optim import SCHEDULE_KEYS, lr_at
from scale_llm.components.serialization import save_file
from scale_llm.config import Config, TrainConfig, save_config, to_dict
from scale_llm.data.loader import TokenWindows, TrainLoader, eval_batches
from scale_llm.data.shards import open_split, read_manifest
from scale_llm.data.tokenizer import Tokenizer
from scale_llm.errors import UserError, require_writable_dir
from scale_llm.files import atomic_write_bytes, atomic_write_json, atomic_write_text
from scale_llm.memory import check_host_memory, estimate
from scale_llm.model import Transformer, build_model, empty_state_dict
from scale_llm.parallel.backend import build_backend
from scale_llm.parallel.step import optimizer_step
from scale_llm.plan import RunPlan
from scale_llm.train.collector import GarbageCollector
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
from scale_llm.train.preflight import check_run_dir
from scale_llm.train.resume import check_resume_state
from scale_llm.train.rng import Generators

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
        self.manifest = read_manifest(cfg.data.dir)
        self._check_vocab()
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
        self.checkpointer = Checkpointer(self.run_dir, cfg.checkpoint.keep_last, plan.is_main)
        self.resume_from = resolve_resume(cfg.checkpoint.resume, self.checkpointer)
        resume_state = self._read_resume_state()

        data_dir = Path(cfg.data.dir)
        self.train_windows, self.val_windows = (
            TokenWindows(
                open_split(data_dir, self.manifest, split),
                cfg.model.seq_len,
                cfg.model.vocab_size,  # every batch is checked against it
                [str(data_dir / x["file"]) for x in self.manifest["splits"][split]["shards"]],
            )
            for split in ("train", "val")
        )
        self._check_windows()  # data that cannot feed this run: before any memory check
        check_host_memory(cfg, plan)
        self.backend = build_backend(cfg, plan)
        model = build_model(cfg.model)  # on the meta device: no memory, no init yet
        _log_model(model, cfg)
        self.flops_per_token = model.flops_per_token()
        self.peak_flops = peak_flops(plan.device, plan.precision, cfg.logging.peak_tflops)
        if self.peak_flops is None:
            log.info(
                "mfu: not reported: no known peak FLOP/s for %s in %s (set "
                "logging.peak_tflops to the device's dense peak to report it)",
                plan.device,
                plan.precision,
            )
        exact = resume_state is not None and self.backend.can_restore(_layout_of(resume_state))
        initial = None
        if resume_state is not None and not exact:
            initial = self._foreign_weights(resume_state)
        if resume_state is None and cfg.model.init_from:
            initial = load_init_weights(cfg.model, self.manifest["tokenizer"]["sha256"])
        elif cfg.model.init_from:
            log.info("init_from: not used: resuming %s (newer weights)", self.resume_from)
        self.model = self.backend.setup(model, initial)

        self.loader = TrainLoader(self.train_windows, plan, cfg.run.seed, cfg.data.prefetch)
        self.collector = GarbageCollector(cfg.train.gc_every)
        self.generators = Generators(plan.rank)
        self.step = 0
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self.bad_streak = torch.zeros((), dtype=torch.int64, device=self.device)
        if resume_state is not None:
            self.load_state_dict(resume_state, exact)
        self.complete = self.step >= cfg.train.max_steps  # a finished run: write nothing
        if plan.is_main and not self.complete:
            self.lock.acquire()  # every check passed: from here on this launch owns the dir
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

    # ----------------------------------------------------------------- loop
    def fit(self) -> TrainResult:
        """Train to train.max_steps, logging, evaluating and checkpointing on the way; stop early
        (with a checkpoint) at train.exit_at_step or on SIGTERM / SIGINT."""
        t = self.cfg.train
        result = TrainResult(self.run_dir, self.step, start_step=self.step)
        if self.complete:
            log.info(
                "run already complete: %s is at step %d of train.max_steps=%d; nothing to do "
                "(raise train.max_steps to train further)",
                self.resume_from,
                self.step,
                t.max_steps,
            )
            result.complete = True
            self.loader.close()
            self.lock.release()
            return result
        self._log_batch()
        started = time.perf_counter()
        self._window = (started, self.step)  # (start time, start step) for tokens/s
        self._launch = (started, self.step)  # for elapsed time and ETA
        try:
            with StopSignals() as signals, self.collector as collector:
                while self.step < t.max_steps:
                    try:
                        loss, grad_norm, lr = self.train_step()
                    except torch.OutOfMemoryError as e:
                        raise UserError(self._out_of_memory(e)) from None
                    self.step += 1
                    maybe_fail("after_step", self.step, self.plan.rank)
                    self._record(loss, grad_norm, lr, result)
                    collector.step_done(self.step)
                    stop = self._stop_reason(signals)
                    every = self.cfg.checkpoint.every
                    if (every and self.step % every == 0) or self.step == t.max_steps or stop:
                        collector.before_checkpoint()
                        result.checkpoint = self.save_checkpoint()
                    if stop:
                        then = (
                            f"launch again to continue to step {t.max_steps}"
                            if self.step < t.max_steps
                            else "the run is complete"
                        )
                        log.info("stop: %s after step %d; %s", stop, self.step, then)
                        result.stopped = stop
                        break
        finally:
            result.seconds = time.perf_counter() - started
            self.loader.close()
            self.metrics.close()
            self.lock.release()
        result.steps = self.step
        return result

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
        self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, result: TrainResult
    ) -> None:
        """Metric row for logging and eval steps (the only places that read device values)."""
        cfg, t = self.cfg, self.cfg.train
        row: dict[str, Any] = {}
        if self.step % cfg.logging.every == 0 or self._first_or_last_step():
            row = self._train_metrics(loss, grad_norm, lr)
            result.losses[self.step] = row["loss"]
            result.grad_norms[self.step] = row["grad_norm"]
            self._check_divergence()
        if (
            cfg.eval.every
            and cfg.eval.steps
            and (self.step % cfg.eval.every == 0 or self.step == t.max_steps)
        ):
            row["val_loss"] = result.val_losses[self.step] = self.evaluate()
            row["val_perplexity"] = math.exp(min(row["val_loss"], 80.0))
            log.info(
                "step %d | val_loss %.4f | val_perplexity %.2f",
                self.step,
                row["val_loss"],
                row["val_perplexity"],
            )
        every = cfg.eval.sample_every
        if every and (self.step % every == 0 or self.step == t.max_steps):
            row["samples_text"] = self.sample()
            log.info("step %d | sample: %r", self.step, row["samples_text"][:200])
        if row:  # logging and eval rows carry the peak CUDA memory so far
            row.update(cuda_memory_gib(self.device))
            self.metrics.log(self.step, row)
            self._window = (time.perf_counter(), self.step)

    def _train_metrics(
        self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float
    ) -> dict[str, Any]:
        start, first_step = self._window
        tokens_per_s = (
            self.plan.tokens_per_step * (self.step - first_step) / (time.perf_counter() - start)
        )
        row = {
            "loss": mean_over_ranks(loss).item(),
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tokens_per_s,
            "tokens": self.plan.tokens_per_step * self.step,
            "skipped_steps": int(self.skipped_steps.item()),
        }
        peak = self.peak_flops
        if peak:
            row["mfu"] = self.flops_per_token * tokens_per_s / self.plan.world_size / peak
        log.info(
            "step %d/%d (%s) | loss %.4f | lr %.2e | grad_norm %.3f | %.0f tok/s%s | %s",
            self.step,
            self.cfg.train.max_steps,
            f"{self.step / self.cfg.train.max_steps:.0%}",
            row["loss"],
            lr,
            row["grad_norm"],
            tokens_per_s,
            f" | mfu {row['mfu']:.1%}" if "mfu" in row else "",
            self._progress(),
        )
        return row

    def _progress(self) -> str:
        """elapsed (this launch) and the ETA to max_steps at this launch's mean step time."""
        start, first_step = self._launch
        elapsed = time.perf_counter() - start
        done = self.step - first_step
        left = self.cfg.train.max_steps - self.step
        eta = _duration(elapsed / done * left) if done else "?"
        return f"elapsed {_duration(elapsed)} | eta {eta}"

    def sample(self) -> str:
        """A greedy continuation of eval.sample_prompt, decoded on every rank in lockstep.

        Every forward is a full seq_len window (right-padded: causal attention never sees the
        padding), so sharded backends run the same collectives on each rank; with train.compile
        the prompt row is repeated to (micro_batch_size, seq_len), the shape the blocks were
        compiled for; a fixed number of tokens is generated (no early stop that ranks could disagree
        on), and the text is cut at the first EOS."""
        cfg = self.cfg
        tokenizer = Tokenizer(Path(cfg.data.dir) / self.manifest["tokenizer"]["file"])
        T = cfg.model.seq_len
        ids = tokenizer.encode(cfg.eval.sample_prompt, bos=True)[-(T - 1) :]
        rows = self.plan.micro_batch_size if self.backend.compile else 1  # compiled: its shape
        window = torch.full((rows, T), tokenizer.eos_id, dtype=torch.long)
        window[:, : len(ids)] = torch.tensor(ids)
        window, filled, new = window.to(self.device), len(ids), []
        self.model.eval()
        for _ in range(cfg.eval.sample_tokens):
            with torch.no_grad(), self.backend.forward_context():
                logits = self.model(window)
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
            saved = self.checkpointer.complete()
            good = self.step - streak  # the last step whose update was applied
            holds = good if saved and saved[-1][0] > good else None  # saved inside the streak
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
            if not self._syncs_anyway():
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

    def _first_or_last_step(self) -> bool:
        """This launch's first step (step 1, or the first after a resume) and the run's last:
        always logged, so every launch's console and summary start and end with a loss."""
        return self.step in (self._launch[1] + 1, self.cfg.train.max_steps)

    def _syncs_anyway(self) -> bool:
        """Steps that read device values or save: logging, eval, checkpoint and the last."""
        cfg, step = self.cfg, self.step
        return (
            step % cfg.logging.every == 0
            or self._first_or_last_step()
            or step == cfg.train.exit_at_step
            or bool(cfg.checkpoint.every and step % cfg.checkpoint.every == 0)
            or bool(cfg.eval.every and cfg.eval.steps and step % cfg.eval.every == 0)
        )

    def _log_batch(self) -> None:
        log.info("plan: %s", self.plan.describe())

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over eval.steps global batches of validation windows, over all ranks."""
        self.model.eval()
        total, count = torch.zeros((), device=self.device), 0
        for inputs, targets in eval_batches(self.val_windows, self.plan, self.cfg.eval.steps):
            with self.backend.forward_context():
                total += self.backend.loss_fn(self.model(inputs), targets)
            count += 1
        self.model.train()
        return mean_over_ranks(total / count).item()

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

        def write(tmp: Path) -> None:
            self.backend.save(tmp)
            maybe_fail("mid_save", self.step, self.plan.rank)
            state = self.state_dict()  # a collective (every rank's generators)
            if self.plan.is_main:
                save_file(state, tmp / TRAINER_STATE)

        path = self.checkpointer.save(self.step, write)
        log.info("checkpoint: saved %s", path)
        return path

    def state_dict(self) -> dict[str, Any]:
        """Everything but the model and optimizer (which the backend writes itself)."""
        return {
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
            if isinstance(state.get("backend"), dict):
                self.backend.load_state_dict(state["backend"])
        self.step = int(state["step"])
        self.loader.load_state_dict(state["data"])
        self.skipped_steps.fill_(int(state.get("skipped_steps", 0)))
        self.bad_streak.fill_(int(state.get("bad_streak", 0)))
        if isinstance(state.get("rng"), list):
            self.generators.load_state_dict(state["rng"])
        log.info("resume: continuing from %s at step %d", self.resume_from, self.step)
        self._check_schedule_change(state)

    def _check_schedule_change(self, state: dict[str, Any]) -> None:
        """A resume with another schedule (typically a raised train.max_steps) keeps going from
        the LR the new settings give at this step: say so once when that LR is not the one the
        checkpoint's run would have used (wsd and constant extend without a jump)."""
        # (checked by check_resume_state; read with the same coercions as a user config)
        before = saved_section(TrainConfig, "train", state["config"].get("train") or {})[0]
        t = self.cfg.train
        old, new = lr_at(self.step, before), lr_at(self.step, t)
        if self.plan.is_main and not math.isclose(old, new, rel_tol=1e-9, abs_tol=0.0):
            changed = [
                f"train.{k}: {getattr(before, k)} -> {getattr(t, k)}"
                for k in SCHEDULE_KEYS
                if getattr(before, k) != getattr(t, k)
            ]
            log.warning(
                "resume: the LR schedule changed (%s): the LR at step %d is %.3g, not the %.3g "
                "the checkpoint's settings give%s",
                ", ".join(changed) or "settings",
                self.step,
                new,
                old,
                "; train.lr_schedule=wsd extends a run without a jump while it has not begun "
                "its decay"
                if t.lr_schedule != "wsd"
                else "",
            )

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
        return state

    def _foreign_weights(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Model weights of a checkpoint this backend cannot restore exactly (another backend,
        or DeepSpeed with another ZeRO stage or world size): the optimizer starts afresh."""
        plan = state.get("plan", {})
        log.warning(
            "resume: %s was written by %s on %s ranks (layout %s); loading its model weights "
            "only: the optimizer moments start again from zero",
            self.resume_from,
            plan.get("backend", state.get("backend", "an older version")),
            plan.get("world_size", state.get("world_size", "?")),
            _layout_of(state),
        )
        return load_model_weights(self.resume_from, empty_state_dict(self.cfg.model))

    # ----------------------------------------------------------------- checks / run dir
    def _check_vocab(self) -> None:
        tok_vocab = self.manifest["tokenizer"]["vocab_size"]
        if tok_vocab != self.cfg.model.vocab_size:
            raise UserError(
                f"model.vocab_size={self.cfg.model.vocab_size} does not match the "
                f"tokenizer in data.dir={self.cfg.data.dir} ({tok_vocab} pieces); "
                f"set model.vocab_size={tok_vocab}, or re-run `scale-llm prepare` "
                f"with the vocab size you want"
            )

    def _out_of_memory(self, error: torch.OutOfMemoryError) -> str:
        """The one paragraph a device's out-of-memory error becomes: what ran out, what the
        estimate says of these settings, and the ways to fit."""
        est, gib = estimate(self.cfg, self.plan), 2**30
        what = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
        size, capacity = "SIZE", ""
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            size, capacity = f"{total / gib:.0f}GiB", f" of its {total / gib:.1f} GiB"
        config = self.run_dir / "config.yaml"
        return (
            f"rank {self.plan.rank} ran out of {self.device.type.upper()} memory{capacity} in "
            f"step {self.step + 1} ({what}). The estimate for these settings is "
            f"{est.gpu['total'] / gib:,.1f} GiB per device (micro-batch "
            f"{self.plan.micro_batch_size} x seq_len {self.cfg.model.seq_len}, "
            f"activation_checkpointing.mode={self.cfg.activation_checkpointing.mode}, backend "
            f"{self.plan.backend}, {self.plan.world_size} process(es)); `scale-llm estimate "
            f"{config} --fit {size}` prints settings that fit, as --set overrides, and `train "
            f"--fit auto` applies them at launch. By hand: a "
            f"smaller train.micro_batch_size (with train.grad_accum raised to keep the batch), "
            f"activation_checkpointing.mode=full, or parallel.backend=fsdp to shard the model "
            f"over more GPUs."
        )

    def _check_windows(self) -> None:
        if len(self.train_windows) == 0 or len(self.val_windows) == 0:
            raise UserError(
                f"data.dir={self.cfg.data.dir} has too few tokens for "
                f"model.seq_len={self.cfg.model.seq_len} (train windows: "
                f"{len(self.train_windows)}, val windows: {len(self.val_windows)}); "
                f"use a larger corpus or a shorter seq_len"
            )
        per_step = self.plan.sequences_per_step
        if per_step > len(self.train_windows):
            raise UserError(
                f"one optimizer step reads {per_step:,} sequences (train.micro_batch_size "
                f"{self.plan.micro_batch_size} x train.grad_accum {self.plan.grad_accum} x "
                f"{self.plan.dp_degree} rank(s)) but data.dir={self.cfg.data.dir} holds "
                f"{len(self.train_windows):,} training windows of model.seq_len "
                f"{self.cfg.model.seq_len}: every step would repeat the data; lower "
                f"train.grad_accum or train.micro_batch_size, or prepare more data"
            )

    def _write_run_dir(self) -> None:
        """The run's own files, each replaced whole (the run dir is this launch's: locked, and
        checked to be new, empty or a run's by `check_run_dir`)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.run_dir / "config.yaml")  # as the user wrote it
        atomic_write_json(self.run_dir / PLAN_FILE, self.plan.to_json())
        for name, text in self.backend.run_files().items():
            atomic_write_text(self.run_dir / name, text)
        src = Path(self.cfg.data.dir) / self.manifest["tokenizer"]["file"]
        atomic_write_bytes(self.run_dir / "tokenizer.model", src.read_bytes())


def train(cfg: Config, plan: RunPlan) -> TrainResult:
    return Trainer(cfg, plan).fit()


def _duration(seconds: float) -> str:
    """2h03m, 4m05s, 12s."""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{sec:02d}s" if m else f"{sec}s"


def _log_model(model: Transformer, cfg: Config) -> None:
    log.info(
        "model: %.2fM parameters (%.2fM without embeddings), %d layers, d_model %d",
        model.num_params() / 1e6,
        model.num_params(exclude_embeddings=True) / 1e6,
        cfg.model.n_layers,
        cfg.model.d_model,
    )


def _layout_of(state: dict[str, Any]) -> dict[str, Any]:
    """The backend's description of a checkpoint's layout (older checkpoints kept its parts
    among the trainer's own keys)."""
    backend = state.get("backend")
    if isinstance(backend, dict):
        return backend["layout"]
    return {k: state[k] for k in ("format", "zero_stage", "world_size") if k in state}
