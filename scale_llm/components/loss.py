"""The training objective, one definition for the loop, bench, eval and the memory count.
`cross_entropy` never holds fp32 (B, T, V) logits: the same fp32 softmax, upcast ~16M logits at a
time and rebuilt chunk by chunk for backward, where the plain form keeps fp32 log-probabilities
of every row (2 GiB at 400m.yaml's micro-batch 16)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 24  # logits upcast at once (64 MiB in fp32)


def perplexity(loss: float) -> float:
    """exp(loss), inf past float64's range (exp(709.8)): no OverflowError, no cap."""
    return math.inf if loss >= 709 else math.exp(loss)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of logits (B, T, V) against targets (B, T), softmax in fp32."""
    flat = logits.flatten(0, 1)  # (B*T, V)
    rows = max(1, CHUNK_ELEMENTS // flat.size(-1))
    return _ChunkedCrossEntropy.apply(flat, targets.flatten(), rows)


def plain_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The textbook form (what torch.compile fuses; the reference the chunked one is tested on)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def compiled_loss():
    """The loss through torch.compile (`train.compile`): inductor fuses it into a reduction."""
    return torch.compile(plain_cross_entropy, fullgraph=True)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        n = logits.size(0)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, n, rows):
            logp = F.log_softmax(logits[start : start + rows].float(), dim=-1)  # one fp32 chunk
            total -= logp.gather(1, targets[start : start + rows, None]).sum()
        ctx.save_for_backward(logits, targets)
        ctx.rows = rows
        return total / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets = ctx.saved_tensors
        n, rows = logits.size(0), ctx.rows
        scale = grad.float() / n
        if n <= rows:  # one chunk: its buffer is the gradient (no second (n, V) tensor)
            return _grad_chunk(logits, targets, scale).to(logits.dtype), None, None
        out = torch.empty_like(logits)
        for start in range(0, n, rows):
            end = start + rows
            out[start:end] = _grad_chunk(logits[start:end], targets[start:end], scale)
        return out, None, None


def _grad_chunk(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(softmax(logits) - onehot(targets)) * scale in fp32, in place in the softmax's buffer."""
    probs = torch.softmax(logits.float(), dim=-1)
    probs[torch.arange(targets.numel(), device=targets.device), targets] -= 1.0
    return probs.mul_(scale)
