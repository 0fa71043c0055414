"""Activation checkpointing per block (`activation_checkpointing.mode`), non-reentrant (numerics
equal `none`); a block's `forward` is wrapped in place, so parameter names stay the same."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from scale_llm.config.parallel import ActivationCheckpointingConfig

_aten = torch.ops.aten
# Ops whose outputs selective checkpointing keeps: the expensive ones (matmuls, attention).
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_mm.default,  # train.fp8's matmuls (on a GPU)
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def checkpointed_blocks(ac: ActivationCheckpointingConfig, n_layers: int) -> list[int]:
    """Indices of the blocks that recompute their forward in backward."""
    if ac.mode in ("full", "selective"):
        return list(range(n_layers))
    if ac.mode == "every_k":
        return list(range(0, n_layers, ac.k))
    return []


def apply_activation_checkpointing(model: nn.Module, ac: ActivationCheckpointingConfig) -> int:
    """Checkpoint the blocks of `model.layers` that `ac` selects; returns how many."""
    selective = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
    context_fn = selective if ac.mode == "selective" else None
    chosen = checkpointed_blocks(ac, len(model.layers))
    for i in chosen:
        checkpoint_module(model.layers[i], context_fn)
    return len(chosen)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_module(module: nn.Module, context_fn=None) -> None:
    if getattr(module, "_scale_llm_checkpointed", False):
        return
    inner = module.forward
    extra = {"context_fn": context_fn} if context_fn else {}

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # eval / generation: nothing to save, nothing to recompute
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward
    module._scale_llm_checkpointed = True
