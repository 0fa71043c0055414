"""Model architecture only: no distributed code is imported here."""

from scale_llm.model.kv_cache import KVCache
from scale_llm.model.transformer import (
    Transformer,
    build_model,
    empty_state_dict,
    materialize,
    mlp_hidden_size,
    split_qkv,
)

__all__ = [
    "KVCache",
    "Transformer",
    "build_model",
    "empty_state_dict",
    "materialize",
    "mlp_hidden_size",
    "split_qkv",
]
