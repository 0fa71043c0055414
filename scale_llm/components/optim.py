"""AdamW with decoupled weight decay on matrices only, and warmup + cosine learning rate."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from scale_llm.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on 2-D matmul weights; none on norms, biases and embeddings."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2 and id(p) not in embeddings]
    no_decay = [p for p in trained if p.ndim < 2 or id(p) in embeddings]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW, fused on a GPU and the CPU alike (faster than `foreach` there), so the CPU runs the
    GPU's optimizer path, its on-device skip of a non-finite step included."""
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=True,
    )


def step_if_finite(
    optimizer: torch.optim.Optimizer, norm: torch.Tensor, step: Callable[[], Any] | None = None
) -> None:
    """One optimizer step unless the gradient norm is not finite. A fused optimizer skips inside
    its kernel (found_inf, as for a GradScaler: no host sync). `step`: the optimizer's own step
    method when its attribute has been replaced."""
    step = optimizer.step if step is None else step
    if getattr(optimizer, "defaults", {}).get("fused"):
        optimizer.found_inf = (~torch.isfinite(norm)).float().reshape(())
        optimizer.grad_scale = None
        try:
            step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
    elif torch.isfinite(norm):
        step()


# the keys lr_at reads: a resume that changes one of them may change the LR it continues with
SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "max_steps", "lr_schedule", "decay_fraction")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then train.lr_schedule
    (cosine / linear to min_lr at max_steps; wsd: lr until the last decay_fraction, then linear;
    constant)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    schedule = cfg.lr_schedule
    if schedule == "constant":
        return cfg.lr
    start = cfg.warmup_steps
    if schedule == "wsd":
        start = max(start, cfg.max_steps - round(cfg.decay_fraction * cfg.max_steps))
        if step < start:
            return cfg.lr
    progress = min(1.0, (step - start) / max(1, cfg.max_steps - start))
    if schedule == "cosine":
        return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
    return cfg.lr + progress * (cfg.min_lr - cfg.lr)  # linear, and wsd's decay


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
