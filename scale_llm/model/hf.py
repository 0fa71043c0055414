"""Our decoder <-> Hugging Face `LlamaForCausalLM`: parameter names, the fused qkv weight, config.
Pure mapping (no I/O, no `transformers`), shared by `model.init_from` and `scale-llm export`; the
architectures agree term by term (RoPE as `rotate_half`: q and k rows need no permutation)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from typing import Any

import torch

from scale_llm.config import ModelConfig, short
from scale_llm.config.sections import kv_heads, mlp_hidden_size
from scale_llm.model.transformer import Transformer, fuse_qkv, split_qkv

ARCHITECTURE = "LlamaForCausalLM"
_PER_LAYER = {  # ours -> HF, inside layers.{i} / model.layers.{i}
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# HF config values we cannot run (field -> the values we can): named in the error when present
_SUPPORTED = {
    "hidden_act": ("silu",),
    "attention_bias": (False, None),
    "mlp_bias": (False, None),
    "rope_scaling": (None,),
    "sliding_window": (None,),
    "quantization_config": (None,),
}


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint of `cfg`'s model and its shape (`to_hf` on meta)."""
    with torch.device("meta"):
        state = dict(Transformer(cfg).state_dict())
    return {name: tuple(t.shape) for name, t in to_hf(cfg, state)}


def to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for each of our parameters, popped from `state` (never two copies held)."""
    for ours, theirs in _TOP.items():
        if ours != "output.weight" and ours in state:
            yield theirs, state.pop(ours)
    for i in range(cfg.n_layers):
        wqkv = f"layers.{i}.attention.wqkv.weight"
        parts = split_qkv(state.pop(wqkv), cfg.n_heads, kv_heads(cfg))
        for name, part in zip(_QKV, parts):
            yield f"model.layers.{i}.{name}", part
        for ours, theirs in _PER_LAYER.items():
            yield f"model.layers.{i}.{theirs}", state.pop(f"layers.{i}.{ours}")
    if "output.weight" in state:
        yield "lm_head.weight", state.pop("output.weight")
    if state:
        raise KeyError(f"parameters with no Hugging Face name: {sorted(state)[:5]}")


def from_hf(cfg: ModelConfig, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict from HF tensors read one at a time through `get(name)`, shapes checked."""
    return dict(FromHF(cfg, get))


class FromHF(Mapping[str, torch.Tensor]):
    """Our parameters by name, each made from its HF tensors when asked (one at a time)."""

    def __init__(self, cfg: ModelConfig, get: Callable[[str], torch.Tensor]):
        self.cfg, self.get = cfg, get
        per_layer = ["attention.wqkv.weight", *_PER_LAYER]
        self.names = ["tok_embeddings.weight", "norm.weight"]
        self.names += [f"layers.{i}.{ours}" for i in range(cfg.n_layers) for ours in per_layer]
        self.names += [] if cfg.tie_embeddings else ["output.weight"]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in _TOP:
            return self.get(_TOP[name])
        _, i, ours = name.split(".", 2)
        if ours == "attention.wqkv.weight":
            parts = [self.get(f"model.layers.{i}.{theirs}") for theirs in _QKV]
            return fuse_qkv(*parts, kv_heads(self.cfg))
        return self.get(f"model.layers.{i}.{_PER_LAYER[ours]}")

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def shape_problems(cfg: ModelConfig, found: dict[str, tuple[int, ...]]) -> list[str]:
    """One line per HF tensor that is missing or has another shape than `cfg`'s model needs."""
    out = []
    for name, want in hf_shapes(cfg).items():
        have = found.get(name)
        if have is None:
            out.append(f"{name}: missing (the model needs shape {tuple(want)})")
        elif tuple(have) != tuple(want):
            out.append(f"{name}: shape {tuple(have)} in the checkpoint, {tuple(want)} in the model")
    return out


# ----------------------------------------------------------------------------- config


def to_hf_config(
    cfg: ModelConfig, dtype: torch.dtype, bos_id: int, eos_id: int, pad_id: int
) -> dict[str, Any]:
    """`LlamaForCausalLM`'s config.json for `cfg` (RoPE for transformers 4 and vLLM, and 5)."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": mlp_hidden_size(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": kv_heads(cfg),
        "head_dim": cfg.d_model // cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "use_cache": True,
    }


def from_hf_config(hf: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(model.* values that passed, a line per unsupported or ill-typed field) of an HF config."""
    problems = []
    model_type = hf.get("model_type")
    if model_type != "llama":
        problems.append(
            f"model_type={model_type!r}: only Llama checkpoints (model_type 'llama', "
            f"{ARCHITECTURE}) can be loaded"
        )
    for key, ok in _SUPPORTED.items():
        value = hf.get(key, ok[0])  # absent: transformers' LlamaConfig default, the first here
        if value not in ok:
            problems.append(f"{key}={value!r}: unsupported (scale_llm supports {ok[0]!r})")
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        problems.append(_wrong("rope_parameters", rope, "an object or null"))
        rope = {}
    kind = rope.get("rope_type", rope.get("type", "default"))  # (`type`: as transformers reads)
    if kind != "default":
        problems.append(f"rope_parameters.rope_type={kind!r}: unsupported (only 'default' RoPE)")
    if "transformers_weights" in hf:  # (transformers reads the file it names)
        problems.append(
            f"transformers_weights={short(hf['transformers_weights'], 40)}: unsupported (the "
            f"weights are read from model.safetensors, its index, or pytorch_model.bin)"
        )
    # rope_parameters' rope_theta (transformers 5) comes before the top-level one (4)
    given = {**hf, "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0))}
    values: dict[str, Any] = {}
    for key, (ours, default, ok, expected) in _FIELDS.items():
        value = given.get(key, default)
        if key == "num_key_value_heads" and value is None:  # absent or null: one per head
            value = values.get("n_heads", _UNSET)
        if ok(value):
            values[ours] = float(value) if ok is _positive_number else value
        elif value is not _UNSET:
            problems.append(_wrong(key, value, expected))
    return values, problems + _head_problems(hf, values)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value: Any) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


_UNSET = object()  # null num_key_value_heads and an ill-typed num_attention_heads: no value
# HF config field -> (our model.* key, its value when absent, its check, what it must be)
_FIELDS: dict[str, tuple[str, Any, Callable[[Any], bool], str]] = {
    "vocab_size": ("vocab_size", None, _positive_int, "an integer > 0"),
    "hidden_size": ("d_model", None, _positive_int, "an integer > 0"),
    "num_hidden_layers": ("n_layers", None, _positive_int, "an integer > 0"),
    "num_attention_heads": ("n_heads", None, _positive_int, "an integer > 0"),
    "intermediate_size": ("mlp_hidden", None, _positive_int, "an integer > 0"),
    "num_key_value_heads": ("n_kv_heads", None, _positive_int, "an integer > 0 or null"),
    "tie_word_embeddings": ("tie_embeddings", False, lambda v: type(v) is bool, "true or false"),
    "rms_norm_eps": ("norm_eps", 1e-6, _positive_number, "a finite number > 0"),
    "rope_theta": ("rope_theta", 10000.0, _positive_number, "a finite number > 0"),
}


def _head_problems(hf: dict[str, Any], values: dict[str, Any]) -> list[str]:
    """Heads that cannot split hidden_size, or key/value heads that cannot split the heads."""
    if "d_model" not in values or "n_heads" not in values:
        return []
    d, heads = values["d_model"], values["n_heads"]
    if d % heads:
        return [
            f"hidden_size={d} is not divisible by num_attention_heads={heads}: not a model any "
            f"Llama implementation builds; fix config.json"
        ]
    out = []
    if hf.get("head_dim") not in (None, d // heads):
        out.append(
            f"head_dim={short(hf['head_dim'])}: unsupported (scale_llm uses hidden_size / "
            f"num_attention_heads = {d // heads})"
        )
    kv = values.get("n_kv_heads")
    if kv is not None and heads % kv:
        out.append(
            f"num_key_value_heads={kv} does not divide num_attention_heads={heads}; fix config.json"
        )
    return out


def _wrong(key: str, value: Any, expected: str) -> str:
    """A config.json field of the wrong JSON type or range, and what it must be instead."""
    kind = {bool: "a boolean", str: "a string", float: "a number", int: "an integer"}.get(
        type(value), "null" if value is None else f"a JSON {type(value).__name__}"
    )
    return (
        f"{key}={short(value)} ({kind}): expected {expected}; fix config.json (save_pretrained "
        f"writes it so)"
    )


def config_problems(cfg: ModelConfig, values: dict[str, Any], where: str) -> list[str]:
    """Each model.* key whose value differs from what the HF checkpoint at `where` has."""
    out = []
    for f in fields(ModelConfig):
        if f.name not in values:
            continue
        given = getattr(cfg, f.name)
        mine = given  # what the model builds: the defaults of null keys resolved
        if f.name == "n_kv_heads":
            mine = given or cfg.n_heads
        elif f.name == "mlp_hidden":
            mine = mlp_hidden_size(cfg)
            default = "d_model" in values and mlp_hidden_size(
                ModelConfig(d_model=values["d_model"])
            )
            if given is None and default == values["mlp_hidden"]:
                continue  # the default follows d_model: fixing d_model fixes it
        if mine != values[f.name]:
            shown = _yaml(given) if given == mine else f"{_yaml(given)} (= {mine!r})"
            out.append(
                f"model.{f.name}={shown}, but {where} has {values[f.name]!r}: set "
                f"model.{f.name}={values[f.name]!r}"
            )
    return out


def _yaml(value: Any) -> str:
    return "null" if value is None else repr(value)
