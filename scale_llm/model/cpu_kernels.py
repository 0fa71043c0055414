"""The one kernel the model adds for eager CPU code: RMSNorm's backward, written out.

torch 2.13's `F.rms_norm` runs `aten::_fused_rms_norm`, which has a kernel each way on CUDA but
only a forward on the CPU: there autograd differentiates its decomposition (pow, mean, rsqrt and
the products, each way) and keeps an fp32 normalized copy of the input besides the input.
`rms_norm` keeps F.rms_norm's forward, bit for bit, and computes the backward from what CUDA's
kernel keeps (the input, the weight and the fp32 rstd). What it earns, measured on torch 2.13.0
(CPU wheel), 2 cores, yaml/tiny.yaml in fp32, 2026-12-03:

- memory: 286.5 MiB saved for backward per micro-batch against 313.5 MiB for the decomposition
  (-8.6%), and exactly what CUDA's kernel saves, so the CPU measurements that check the memory
  estimate count the norm as a GPU does (docs/memory.md);
- speed: none that a step shows (with it and without, interleaved, best of 6: 1.13-1.19 s per
  step at 1 thread, 0.58-0.66 s at 2): the matmuls dominate.

`enabled` is the switch: compiled code and CUDA take `F.rms_norm` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def enabled(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` runs the written-out backward: eager code on the CPU with input and
    weight of one dtype, where F.rms_norm has no backward kernel (inductor fuses its own)."""
    same_dtype = x.dtype == weight.dtype  # (else F.rms_norm does not call the fused op)
    return x.device.type == "cpu" and same_dtype and not torch.compiler.is_compiling()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dimension; where `enabled`, with its backward written out."""
    if enabled(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return F.rms_norm(x, (x.size(-1),), weight, eps)


class _RMSNorm(torch.autograd.Function):
    """F.rms_norm's forward; the backward with r = rstd, in fp32, in 7 passes over the input:

    grad_x = r (g w) - x r^3 <g w, x> / D        grad_w = sum over rows of r (g x)
    """

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
