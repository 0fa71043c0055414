"""One optimizer step through any backend: the accumulation loop the trainer and bench share."""

from __future__ import annotations

import torch

from scale_llm.parallel.backend import Backend


def optimizer_step(
    backend: Backend, model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate the micro-batches, then clip + step: (mean loss, pre-clip norm) on the device."""
    accum = len(batches)
    loss_sum = torch.zeros((), device=batches[0][0].device)
    for i, (inputs, targets) in enumerate(batches):
        with backend.sync_context(sync_gradients=i == accum - 1):
            loss_sum += backend.forward_backward(model, inputs, targets, accum)
    return loss_sum, backend.clip_and_step()
