"""A Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, causal self-attention.

Architecture only: no process groups, no wrappers, no checkpointing. Parallelism and activation
checkpointing are applied from outside (scale_llm.parallel) to a model built on the meta device
and then materialized with `init_weights`.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from scale_llm.config import ModelConfig
from scale_llm.model.kv_cache import KVCache

WIDTH_MULTIPLE = 128  # tensor-core friendly widths: the MLP default; vocab sizes are checked


def mlp_hidden_size(cfg: ModelConfig) -> int:
    """SwiGLU hidden width: 8/3 * d_model (same parameters as a 4x GELU MLP), rounded up to a
    multiple of 128 so that the MLP matmuls tile evenly on tensor cores."""
    if cfg.mlp_hidden is not None:
        return cfg.mlp_hidden
    return WIDTH_MULTIPLE * math.ceil(8 * cfg.d_model / 3 / WIDTH_MULTIPLE)


def rope_table(head_dim: int, seq_len: int, theta: float, device=None) -> torch.Tensor:
    """(seq_len, head_dim // 2, 2) fp32: the cos and sin of each position's angles, side by side
    (the layout of a complex64 tensor, so the eager fp32 path can read it as e^(i angle) without a
    copy); fp32 even under autocast."""
    device = torch.device(device or "cpu")
    no_autocast = (
        torch.autocast(device.type, enabled=False)
        if device.type != "meta"  # (the meta device has no autocast; roofline counts run there)
        else contextlib.nullcontext()
    )
    with no_autocast:
        exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
        inv_freq = 1.0 / (theta**exponents)
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
        return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor, pairs_adjacent: bool = False) -> torch.Tensor:
    """Rotate pairs of q or k (B, T, H, D) by the angles in rope.

    The pairs are (x[..., i], x[..., i + D/2]) in the half-split order of Hugging Face's Llama,
    or, with pairs_adjacent, (x[..., 2i], x[..., 2i + 1]): the order `QKVProjection` gives eager
    fp32 q and k in, rotated as one complex multiply of a view (no copy) and left in that order.
    Both orders give the same q·k, the only thing attention reads of them; v is not rotated.
    """
    if pairs_adjacent:
        return rope_pairs_adjacent(x, rope)
    return rope_half_split(x, rope)


def complex_rope(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether attention rotates q and k as complex numbers: fp32 eager code (complex tensors
    have no bf16, and inductor falls back on complex ops)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if torch.compiler.is_compiling():
        return False
    return x.device.type == "meta" or not torch.is_autocast_enabled(x.device.type)


def rope_pairs_adjacent(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """fp32 RoPE of x whose pairs are adjacent: (x_2i + i x_2i+1) e^(i angle), in place of the
    pairs in the output. The same products and sums as `rope_half_split` (equal to fp32
    rounding) in one kernel each way, reading x as complex64 without a copy."""
    rotation = torch.view_as_complex(rope)[:, None, :]  # (T, 1, D/2): broadcast over heads
    pairs = torch.view_as_complex(x.unflatten(-1, (x.size(-1) // 2, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2)


def rope_half_split(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split order of Hugging Face's Llama, in x's dtype (the compute dtype:
    bf16 under autocast) with the fp32 tables rounded to it: no fp32 copy of q and k. Measured
    against a float64 reference at T=2048, D=64 (docs/performance.md): rms relative error
    2.7e-3 in bf16, against 1.7e-3 for fp32 math rounded to bf16 once.
    """
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = (t.to(x.dtype)[:, None, :] for t in rope.unbind(-1))  # broadcast over heads
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        decomposed = x.device.type == "cpu" and x.dtype == self.weight.dtype  # (no CPU backward)
        if decomposed and not torch.compiler.is_compiling():
            return _RMSNormCPU.apply(x, self.weight, self.eps)
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class _RMSNormCPU(torch.autograd.Function):
    """F.rms_norm with a backward written out, for eager CPU code.

    The forward is F.rms_norm's own (`aten::_fused_rms_norm`, bit for bit). Its backward has a
    kernel on CUDA only; on the CPU autograd runs through the decomposition (pow, mean, rsqrt,
    4 products each way) and keeps an fp32 normalized copy of the input. This keeps what CUDA's
    kernel keeps (the input, the weight and the fp32 rstd) and computes, with r = rstd,

        grad_x = r (g w) - x r^3 <g w, x> / D        grad_w = sum over rows of r (g x)

    in fp32, 7 passes over the activation.
    Measured at tiny.yaml's shape, 1 thread (docs/benchmarks.md, session 20): forward and
    backward 2.79 ms against the decomposition's 4.61.
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


class QKVProjection(nn.Linear):
    """The fused q, k, v projection (wqkv), its weight rows q, k, v in half-split head order.

    `forward(x, pairs_adjacent=True)` gives q and k with each head's rotary pairs (i, i + D/2)
    side by side, from the weight's rows in that order (`_LinearRowsReordered`), so that fp32
    RoPE reads them as complex numbers without a copy. The parameter and checkpoints keep the
    half-split order. Measured at tiny.yaml's shape, 1 thread (docs/benchmarks.md, session 20):
    the projection and both rotations forward and backward 38.7 ms against 45.8 ms when the
    halves were interleaved into a complex copy.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__(d_model, (n_heads + 2 * n_kv_heads) * head_dim, bias=False)
        self.rotated_heads, self.head_dim = n_heads + n_kv_heads, head_dim  # q's and k's

    def forward(self, x: torch.Tensor, pairs_adjacent: bool = False) -> torch.Tensor:
        if not pairs_adjacent:
            return F.linear(x, self.weight)
        return _LinearRowsReordered.apply(x, self.weight, self.rotated_heads, self.head_dim)


def pairs_adjacent_rows(weight: torch.Tensor, rotated_heads: int, head_dim: int) -> torch.Tensor:
    """Row r of the reordered weight is row order[r] of the weight: in each of the first
    rotated_heads heads (q's and k's), rows (0, D/2, 1, D/2 + 1, ...); the rest (v's) as they
    are."""
    n, D = rotated_heads, head_dim
    rows = torch.arange(weight.size(0), device=weight.device)
    rotated = rows[: n * D].view(n, 2, D // 2).transpose(1, 2).flatten()
    return torch.cat((rotated, rows[n * D :]))


class _LinearRowsReordered(torch.autograd.Function):
    """F.linear(x, weight[order]) keeping only x and the weight for backward (as F.linear
    does): the reordered copy and the order are made again in backward (a weight-sized gather)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, heads: int, D: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.heads, ctx.D = heads, D
        return F.linear(x, weight.index_select(0, pairs_adjacent_rows(weight, heads, D)))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        order = pairs_adjacent_rows(weight, ctx.heads, ctx.D)
        grad_x = grad @ weight.index_select(0, order)
        grad_reordered = grad.flatten(0, -2).t() @ x.flatten(0, -2)
        grad_weight = torch.empty_like(weight).index_copy_(0, order, grad_reordered)
        return grad_x, grad_weight, None, None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.eager = cfg.attention == "eager"
        self.wqkv = QKVProjection(cfg.d_model, self.n_heads, self.n_kv_heads, self.head_dim)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        adjacent = complex_rope(x, self.wqkv.weight)  # q and k's pairs made adjacent by wqkv
        q, k, v = self.wqkv(x, adjacent).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = apply_rope(q.view(B, T, H, D), rope, adjacent)  # (q and k: the same head-dim order)
        k = apply_rope(k.view(B, T, Hkv, D), rope, adjacent)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, T, Hkv, D).transpose(1, 2)
        if cache is not None:  # k, v become (B, Hkv, start_pos + T, D): every position so far
            k, v = cache.update(self.layer_id, k, v, start_pos)
        causal_mask = None
        if k.size(2) != T and T > 1:  # prefill after earlier tokens: queries sit at the end
            causal_mask = torch.ones(T, k.size(2), dtype=torch.bool, device=x.device).tril(
                diagonal=k.size(2) - T
            )
        is_causal = T > 1 and causal_mask is None
        if self.eager:
            y = self._eager(q, k, v, is_causal, causal_mask)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_mask, is_causal=is_causal, enable_gqa=Hkv != H
            )
        return self.wo(y.transpose(1, 2).reshape(B, T, H * D))

    def _eager(self, q, k, v, is_causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
        """Materializes the (B, n_heads, T, S) score matrix: for teaching and memory studies."""
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, H, T, S)
        if is_causal:
            T = q.size(2)
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = F.softmax(scores.float(), dim=-1).type_as(q)
        return probs @ v  # (B, H, T, D)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = mlp_hidden_size(cfg)
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, cache, start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens (B, T) int64 -> logits (B, T, vocab_size)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # Tied embeddings reuse tok_embeddings.weight in forward instead of sharing a Parameter,
        # so the tie survives meta-device materialization and sharding.
        self.output = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
        self._rope_tables: dict[torch.device, torch.Tensor] = {}

    def forward(
        self, tokens: torch.Tensor, cache: KVCache | None = None, start_pos: int = 0
    ) -> torch.Tensor:
        T = tokens.size(1)
        if start_pos + T > self.cfg.seq_len:
            raise ValueError(
                f"positions {start_pos}..{start_pos + T} exceed model.seq_len={self.cfg.seq_len}"
            )
        h = self.tok_embeddings(tokens)  # (B, T, d_model)
        rope = self.rope(start_pos, T, h.device)
        for layer in self.layers:
            h = layer(h, rope, cache, start_pos)
        h = self.norm(h)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(h, weight)

    def rope(self, start_pos: int, length: int, device: torch.device) -> torch.Tensor:
        """A view of the rotary table (length, head_dim // 2, 2) for positions start_pos.. .

        The fp32 table for all seq_len positions is computed once per device and kept in a
        plain attribute, not a buffer: it stays fp32 when a backend casts the module to bf16,
        is not in the state dict, and needs no materialization after meta init.
        """
        table = self._rope_tables.get(device)
        if table is None:
            cfg = self.cfg
            # a normal tensor even when first made under inference_mode (generate, then train)
            with torch.inference_mode(False), torch.no_grad():
                table = rope_table(cfg.d_model // cfg.n_heads, cfg.seq_len, cfg.rope_theta, device)
            self._rope_tables[device] = table
        return table[start_pos : start_pos + length]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize every parameter in place (after `to_empty` from the meta device).

        Linear and embedding weights ~ N(0, init_std); the projections that write into the
        residual stream (attention.wo, feed_forward.w2) use init_std / sqrt(2 * n_layers) so the
        residual variance does not grow with depth (GPT-2 / Llama practice).
        """
        cfg = self.cfg
        std = cfg.init_std
        residual_std = std / math.sqrt(2 * cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, nn.Linear):
                is_residual = name.endswith("attention.wo") or name.endswith("feed_forward.w2")
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, causal: bool = False) -> int:
        """Training FLOPs per token (forward + backward): 6 x matmul parameters + attention.

        The attention term 12 * n_layers * d_model * seq_len counts QK^T and AV over the whole
        (T, T) score matrix, as PaLM (appendix B) and nanoGPT count it for MFU; a causal kernel
        (FlashAttention, SDPA's is_causal) computes only the lower half, so `causal` counts
        half of it: the work actually done. The output projection counts as a matmul even when
        tied to the embedding.
        """
        cfg = self.cfg
        matmul_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        if self.output is None:  # the tied head is a (vocab x d_model) matmul all the same
            matmul_params += cfg.vocab_size * cfg.d_model
        attention = 12 * cfg.n_layers * cfg.d_model * cfg.seq_len
        return 6 * matmul_params + (attention // 2 if causal else attention)


def build_model(cfg: ModelConfig, device: torch.device | str = "meta") -> Transformer:
    """Build on the meta device (no memory, no init work); materialize with `materialize`."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if str(device) != "meta":
        materialize(model, device)
    return model


def materialize(model: Transformer, device: torch.device | str) -> Transformer:
    """Allocate storage on `device` and run the initialization (seed the RNG first)."""
    model.to_empty(device=device)
    model.init_weights()
    return model


def empty_state_dict(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Uninitialized CPU tensors of every parameter of `cfg`'s model: a target to load into."""
    model = build_model(cfg)
    model.to_empty(device="cpu")
    return model.state_dict()
