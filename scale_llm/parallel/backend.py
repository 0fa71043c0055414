"""The backend interface the trainer calls (it never asks which one it holds), the single-process
backend, and the registry. Every backend draws the weights from `run.seed` as one process does."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from scale_llm.components.checkpoint import DCP_DIR, load_state_into
from scale_llm.components.distributed import is_distributed
from scale_llm.components.loss import compiled_loss, cross_entropy
from scale_llm.components.optim import build_optimizer, set_lr, step_if_finite
from scale_llm.components.precision import Precision
from scale_llm.components.serialization import BackgroundSave, dcp_save
from scale_llm.config import Config, compiles
from scale_llm.config.plan import RunPlan
from scale_llm.model import Transformer, materialize
from scale_llm.parallel.activation_checkpointing import apply_activation_checkpointing
from scale_llm.parallel.compile import compile_blocks, require_own_cache
from scale_llm.parallel.fp8 import apply_fp8, plain_tensors, precompute_scales_after_steps


class Backend:
    """One process, one device: the reference every other backend must agree with."""

    donates_buffers = True  # (compiled blocks' backwards reuse their saved buffers)

    def __init__(self, cfg: Config, plan: RunPlan):
        self.cfg, self.plan = cfg, plan
        self.precision = Precision(plan.precision, plan.device.type)
        self.model: nn.Module | None = None  # what forward is called on (maybe a wrapper)
        self.module: Transformer | None = None  # the model itself
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler = self.precision.grad_scaler()  # fp16 only
        self.compile = compiles(cfg.train, plan.device.type)  # (auto: on a GPU)
        if self.compile:  # (the loss compiles even where the blocks stay eager: ZeRO-3)
            require_own_cache()
        self.loss_fn = compiled_loss() if self.compile else cross_entropy
        # gradients in storage kept anyway (DDP's bucket views) are zeroed, not freed: else the
        # next no_sync() micro-steps accumulate into fresh tensors (one more gradient copy)
        self.zero_grads_in_place = False

    def setup(self, model: Transformer, initial_weights: Mapping | None = None) -> nn.Module:
        """Materialize, wrap, build the optimizer; `initial_weights` replace the seeded init."""
        self.module = model
        apply_fp8(model, self.cfg, self.plan)  # first: TP, checkpointing, compile, FSDP wrap it
        self.model = self.wrap(model, initial_weights)
        self.optimizer = build_optimizer(self.model, self.cfg.train)
        precompute_scales_after_steps(self.model, self.optimizer, self.cfg, self.plan)
        return self.model

    def wrap(self, model: Transformer, initial_weights: Mapping | None = None) -> nn.Module:
        self.materialize_on_cpu(model, initial_weights).to(self.plan.device)
        self.transform_blocks(model)
        return model

    def transform_blocks(self, model: Transformer) -> None:
        """Per block, before any sharding: activation checkpointing, then torch.compile. Under
        tensor parallelism full / every-k checkpointing goes around the compiled block (inside,
        torch 2.13's AOTAutograd saves a DeviceMesh among its tensors and fails)."""
        ac = self.cfg.activation_checkpointing
        around = self.compile and self.plan.tp_degree > 1 and ac.mode != "selective"
        if not around:
            apply_activation_checkpointing(model, ac)
        if self.compile:
            compile_blocks(model, donate=self.donates_buffers)
        if around:
            apply_activation_checkpointing(model, ac)

    def materialize_on_cpu(self, model: Transformer, initial: Mapping | None = None) -> Transformer:
        """The model's weights on the CPU: drawn from run.seed, or `initial` (a full state dict)."""
        torch.manual_seed(self.cfg.run.seed)
        materialize(model, "cpu")
        if initial is not None:
            model.load_state_dict(initial)
        return model

    def run_files(self) -> dict[str, str]:
        """Extra files (name -> text) the run directory should hold, e.g. a generated config."""
        return {}

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast()

    def sync_context(self, sync_gradients: bool) -> contextlib.AbstractContextManager:
        """Entered around each micro-step; gradients are reduced only when sync_gradients."""
        return contextlib.nullcontext()

    def forward_backward(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, accum: int
    ) -> torch.Tensor:
        """One micro-step: forward, the loss / `accum`, backward; returns that loss, detached."""
        with self.forward_context():
            loss = self.loss_fn(model(inputs), targets) / accum
        self.backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def clip_and_step(self) -> torch.Tensor:
        """Clip, step, zero grads; returns the pre-clip norm, non-finite if the step was skipped."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
            norm = self.clip_grad_norm(self.cfg.train.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            norm = self.clip_grad_norm(self.cfg.train.grad_clip)
            step_if_finite(self.optimizer, norm)
        self.optimizer.zero_grad(set_to_none=not self.zero_grads_in_place)
        return norm

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor -> tensor

    def logits_for_sampling(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's output as whole logits on this rank (tensor parallelism shards them)."""
        return logits

    def eval_loss(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """The summed token-mean losses of the first `rows` rows, on every rank (all run it)."""
        logits = model(inputs)
        if not rows:
            return torch.zeros((), device=inputs.device)
        part = logits if rows == len(inputs) else logits[:rows]
        return self.loss_fn(part, targets[:rows]) * rows

    def next_token_logits(
        self, model: nn.Module, window: torch.Tensor, position: int
    ) -> torch.Tensor:
        """The whole (V,) logits of the first row at `position`, on every rank."""
        return self.logits_for_sampling(model(window))[0, position]

    def checkpoint_layout(self) -> dict[str, Any]:
        """How `save` lays out model and optimizer, stored with the checkpoint."""
        return checkpoint_layout(self.cfg, self.plan)

    def loss_scale(self) -> float | None:
        """fp16's current loss scale (a host sync; logging steps only), None without one."""
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def state_dict(self) -> dict[str, Any]:
        """The backend's small state (kept in the trainer state): its layout and the scaler."""
        scaler = self.scaler.state_dict() if self.scaler is not None else {}
        return {"layout": self.checkpoint_layout(), "scaler": scaler}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("scaler") and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

    def save(self, ckpt_dir: Path, background: BackgroundSave | None = None) -> Future | None:
        """Model and optimizer to DCP by name (any backend, world size); `background`: a Future."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return dcp_save(
            plain_tensors({"model": model_sd, "optimizer": optim_sd}),
            ckpt_dir / DCP_DIR,
            no_dist=not is_distributed(),
            background=background,
        )

    def load(self, ckpt_dir: Path, layout: dict[str, Any]) -> None:
        """Model and optimizer from DCP's files, or DeepSpeed's partitions one parameter at a
        time (`layout`: the checkpoint's). Each param group keeps this rank's names: DCP keeps
        rank 0's, and a rank holding other parameters (a pipeline stage) would lose theirs."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        mine = [group["params"] for group in optim_sd["param_groups"]]
        state = {"model": model_sd, "optimizer": optim_sd}
        load_state_into(state, ckpt_dir)
        for group, names in zip(state["optimizer"]["param_groups"], mine, strict=True):
            group["params"] = names
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )


def checkpoint_layout(cfg: Config, plan: RunPlan) -> dict[str, Any]:
    """DCP (any world size) or DeepSpeed's files: its own loader reads them back only at the
    same ZeRO stage, world size, precision (its optimizer files are named by precision) and
    optimizer (CPU Adam's state is not torch AdamW's)."""
    if plan.backend == "deepspeed":
        return {
            "format": "deepspeed",
            "zero_stage": cfg.parallel.deepspeed.zero_stage,
            "world_size": plan.world_size,
            "precision": plan.precision,
            "offload_optimizer": cfg.parallel.deepspeed.offload_optimizer,
        }
    return {"format": "dcp"}


def build_backend(cfg: Config, plan: RunPlan) -> Backend:
    """The backend class for the plan's backend (imported lazily: deepspeed is heavy)."""
    name = plan.backend
    if name == "fsdp" and plan.pp_degree > 1:
        from scale_llm.parallel.pipeline import PipelineBackend as cls
    elif name == "ddp":
        from scale_llm.parallel.ddp import DDPBackend as cls
    elif name == "fsdp":
        from scale_llm.parallel.fsdp import FSDPBackend as cls
    elif name == "deepspeed":
        from scale_llm.parallel.deepspeed import DeepSpeedBackend as cls
    else:
        cls = Backend
    return cls(cfg, plan)
