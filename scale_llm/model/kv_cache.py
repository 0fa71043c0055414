"""Key/value cache for incremental decoding: each layer's keys and values, max_len positions."""

from __future__ import annotations

import torch


class KVCache:
    """k, v (B, n_kv_heads, max_len, head_dim) per layer, made at first use in the model's dtype."""

    def __init__(self, n_layers: int, max_len: int):
        self.max_len = max_len
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, D) at start_pos.. and return every position up to them."""
        if self.k[layer] is None:
            B, H, _, D = k.shape
            self.k[layer] = k.new_zeros(B, H, self.max_len, D)
            self.v[layer] = v.new_zeros(B, H, self.max_len, D)
        end = start_pos + k.size(2)
        self.k[layer][:, :, start_pos:end] = k
        self.v[layer][:, :, start_pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
