"""A Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, causal self-attention.
Architecture only: parallelism and checkpointing are applied from outside (scale_llm.parallel) to
a model built on the meta device, then materialized with `init_weights`."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scale_llm.config import ModelConfig
from scale_llm.config.sections import kv_heads, mlp_hidden_size
from scale_llm.model import attention, cpu_kernels
from scale_llm.model.kv_cache import KVCache


def rope_table(head_dim: int, seq_len: int, theta: float, device=None) -> torch.Tensor:
    """(2, seq_len, head_dim // 2): each position's cos and sin, fp32 even under autocast."""
    device = torch.device(device or "cpu")
    meta = device.type == "meta"  # (no autocast there; roofline counts run there)
    with contextlib.nullcontext() if meta else torch.autocast(device.type, enabled=False):
        exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
        inv_freq = 1.0 / (theta**exponents)
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
        return torch.stack((angles.cos(), angles.sin()))


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., i], x[..., i + D/2]) of q or k (B, T, heads..., D) by its angle, as
    HF Llama's `rotate_half`. In x's dtype with the table rounded to it: no fp32 copy of q and k
    (bf16 rms relative error 2.7e-3 against float64, 1.7e-3 for fp32 math rounded once)."""
    x1, x2 = x.chunk(2, dim=-1)
    shape = (rope.size(1),) + (1,) * (x.dim() - 3) + (-1,)  # (T, 1, [1,] D/2): over the heads
    cos, sin = (t.to(x.dtype).view(shape) for t in rope)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.rms_norm(x, self.weight, self.eps)  # F.rms_norm (eager CPU: see there)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = cfg.n_heads
        self.n_kv_heads = kv_heads(cfg)
        self.head_dim = cfg.d_model // cfg.n_heads
        self.eager = cfg.attention == "eager"
        qkv_width = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        # rows grouped by kv head (`fuse_qkv`): a row block of whole groups is whole heads of
        # q, k and v, which is what a tensor-parallel rank holds of it
        self.wqkv = nn.Linear(cfg.d_model, qkv_width, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
        docs: Documents | None = None,
    ) -> torch.Tensor:
        """`docs`: attention within each document (attention_mask: document); None: causal."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        R = H // Hkv  # query heads per kv head (1 without GQA)
        qkv = self.wqkv(x).view(B, T, Hkv, R + 2, D)  # per kv head: its R q heads, k, v
        q, k, v = qkv.split([R, 1, 1], dim=3)  # (backward: one cat, as split's was)
        k, v = k.squeeze(3), v.squeeze(3)
        # RoPE on the strided views writes fresh tensors: q's (B, T, Hkv, R, D) is then a view
        q, k = apply_rope(q, rope).view(B, T, H, D), apply_rope(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:  # k, v become (B, Hkv, start_pos + T, D): every position so far
            k, v = cache.update(self.layer_id, k, v, start_pos)
        mask = docs.mask if docs is not None else None  # (B, 1, T, T): within each document
        if mask is None and (S := k.size(2)) != T and T > 1:  # prefill after earlier tokens
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
        is_causal = T > 1 and mask is None and docs is None
        if self.eager:
            y = self._eager(q, k, v, is_causal, mask)
        else:
            kernel = attention.choose(q.device.type, q.dtype, docs is not None, Hkv != H, D)
            bounds = docs.bounds if docs is not None else None
            y = attention.attend(q, k, v, kernel, is_causal, mask, bounds)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * D))

    def _eager(self, q, k, v, is_causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
        """Materializes the (B, n_heads, T, S) score matrix: for teaching and memory studies."""
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, H, T, S)
        if is_causal:
            mask = torch.ones(q.size(2), q.size(2), dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = F.softmax(scores.float(), dim=-1).type_as(q)
        return probs @ v  # (B, H, T, D)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """The wqkv weight from HF's q_proj, k_proj, v_proj weights: rows grouped by kv head, each
    group its query heads' rows, then its k rows, then its v rows (Megatron-LM's layout), so a
    row block of whole groups (a tensor-parallel rank's) holds whole heads of q, k and v."""
    d = q.size(-1)
    return torch.cat([t.reshape(n_kv_heads, -1, d) for t in (q, k, v)], dim=1).reshape(-1, d)


def split_qkv(
    wqkv: torch.Tensor, n_heads: int, n_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v projection weights, contiguous, from a wqkv weight (`fuse_qkv`)."""
    d, r = wqkv.size(-1), n_heads // n_kv_heads
    groups = wqkv.view(n_kv_heads, r + 2, -1, d)  # (groups, r q heads + k + v, head_dim, d)
    return tuple(groups[:, part].reshape(-1, d) for part in (slice(r), r, r + 1))


@dataclass
class Documents:
    """The documents packed in a batch as the attention kernel takes them: a (B, 1, T, T) bool
    `mask` for SDPA's dense kernels, or `bounds` (cu_seqlens, max_len) for FlashAttention's."""

    mask: torch.Tensor | None = None
    bounds: tuple[torch.Tensor, int] | None = None


def documents(tokens: torch.Tensor, end_id: int, kernel: attention.Kernel) -> Documents:
    if kernel.name == "flash_varlen":
        return Documents(bounds=attention.document_bounds(tokens, end_id))
    return Documents(mask=document_mask(tokens, end_id))


def document_mask(tokens: torch.Tensor, end_id: int) -> torch.Tensor:
    """(B, 1, T, T) bool: i may attend j <= i when no document ends (with end_id) between them."""
    ends = tokens == end_id  # (B, T)
    doc = ends.cumsum(1) - ends.long()  # (B, T): documents ended before each position
    T = tokens.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
    return (doc[:, :, None] == doc[:, None, :]).logical_and_(causal).unsqueeze(1)


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

    def forward(self, x: torch.Tensor, rope: torch.Tensor, *rest) -> torch.Tensor:
        """`rest`: Attention.forward's cache, start_pos and docs."""
        h = x + self.attention(self.attention_norm(x), rope, *rest)
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
        docs = None
        if self.cfg.attention_mask == "document" and cache is None:
            docs = documents(tokens, self.cfg.document_end_id, self._kernel(h))
        for layer in self.layers:
            h = layer(h, rope, cache, start_pos, docs)
        h = self.norm(h)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(h, weight)

    def _kernel(self, h: torch.Tensor) -> attention.Kernel:
        """The kernel the blocks' attention will run (its dtype: autocast's, else h's)."""
        cfg, device = self.cfg, h.device.type
        if cfg.attention == "eager":  # (it reads the dense mask whatever a GPU's kernel would be)
            return attention.Kernel("sdpa", dense_mask=True)
        autocast = device != "meta" and torch.is_autocast_enabled(device)  # (meta: none to ask)
        dtype = torch.get_autocast_dtype(device) if autocast else h.dtype
        gqa = cfg.n_kv_heads not in (None, cfg.n_heads)
        return attention.choose(device, dtype, True, gqa, cfg.d_model // cfg.n_heads)

    def rope(self, start_pos: int, length: int, device: torch.device) -> torch.Tensor:
        """A view of the rotary table (2, length, head_dim // 2) for positions start_pos.. . The
        fp32 table is made once per device and kept in a plain attribute, not a buffer: it stays
        fp32 under a bf16 cast, is not in the state dict, and needs no materialization."""
        table = self._rope_tables.get(device)
        if table is None:
            cfg = self.cfg
            # a normal tensor even when first made under inference_mode (generate, then train)
            with torch.inference_mode(False), torch.no_grad():
                table = rope_table(cfg.d_model // cfg.n_heads, cfg.seq_len, cfg.rope_theta, device)
            self._rope_tables[device] = table
        return table[:, start_pos : start_pos + length]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize every parameter in place (after `to_empty` from the meta device)."""
        params = dict(self.named_parameters())
        for name, fill in self.init_fills():
            fill(params[name])

    def init_fills(self) -> Iterator[tuple[str, Callable[[torch.Tensor], object]]]:
        """(parameter name, what fills it) in the order the initialization draws from torch's
        generator, so a sharded layout filling whole parameters in turn gets one process's
        weights. N(0, init_std); wo and w2 (into the residual stream) init_std / sqrt(2 n_layers)
        so the residual variance does not grow with depth (GPT-2 / Llama); norms are ones."""
        cfg = self.cfg
        std, residual_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        yield "tok_embeddings.weight", functools.partial(nn.init.normal_, mean=0.0, std=std)
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                yield f"{name}.weight", nn.init.ones_
            elif isinstance(module, nn.Linear):
                residual = name.endswith("attention.wo") or name.endswith("feed_forward.w2")
                sigma = residual_std if residual else std
                yield f"{name}.weight", functools.partial(nn.init.normal_, mean=0.0, std=sigma)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        embeddings = self.tok_embeddings.weight.numel() if exclude_embeddings else 0
        return sum(p.numel() for p in self.parameters()) - embeddings

    def flops_per_token(self, causal: bool = False) -> int:
        """Training FLOPs per token: 6 x matmul parameters (a tied head too) + attention's
        12 * n_layers * d_model * seq_len over the whole (T, T) scores, as PaLM and nanoGPT count
        it for MFU; `causal`: half of it, what a causal kernel actually computes."""
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
