"""Activation checkpointing per transformer block, applied from outside the model definition.

Each checkpointed block keeps only its input for backward and recomputes its forward during the
backward pass (torch.utils.checkpoint, use_reentrant=False). The block's `forward` is wrapped in
place rather than the block being replaced by a wrapper module, so parameter names (and so
checkpoints) are the same with checkpointing on or off.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Checkpoint the blocks in `model.layers` selected by `mode`; returns how many."""
    if mode == "none":
        return 0
    if mode != "full":
        raise ValueError(f"unknown activation checkpointing mode {mode!r}")
    for block in model.layers:
        checkpoint_module(block)
    return len(model.layers)


def checkpoint_module(module: nn.Module) -> None:
    if getattr(module, "_scale_llm_checkpointed", False):
        return
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # eval / generation: nothing to save, nothing to recompute
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    module._scale_llm_checkpointed = True
