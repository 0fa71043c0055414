"""Sampling from a trained run: temperature, top-k, top-p, with a KV cache. Past model.seq_len a
full cache starts over from the newest seq_len // 2 tokens (the uncached path slides a window)."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

from scale_llm.components.checkpoint import (
    TRAINER_STATE,
    Checkpointer,
    load_model_weights,
    read_trainer_state,
    resolve_checkpoint,
    saved_section,
)
from scale_llm.components.precision import Precision
from scale_llm.config import Config, ModelConfig, get_key, load_config, run_defining_keys
from scale_llm.config.load import read_yaml
from scale_llm.config.plan import RunPlan
from scale_llm.config.sections import same_resolved
from scale_llm.data.pretrained_tokenizer import PretrainedTokenizer
from scale_llm.data.tokenizer import (
    Tokenizer,
    continuation,
    load_tokenizer,
    refuse_unfit,
    run_tokenizer_path,
)
from scale_llm.errors import UserError
from scale_llm.model import KVCache, Transformer, build_model, empty_state_dict

log = logging.getLogger(__name__)


def read_run_config(run_dir: str | Path) -> Config:
    """The config a run directory was trained with."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(
            f"{run_dir} is not a run directory (no config.yaml); pass the directory "
            f"`scale-llm train` wrote, e.g. runs/tiny"
        )
    if "model" not in read_yaml(path := run_dir / "config.yaml"):  # (defaults stood in)
        raise UserError(
            f"{path} holds no model section, so it is not the config `scale-llm train` wrote "
            f"there (train writes every section): restore it from a copy of the run"
        )
    return load_config(path)


def load_run(
    run_dir: str | Path, cfg: Config, plan: RunPlan, checkpoint: str | Path | None = None
) -> tuple[Transformer, Tokenizer | PretrainedTokenizer]:
    """The model of a run's newest (or the given) checkpoint on the plan's device; its tokenizer."""
    run_dir = Path(run_dir)
    ckpt = run_checkpoint(run_dir, checkpoint)
    state = read_trainer_state(ckpt)  # checked: the step, the model section, the tokenizer hash
    own = refuse_other_model(run_dir, ckpt, state, cfg)
    trained_with = state["tokenizer_sha256"]
    tok_path = run_tokenizer_path(run_dir, trained_with)
    tokenizer = load_tokenizer(tok_path)
    if tokenizer.sha256() != trained_with:
        if not own:
            raise UserError(
                f"{ckpt} belongs to another run: it was trained with another "
                f"tokenizer than {tok_path} (sha256 {trained_with[:12]}... "
                f"vs {tokenizer.sha256()[:12]}...); generate from that checkpoint's own run "
                f"directory ({ckpt.parent.parent}), or pick a checkpoint of {run_dir}"
            )
        raise UserError(
            f"{tok_path} is not the tokenizer {ckpt} was trained with "
            f"(sha256 {tokenizer.sha256()[:12]}..., the checkpoint records "
            f"{trained_with[:12]}...); copy the {tok_path.name} of the run's data.dir back"
        )
    refuse_unfit(tokenizer, cfg.model.vocab_size, ckpt)
    model = build_model(cfg.model)
    model.load_state_dict(load_model_weights(ckpt, empty_state_dict(cfg.model)), assign=True)
    model.to(plan.device).eval()
    return model, tokenizer


def refuse_other_model(run_dir: Path, ckpt: Path, state: dict[str, Any], cfg: Config) -> bool:
    """Refuse a run config (`cfg`, the run's config.yaml) whose model is not the one `ckpt`
    trained; whether `ckpt` is the run's own (one moved aside too; its checkpoints folder may be
    a link)."""
    own = Path(os.path.realpath(ckpt)).is_relative_to(os.path.realpath(run_dir / "checkpoints"))
    differs = model_differences(state["config"], cfg)
    if differs and own:  # its config.yaml was edited
        raise UserError(
            f"{run_dir / 'config.yaml'} differs from the model {ckpt} was trained as, in "
            f"{'; '.join(differs)}: it was edited after the run wrote it; restore those values "
            f"(the checkpoint's trainer.pt holds the config it was trained with)"
        )
    if differs:
        raise UserError(
            f"{ckpt} belongs to another run: its model differs from {run_dir}'s "
            f"config.yaml in {'; '.join(differs)}; generate from that checkpoint's own run "
            f"directory ({ckpt.parent.parent}), or pick a checkpoint of {run_dir}"
        )
    return own


def run_checkpoint(run_dir: Path, checkpoint: str | Path | None) -> Path:
    """The checkpoint `--checkpoint` names (or its run's newest good one), else the run's."""
    if checkpoint is None:
        checkpoints = Checkpointer(run_dir, 1)
        if (ckpt := checkpoints.latest_good()) is None:
            if damaged := len(checkpoints.complete()):  # (each named above, with its problem)
                raise UserError(
                    f"{run_dir}'s {damaged} complete checkpoint(s) are all damaged (the warnings "
                    f"above say how); restore one from a copy, or train again"
                )
            raise UserError(
                f"{run_dir} has no complete checkpoint; train longer or set checkpoint.every "
                f"so that one is saved"
            )
        return ckpt
    path = Path(checkpoint)
    if (path / TRAINER_STATE).is_file() or Checkpointer(path, 1).complete():
        return resolve_checkpoint(path)  # (refuses a damaged one)
    have = [p.name for _, p in Checkpointer(run_dir, 1).complete()]
    shown = ", ".join(have[-5:]) or "none"
    raise UserError(
        f"--checkpoint {checkpoint}: not a checkpoint directory (no {TRAINER_STATE} inside) nor "
        f"a run directory with one; {run_dir / 'checkpoints'} holds {len(have)} complete "
        f"checkpoint{'s' if len(have) != 1 else ''} ({shown}): pass one of them, e.g. "
        f"--checkpoint {run_dir / 'checkpoints' / (have[-1] if have else 'step_00000100')}, "
        f"or leave --checkpoint out for the newest good one"
    )


def model_differences(saved: dict[str, Any], cfg: Config) -> list[str]:
    """ "key (X in the checkpoint, Y in the run)" for each run-defining model.* key that differs."""
    model = saved.get("model") or {}
    out = []
    for key in run_defining_keys():
        section, name = key.split(".", 1)
        # (older checkpoints lack keys added since)
        if section == "model" and name in model and model[name] != (now := get_key(cfg, key)):
            if same_resolved(key, saved_section(ModelConfig, "model", model)[0], cfg.model):
                continue  # (null: the computed value)
            out.append(f"{key} ({model[name]!r} in the checkpoint, {now!r} in the run)")
    return out


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
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


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
    vocab_size: int | None = None,
    use_cache: bool = True,
    autocast: contextlib.AbstractContextManager | None = None,
) -> list[int]:
    """Continue `prompt` by up to max_new_tokens ids (stops early at eos_id). Ids are sampled
    below `vocab_size` (a tokenizer's; the model's rows past it are no token)."""
    device, cfg = model.tok_embeddings.weight.device, model.cfg
    seq_len, stops = cfg.seq_len, {eos_id}
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    tokens = list(prompt[-seq_len:])
    if cfg.attention_mask == "document":  # (the cache holds no mask: what training's mask sees)
        ends = [i for i, t in enumerate(tokens[:-1]) if t == cfg.document_end_id]
        tokens, stops = tokens[ends[-1] + 1 :] if ends else tokens, {eos_id, cfg.document_end_id}
    cache = KVCache(model.cfg.n_layers, seq_len) if use_cache else None
    out: list[int] = []

    def forward(ids: list[int], start_pos: int = 0) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=device)
        return model(x, cache=cache, start_pos=start_pos)

    with autocast or contextlib.nullcontext():
        logits = forward(tokens)
        pos = len(tokens)
        for _ in range(max_new_tokens):
            last = logits[:, -1, :vocab_size]
            nxt = sample_next(last, temperature, top_k, top_p, generator).item()
            out.append(nxt)
            tokens.append(nxt)
            if nxt in stops or len(out) == max_new_tokens:
                break  # (no forward pass for a token that will not be sampled)
            if cache is None:
                logits = forward(tokens[-seq_len:])
            elif pos == seq_len:  # cache full: start over from the newest half of the context
                tokens_kept = tokens[-(seq_len // 2) :]
                logits, pos = forward(tokens_kept), len(tokens_kept)
            else:
                logits, pos = forward([nxt], pos), pos + 1
    return out


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
    autocast = Precision(plan.precision, plan.device.type).autocast()
    prompt_ids, seq_len = tokenizer.encode(prompt, bos=True), cfg.model.seq_len
    if len(prompt_ids) > seq_len:
        log.warning(
            f"generate: the prompt is {len(prompt_ids)} tokens (with BOS), more than the model's "
            f"context of model.seq_len={seq_len}: only its last {seq_len} tokens are read (the "
            f"text printed starts with the whole prompt)"
        )
    sampling = (max_new_tokens, temperature, top_k, top_p, seed)
    ids = generate(
        model, prompt_ids, *sampling, tokenizer.eos_id, tokenizer.vocab_size, autocast=autocast
    )
    return prompt + continuation(tokenizer, prompt_ids, ids)
