"""Which attention kernel runs, decided once per call from what the kernels accept and pinned:
where no fused kernel accepts its inputs, SDPA would silently materialize the (B, H, T, T) scores.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FLASH_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Kernel:
    name: str  # flash | flash_varlen | efficient | sdpa (the CPU: SDPA chooses)
    repeat_kv: bool = False  # kv heads repeated to the query heads first (no GQA in the kernel)
    dense_mask: bool = False  # the document mask as a (B, 1, T, T) bool tensor

    @property
    def backend(self) -> SDPBackend | None:
        return {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
        }.get(self.name)


@cache  # one object per choice: compiled blocks see the same constant
def choose(
    device_type: str, dtype: torch.dtype, document: bool, gqa: bool, head_dim: int
) -> Kernel:
    """The kernel for attention in `dtype` (autocast's), document or causal, GQA or not."""
    if device_type != "cuda":
        return Kernel("sdpa", dense_mask=document)
    flash_shape = head_dim <= FLASH_MAX_HEAD_DIM and head_dim % 8 == 0
    if dtype in (torch.bfloat16, torch.float16) and flash_shape:
        return Kernel("flash_varlen" if document else "flash")
    return Kernel("efficient", repeat_kv=gqa, dense_mask=document)


def problem(device_type: str, dtype: torch.dtype, document: bool, head_dim: int) -> str | None:
    """What a GPU run with these settings materializes that a fused kernel would not, or None."""
    kernel = choose(device_type, dtype, document, False, head_dim)
    if not kernel.dense_mask or device_type != "cuda":
        return None
    why = f"head_dim {head_dim} (FlashAttention: <= 256, a multiple of 8)"
    why = "fp32" if dtype == torch.float32 else why
    return (
        f"model.attention_mask=document with {why}: FlashAttention's varlen kernel cannot run "
        f"it, so the memory-efficient kernel reads a (B, 1, T, T) mask per micro-batch"
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel: Kernel,
    is_causal: bool,
    mask: torch.Tensor | None = None,
    documents: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Attention of q (B, H, T, D) over k, v (B, Hkv, S, D) -> (B, H, T, D): causal, or within
    each document (`mask` for a dense kernel, `documents` (cu_seqlens, max_len) for varlen)."""
    H, Hkv = q.size(1), k.size(1)
    if kernel.name == "flash_varlen" and documents is not None:
        return _varlen(q, k, v, *documents)
    if mask is not None and kernel.name in ("flash", "flash_varlen"):  # (generate's prefill)
        kernel = Kernel("efficient", repeat_kv=True, dense_mask=True)
    if kernel.repeat_kv and Hkv != H:
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    gqa = k.size(1) != H
    with sdpa_kernel([kernel.backend]) if kernel.backend is not None else contextlib.nullcontext():
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa
        )


def _varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """FlashAttention over the documents packed in each row, each its own causal sequence."""
    from torch.nn.attention.varlen import varlen_attn

    B, H, T, D = q.shape
    packed = [x.transpose(1, 2).reshape(B * T, x.size(1), D) for x in (q, k, v)]  # (B*T, h, D)
    gqa = k.size(1) != H
    y = varlen_attn(  # window (-1, 0): causal within each document
        *packed, cu_seqlens, cu_seqlens, max_len, max_len, window_size=(-1, 0), enable_gqa=gqa
    )
    return y.view(B, T, H, D).transpose(1, 2)


def document_bounds(tokens: torch.Tensor, end_id: int) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, max_len) of the documents packed in `tokens` (B, T): int32 offsets into the
    B*T positions where each starts (an `end_id` token or a row's end ends one), and T."""
    B, T = tokens.shape
    ends = tokens == end_id
    ends[:, -1] = True  # (the last position closes each row's last document)
    positions = torch.nonzero(ends.reshape(-1), as_tuple=True)[0] + 1  # an offset past each end
    zero = torch.zeros(1, dtype=positions.dtype, device=tokens.device)
    return torch.cat([zero, positions]).to(torch.int32), T
