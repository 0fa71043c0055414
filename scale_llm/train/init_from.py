"""`model.init_from`: start a fresh run from a Hugging Face Llama folder whose config, tensor
shapes and tokenizer (if it carries one) match the run's model and data.dir; its weights reach
the backend's `setup` as fp32 on the CPU. A resume ignores it (the checkpoint is newer)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection, Mapping
from pathlib import Path

import torch

from scale_llm.components.hf_files import HFWeights, read_hf_config
from scale_llm.config import ModelConfig
from scale_llm.data.pretrained_tokenizer import ENCODERS, folder_digest
from scale_llm.errors import UserError
from scale_llm.files import folder_file, read_folder_file
from scale_llm.model.hf import (
    ARCHITECTURE,
    FromHF,
    config_problems,
    from_hf_config,
    hf_shapes,
    shape_problems,
)

log = logging.getLogger(__name__)
WHAT = "model.init_from"
MAX_SHAPE_LINES = 8


def check_init_from(
    cfg: ModelConfig,
    tokenizer_sha256: str | None,
    tokenizer_files_sha256: str | None = None,
    compare_head: bool = True,
) -> Path:
    """The folder `cfg.init_from`, checked to fit `cfg` and data.dir's tokenizer (its file's
    SHA-256, or the digest of data.tokenizer's folder); reads config and shapes, and with
    `compare_head` (one rank) a tied config's two matrices where the file holds both."""
    folder = Path(cfg.init_from)
    values, problems = from_hf_config(read_hf_config(folder, WHAT))
    problems += config_problems(cfg, values, f"{folder}/config.json")
    weights = HFWeights(folder, WHAT)
    found = weights.shapes(hf_shapes(cfg))
    shapes = shape_problems(cfg, found)
    problems += shapes[:MAX_SHAPE_LINES]
    embedding, head = "model.embed_tokens.weight", "lm_head.weight"
    tied = compare_head and cfg.tie_embeddings and head in found and not shapes  # (untied)
    if tied and not torch.equal(weights.get(head), weights.get(embedding)):
        problems.append(
            f"{head} differs from {embedding}, and tie_word_embeddings is true: transformers "
            f"computes with both (it ties only equal ones); set tie_word_embeddings: false in "
            f"config.json and model.tie_embeddings=false to load them"
        )
    if len(shapes) > MAX_SHAPE_LINES:
        problems.append(f"... and {len(shapes) - MAX_SHAPE_LINES} more tensors")
    problems += _tokenizer_problems(folder, tokenizer_sha256, tokenizer_files_sha256)
    if problems:
        raise UserError(
            f"{WHAT}={folder} cannot start this run:\n  - "
            + "\n  - ".join(problems)
            + "\nMake the model section match the checkpoint, or pick another folder."
        )
    if compare_head and (unread := _unread(cfg, found)):
        log.warning(
            f"init_from: {folder} holds {len(unread)} tensor(s) the model does not read "
            f"({', '.join(unread[:3])}{', ...' if len(unread) > 3 else ''}): left out, as "
            f"transformers leaves them out of a {ARCHITECTURE}; a checkpoint holding more layers, "
            f"or biases, than its config.json declares computed differently where it was trained"
        )
    return folder


def _unread(cfg: ModelConfig, found: Collection[str]) -> list[str]:
    """The folder's tensors the model does not read, but a tied head (compared with the
    embeddings) and RoPE's inverse frequencies (a buffer older transformers saved)."""
    read = {*hf_shapes(cfg), *(["lm_head.weight"] if cfg.tie_embeddings else [])}
    return sorted(n for n in found if n not in read and not n.endswith("rotary_emb.inv_freq"))


def load_init_weights(cfg: ModelConfig, folder: Path) -> Mapping[str, torch.Tensor]:
    """Our parameters from `folder` as fp32 on the CPU, each read when asked (one at a time)."""
    log.info("init_from: %s: the optimizer starts from zero", folder)
    return FromHF(cfg, HFWeights(folder, WHAT).get)


def _tokenizer_problems(
    folder: Path, data_sha256: str | None, files_sha256: str | None
) -> list[str]:
    if not any(folder_file(folder, name, WHAT) for name in ENCODERS):
        log.warning(
            f"init_from: {folder} has no tokenizer (tokenizer.json or tokenizer.model), so whether "
            "data.dir was tokenized with the tokenizer these weights learned cannot be checked; "
            "the ids must mean the same pieces or training starts from nonsense"
        )
        return []
    prepare_with = f"set data.tokenizer={folder} and run `scale-llm prepare` (it encodes with it)"
    if files_sha256 is not None:  # data.dir was encoded with a folder's tokenizer
        if folder_digest(folder, WHAT) == files_sha256:
            return []
        return [
            f"{folder}'s tokenizer files differ from those of the data.tokenizer data.dir "
            f"was encoded with: the weights learned other token ids; {prepare_with}"
        ]
    if data_sha256 is None:
        return []
    ours = folder / "tokenizer.model"
    data = read_folder_file(folder, ours.name, WHAT)
    if data is None:
        return [
            f"{folder} carries its own tokenizer (tokenizer.json), but data.dir was encoded "
            f"with one prepare trained: the weights learned other token ids; {prepare_with}"
        ]
    if hashlib.sha256(data).hexdigest() != data_sha256:
        return [
            f"{ours} differs from the tokenizer of data.dir: the weights learned other token "
            f"ids; point data.dir at the data the exported run trained on, or {prepare_with}"
        ]
    return []
