"""Activation checkpointing per transformer block, applied from outside the model definition.

Modes (`activation_checkpointing.mode`):
  none       every block keeps what its backward needs
  full       every block keeps only its input and recomputes its forward during backward
  every_k    blocks 0, k, 2k, ... are checkpointed (`activation_checkpointing.k`), the others
             keep everything: a memory / recompute trade-off between none and full
  selective  op-level: every block keeps the outputs of its matmuls and attention kernels and
             recomputes the cheap element-wise ops (norms, casts, rotary, SiLU, products)

All use torch.utils.checkpoint with use_reentrant=False, so numerics equal `none`. A block's
`forward` is wrapped in place rather than the block being replaced by a wrapper module, so
parameter names (and so checkpoints) are the same in every mode.
"""

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
    context_fn = _selective_context if ac.mode == "selective" else None
    chosen = checkpointed_blocks(ac, len(model.layers))
    for i in chosen:
        checkpoint_module(model.layers[i], context_fn)
    return len(chosen)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_keep_matmuls)


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
