"""The training objective, one definition for the loop, bench, eval and the memory count."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss; logits (B, T, V) are upcast so the softmax runs in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def compiled_loss():
    """`cross_entropy` through torch.compile: the fp32 upcast, log-softmax and gather fuse into
    one kernel instead of materializing a fp32 copy of the (B, T, V) logits."""
    return torch.compile(cross_entropy, fullgraph=True)
