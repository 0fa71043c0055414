"""Sampling from a trained run: temperature, top-k, top-p, with a KV cache.

With the cache each new token costs one position's forward pass; without it the whole context is
recomputed. Greedy decoding (temperature 0) gives the same tokens either way while the prompt and
the new tokens fit in model.seq_len. Past it, the cached path starts over from the newest
seq_len // 2 tokens each time the cache is full (one prefill every seq_len // 2 tokens: the
model then sees between half and all of seq_len), while the uncached path slides a full window
one token at a time, so the two can differ from there on.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from scale_llm.components.checkpoint import (
    TRAINER_STATE,
    Checkpointer,
    damage,
    load_model_weights,
)
from scale_llm.components.precision import Precision
from scale_llm.components.serialization import load_file
from scale_llm.config import Config, load_config
from scale_llm.data.tokenizer import Tokenizer
from scale_llm.errors import UserError
from scale_llm.model import KVCache, Transformer, build_model, empty_state_dict
from scale_llm.plan import RunPlan


def read_run_config(run_dir: str | Path) -> Config:
    """The config a run directory was trained with."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(
            f"{run_dir} is not a run directory (no config.yaml); pass the directory "
            f"`scale-llm train` wrote, e.g. runs/tiny"
        )
    return load_config(run_dir / "config.yaml")


def load_run(
    run_dir: str | Path, cfg: Config, plan: RunPlan, checkpoint: str | Path | None = None
) -> tuple[Transformer, Tokenizer]:
    """The model of a run's newest (or the given) checkpoint on the plan's device, with the
    run's tokenizer."""
    run_dir = Path(run_dir)
    ckpt = Path(checkpoint) if checkpoint else Checkpointer(run_dir, 1).latest_good()
    problem = damage(ckpt) if checkpoint else None  # latest_good() has checked its choice
    if problem is not None:
        raise UserError(f"{ckpt} is damaged: {problem}; pick another checkpoint")
    if ckpt is None:
        raise UserError(
            f"{run_dir} has no complete checkpoint; train longer or set checkpoint.every so "
            f"that one is saved"
        )
    tokenizer = Tokenizer(run_dir / "tokenizer.model")
    trained_with = load_file(ckpt / TRAINER_STATE).get("tokenizer_sha256")
    if trained_with is not None and tokenizer.sha256() != trained_with:
        raise UserError(
            f"{run_dir / 'tokenizer.model'} is not the tokenizer {ckpt} was trained with "
            f"(sha256 {tokenizer.sha256()[:12]}..., the checkpoint records "
            f"{trained_with[:12]}...); copy the tokenizer.model of the run's data.dir back"
        )
    weights = load_model_weights(ckpt, empty_state_dict(cfg.model))
    model = build_model(cfg.model)
    model.load_state_dict(weights, assign=True)
    model.to(plan.device)
    model.eval()
    return model, tokenizer


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """logits (B, V) -> next token ids (B, 1). temperature 0 means greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    # shifted first: the best logit becomes 0, so a tiny temperature gives -inf, never inf - inf
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) > top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    autocast: contextlib.AbstractContextManager | None = None,
) -> list[int]:
    """Continue `prompt` by up to max_new_tokens ids (stops early at eos_id)."""
    device = model.tok_embeddings.weight.device
    seq_len = model.cfg.seq_len
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    tokens = list(prompt[-seq_len:])
    cache = KVCache(model.cfg.n_layers, seq_len) if use_cache else None
    autocast = autocast or contextlib.nullcontext()
    out: list[int] = []
    with autocast:
        logits = _forward(model, tokens, cache, 0)
        pos = len(tokens)
        for _ in range(max_new_tokens):
            nxt = sample_next(logits[:, -1], temperature, top_k, top_p, generator).item()
            out.append(nxt)
            tokens.append(nxt)
            if nxt == eos_id or len(out) == max_new_tokens:
                break  # (no forward pass for a token that will not be sampled)
            if cache is None:
                logits = _forward(model, tokens[-seq_len:], None, 0)
            elif pos == seq_len:  # cache full: start over from the newest half of the context
                tokens_kept = tokens[-(seq_len // 2) :]
                logits, pos = _forward(model, tokens_kept, cache, 0), len(tokens_kept)
            else:
                logits, pos = _forward(model, [nxt], cache, pos), pos + 1
    return out


def _forward(
    model: Transformer, ids: list[int], cache: KVCache | None, start_pos: int
) -> torch.Tensor:
    device = model.tok_embeddings.weight.device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    return model(x, cache=cache, start_pos=start_pos)


def generate_text(
    run_dir: str | Path,
    cfg: Config,
    plan: RunPlan,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int | None = 0,
    checkpoint: str | Path | None = None,
) -> str:
    model, tokenizer = load_run(run_dir, cfg, plan, checkpoint)
    precision = Precision(plan.precision, plan.device.type)
    ids = generate(
        model,
        tokenizer.encode(prompt, bos=True),
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        seed,
        eos_id=tokenizer.eos_id,
        autocast=precision.autocast(),
    )
    return prompt + tokenizer.decode(ids)
