"""RMSNorm's backward written out for eager CPU code (torch 2.13 has none: autograd keeps an fp32
copy of the input): it saves what CUDA's kernel saves, so CPU memory measurements count the norm
as a GPU does."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def enabled(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` runs the written-out backward: eager CPU code with input and weight of
    one dtype (else F.rms_norm does not call the fused op; inductor fuses its own)."""
    return x.device.type == "cpu" and x.dtype == weight.dtype and not torch.compiler.is_compiling()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dimension; where `enabled`, with its backward written out."""
    if enabled(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return F.rms_norm(x, (x.size(-1),), weight, eps)


class _RMSNorm(torch.autograd.Function):
    """F.rms_norm's forward; the backward in fp32 with r = rstd:
    grad_x = r (g w) - x r^3 <g w, x> / D, grad_w = sum over rows of r (g x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.size(-1)], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dtype, D = x.dtype, x.size(-1)
        acc = torch.promote_types(dtype, torch.float32)  # 16-bit inputs: fp32 math
        x, grad, w = x.to(acc), grad.to(acc), weight.to(acc)
        gw = grad * w
        coeff = torch.linalg.vecdot(gw, x).unsqueeze(-1).mul_(rstd.pow(3)).div_(D)
        grad_x = (gw * rstd).addcmul_(x, coeff, value=-1)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * x).mul_(rstd).flatten(0, -2).sum(0).to(weight.dtype)
        return grad_x.to(dtype), grad_w, None
