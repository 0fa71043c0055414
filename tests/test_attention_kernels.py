"""The attention kernel a GPU run uses (scale_llm/model/attention.py), checked on the CPU.

SDPA on CUDA falls back to the math kernel, which materializes the (B, H, T, T) score matrix,
when no fused kernel accepts its inputs. The model picks the kernel itself and pins SDPA to it.
Here: the pick for every CUDA case (dtype x mask x GQA x head size), what `attend` hands each
kernel, and that the kernel's forward and backward allocate no T x T tensor at T = 4096, on fake
CUDA tensors (the ops' shape functions; nothing runs on a device).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from scale_llm.model import attention
from scale_llm.model.transformer import document_mask

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
T = 4096


@pytest.mark.parametrize(
    ("dtype", "document", "gqa", "head_dim", "name", "repeat_kv", "dense_mask"),
    [
        (BF16, False, False, 128, "flash", False, False),
        (BF16, False, True, 128, "flash", False, False),  # FlashAttention takes GQA itself
        (FP16, False, True, 64, "flash", False, False),
        (BF16, True, True, 128, "flash_varlen", False, False),  # 70b.yaml's: no mask at all
        (FP16, True, False, 64, "flash_varlen", False, False),
        (FP32, False, False, 128, "efficient", False, False),
        (FP32, False, True, 128, "efficient", True, False),  # efficient takes no GQA
        (FP32, True, True, 128, "efficient", True, True),
        (BF16, False, True, 512, "efficient", True, False),  # past FlashAttention's 256
        (BF16, False, False, 100, "efficient", False, False),  # not a multiple of 8
        (BF16, True, False, 100, "efficient", False, True),
    ],
)
def test_each_cuda_case_gets_a_fused_kernel(
    dtype, document, gqa, head_dim, name, repeat_kv, dense_mask
):
    kernel = attention.choose("cuda", dtype, document, gqa, head_dim)
    assert (kernel.name, kernel.repeat_kv, kernel.dense_mask) == (name, repeat_kv, dense_mask)
    named = attention.problem("cuda", dtype, document, head_dim)
    assert (named is not None) == dense_mask  # the one case that still reads a T x T mask
    assert attention.choose("cpu", dtype, document, gqa, head_dim).name == "sdpa"


def test_document_bounds_hold_the_documents_of_the_mask():
    """cu_seqlens from a packed batch give exactly the blocks of `document_mask`."""
    end = 2
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5, (3, 40), generator=g)  # ~1 in 5 a document's end
    tokens[1, -1] = end  # a row ending with an end token
    cu, max_len = attention.document_bounds(tokens, end)
    assert max_len == 40 and cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 3 * 40
    rebuilt = torch.zeros(3 * 40, 3 * 40, dtype=torch.bool)
    for a, b in itertools.pairwise(cu.tolist()):
        rebuilt[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    mask = document_mask(tokens, end)[:, 0]  # (B, T, T)
    for row in range(3):
        block = rebuilt[row * 40 : (row + 1) * 40, row * 40 : (row + 1) * 40]
        assert torch.equal(block, mask[row]), row


class _Allocations(TorchDispatchMode):
    """Every tensor an op returns, by shape."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out

    def square(self) -> list[tuple[str, tuple[int, ...]]]:
        """The tensors with two dimensions of at least T: a (T, T) matrix."""
        return [(f, s) for f, s in self.shapes if sum(d >= T for d in s) >= 2]


def _fake_qkv(B, H, Hkv, D, dtype):
    shape = {"q": (B, H, T, D), "k": (B, Hkv, T, D), "v": (B, Hkv, T, D)}
    return [torch.empty(shape[n], device="cuda", dtype=dtype) for n in "qkv"]


def _flash(q, k, v, is_causal):
    """FlashAttention's forward and backward ops, as SDPA pinned to it runs them."""
    out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, is_causal
    )
    torch.ops.aten._scaled_dot_product_flash_attention_backward(
        torch.empty_like(out), q, k, v, out, lse, cq, ck, mq, mk, 0.0, is_causal, seed, offset
    )
    return out


def _efficient(q, k, v, mask, is_causal):
    """The memory-efficient kernel's forward and backward (a bool mask becomes a float bias)."""
    bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
    aten = torch.ops.aten
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, is_causal
    )
    aten._scaled_dot_product_efficient_attention_backward(
        torch.empty_like(out), q, k, v, bias, out, lse, seed, offset, 0.0,
        [True, True, True, bias is not None], is_causal,
    )  # fmt: skip
    return out


def _varlen(q, k, v, cu, max_len, window_size):
    out, lse, rng = torch.ops.torch_attn._varlen_attn(
        q, k, v, cu, cu, max_len, max_len, False, None, list(window_size), k.size(1) != q.size(1)
    )
    torch.ops.torch_attn._varlen_attn_backward(
        torch.empty_like(out), q, k, v, out, lse, cu, cu, max_len, max_len, False, rng, None,
        list(window_size),
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("dtype", "document", "H", "Hkv"),
    [(BF16, False, 8, 2), (BF16, True, 8, 2), (FP32, False, 8, 2), (FP32, True, 8, 2)],
)
def test_the_chosen_kernel_allocates_no_t_by_t_tensor(dtype, document, H, Hkv, monkeypatch):
    """Forward and backward of the kernel `attend` calls, on fake CUDA tensors at T = 4096: no
    (T, T) tensor, except the dense document mask of fp32, which `problem` names."""
    B, D = 2, 64
    kernel = attention.choose("cuda", dtype, document, Hkv != H, D)
    calls = []

    def record_sdpa(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
        pinned = (
            torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.math_sdp_enabled(),
        )
        calls.append(("sdpa", k.size(1), attn_mask is not None, is_causal, pinned))
        if pinned == (True, False, False):
            return _flash(q, k, v, is_causal)
        return _efficient(q, k, v, attn_mask, is_causal)

    def record_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size, enable_gqa):
        calls.append(("varlen", k.size(1), window_size, enable_gqa))
        return _varlen(q, k, v, cu_q, max_q, window_size)

    import torch.nn.attention.varlen as varlen_module

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", record_sdpa)
    monkeypatch.setattr(varlen_module, "varlen_attn", record_varlen)
    with FakeTensorMode():
        q, k, v = _fake_qkv(B, H, Hkv, D, dtype)
        dense = torch.empty(B, 1, T, T, dtype=torch.bool, device="cuda")  # (document_mask's)
        mask = dense if kernel.dense_mask else None
        bounds = (torch.zeros(B + 1, dtype=torch.int32, device="cuda"), T) if document else None
        with _Allocations() as seen:
            y = attention.attend(q, k, v, kernel, not document, mask, bounds)
    assert y.shape == (B, H, T, D)
    if kernel.name == "flash_varlen":
        assert calls == [("varlen", Hkv, (-1, 0), True)]  # GQA in the kernel, causal per document
    elif kernel.name == "flash":
        assert calls == [("sdpa", Hkv, False, True, (True, False, False))]  # pinned: no fallback
    else:  # efficient: the kv heads repeated, pinned to the memory-efficient kernel
        assert calls == [("sdpa", H, document, not document, (False, True, False))]
    square = seen.square()
    if kernel.dense_mask:
        assert square and attention.problem("cuda", dtype, document, D) is not None
    else:
        assert square == [], square


def test_the_preflight_names_a_gpu_run_that_would_read_a_t_by_t_mask(caplog):
    """fp32 with the document mask on a GPU is named at start-up; the same in bf16 (FlashAttention's
    varlen kernel) and a CPU run are not."""
    import dataclasses
    import logging

    from scale_llm.config import load_config
    from scale_llm.train.preflight import warn_about_attention
    from tests.helpers import plan_for

    cfg = load_config(None, ["model.attention_mask=document", "model.n_kv_heads=2"])
    cpu = plan_for(cfg)
    gpu = dataclasses.replace(cpu, device=torch.device("cuda", 0))
    with caplog.at_level(logging.WARNING):
        for plan in (cpu, dataclasses.replace(gpu, precision="bf16")):
            warn_about_attention(cfg, plan)
        assert caplog.text == ""
        warn_about_attention(cfg, dataclasses.replace(gpu, precision="fp32"))
    assert "model.attention_mask=document with fp32" in caplog.text
    assert "reads a (B, 1, T, T) mask" in caplog.text


def test_a_masked_call_on_a_flash_pick_takes_the_kernel_that_reads_masks(monkeypatch):
    """Generation's prefill after earlier tokens passes a (T, S) mask: FlashAttention takes none,
    so that call runs the memory-efficient kernel (kv heads repeated) instead of failing."""
    seen = []

    def record_sdpa(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
        seen.append((torch.backends.cuda.mem_efficient_sdp_enabled(), k.size(1), enable_gqa))
        return q

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", record_sdpa)
    kernel = attention.choose("cuda", BF16, False, True, 64)
    q, k = torch.zeros(1, 8, 3, 64), torch.zeros(1, 2, 7, 64)
    attention.attend(q, k, k, kernel, False, torch.ones(3, 7, dtype=torch.bool))
    assert seen == [(True, 8, False)]


def test_eager_attention_under_the_document_mask_gets_the_mask_on_a_gpu():
    """`model.attention: eager` with `attention_mask: document` on a GPU in bf16: the blocks'
    kernel pick (FlashAttention's varlen) left the dense mask unbuilt, and the eager path, told
    neither causal nor masked, attended to every position of the sequence, the future included."""
    from scale_llm.config import ModelConfig
    from scale_llm.model import build_model

    sizes = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=4, seq_len=16)
    eager = build_model(ModelConfig(**sizes, attention="eager", attention_mask="document"), "meta")
    sdpa = build_model(ModelConfig(**sizes, attention_mask="document"), "meta")
    with FakeTensorMode():
        h = torch.empty(2, 16, 32, device="cuda", dtype=BF16)
        assert eager._kernel(h).dense_mask
        assert not sdpa._kernel(h).dense_mask  # (FlashAttention's varlen kernel: no T x T)
