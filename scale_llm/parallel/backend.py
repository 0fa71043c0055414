"""The backend interface the trainer calls, the single-process backend, and the registry.

A backend decides how the model is spread over ranks: it materializes the meta-device model,
applies activation checkpointing, wraps it, owns the optimizer and the gradient scaler, and
implements the steps of accumulation (the sync-skipping context, backward, one clip + one step)
and checkpoint save / load. The trainer calls these methods and never asks which backend it holds.

Every backend initializes weights the same way: on the CPU from `run.seed`, then moved or sharded,
so a run starts from the same weights whatever the backend, world size or device.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from scale_llm.components.serialization import dcp_load, dcp_save, load_file, save_file
from scale_llm.config import Config
from scale_llm.model import Transformer, materialize
from scale_llm.parallel.checkpointing import apply_activation_checkpointing
from scale_llm.parallel.device import DistInfo, is_distributed
from scale_llm.train.checkpoint import DCP_DIR, SCALER_STATE
from scale_llm.train.optim import build_optimizer
from scale_llm.train.precision import Precision


def init_on_cpu(model: Transformer, seed: int) -> Transformer:
    """Materialize a meta-device model on the CPU with weights drawn from `seed`."""
    torch.manual_seed(seed)
    return materialize(model, "cpu")


class Backend:
    """One process, one device: the reference every other backend must agree with."""

    def __init__(self, cfg: Config, dist: DistInfo, precision: Precision):
        self.cfg, self.dist, self.precision = cfg, dist, precision
        self.model: nn.Module | None = None  # what forward is called on (maybe a wrapper)
        self.module: Transformer | None = None  # the model itself
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler = precision.grad_scaler()

    # ----------------------------------------------------------------- setup
    def setup(self, model: Transformer, initial_weights: dict | None = None) -> nn.Module:
        """Materialize, checkpoint blocks, wrap and build the optimizer; returns the model to
        call forward on. `initial_weights` (a full state dict) replaces the seeded init, e.g.
        when resuming from another backend's checkpoint."""
        self.module = model
        self.model = self.wrap(model, initial_weights)
        self.optimizer = build_optimizer(self.model, self.cfg.train)
        return self.model

    def wrap(self, model: Transformer, initial_weights: dict | None = None) -> nn.Module:
        init_on_cpu(model, self.cfg.run.seed)
        if initial_weights is not None:
            model.load_state_dict(initial_weights)
        model.to(self.dist.device)
        apply_activation_checkpointing(model, self.cfg.model)
        return model

    def run_files(self) -> dict[str, str]:
        """Extra files (name -> text) the run directory should hold, e.g. a generated config."""
        return {}

    # ----------------------------------------------------------------- one step
    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast()

    def sync_context(self, sync_gradients: bool) -> contextlib.AbstractContextManager:
        """Entered around each micro-step; gradients are reduced only when sync_gradients."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def clip_and_step(self) -> torch.Tensor:
        """Unscale, clip to train.grad_clip, step, zero grads; returns the pre-clip global norm.

        The norm stays a device tensor (no host sync). A non-finite norm means the step was
        skipped (by the fp16 scaler).
        """
        self.scaler.unscale_(self.optimizer)
        norm = self.clip_grad_norm(self.cfg.train.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor -> tensor

    # ----------------------------------------------------------------- state
    checkpoint_format = "dcp"

    def can_restore(self, trainer_state: dict[str, Any]) -> bool:
        """Whether a checkpoint (described by its trainer state) restores model and optimizer
        exactly here; if not, only its model weights are loaded."""
        return trainer_state.get("format") == "dcp"

    def save(self, ckpt_dir: Path) -> None:
        """Model and optimizer to torch.distributed.checkpoint, keyed by parameter name: the
        same layout for single, DDP and FSDP, loadable on any of them and any world size."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp_save(
            {"model": model_sd, "optimizer": optim_sd},
            ckpt_dir / DCP_DIR,
            no_dist=not is_distributed(),
        )
        if self.dist.is_main:
            save_file({"scaler": self.scaler.state_dict()}, ckpt_dir / SCALER_STATE)

    def load(self, ckpt_dir: Path) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp_load(state, ckpt_dir / DCP_DIR, no_dist=not is_distributed())
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        scaler = load_file(ckpt_dir / SCALER_STATE)["scaler"]
        if scaler:
            self.scaler.load_state_dict(scaler)


def build_backend(cfg: Config, dist: DistInfo, precision: Precision) -> Backend:
    """The backend class for parallel.backend (imported lazily: deepspeed is heavy)."""
    name = cfg.parallel.backend
    if name == "ddp":
        from scale_llm.parallel.ddp import DDPBackend as cls
    elif name == "fsdp":
        from scale_llm.parallel.fsdp import FSDPBackend as cls
    elif name == "deepspeed":
        from scale_llm.parallel.deepspeed import DeepSpeedBackend as cls
    else:
        cls = Backend
    return cls(cfg, dist, precision)
