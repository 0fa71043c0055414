"""`model.init_from`: start a fresh run from the weights of a Hugging Face Llama folder.

The folder's config must describe the model the run's config builds (each differing model.* key
is named with the value to set), its tensors must have that model's shapes, and when it carries
a tokenizer that must be the tokenizer of data.dir: the same files data.tokenizer named when
prepare encoded data.dir with a model's tokenizer, else our `tokenizer.model` (as `scale-llm
export` writes it) with the SHA-256 of data.dir's. The weights come back as one full fp32
state dict on the CPU: what every backend's `setup(model, initial_weights)` already accepts when
it materializes the model, before it shards or wraps it. A resume ignores init_from: the
checkpoint holds newer weights.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from scale_llm.components.hf_files import HFWeights, read_hf_config
from scale_llm.config import ModelConfig
from scale_llm.data.pretrained_tokenizer import ENCODERS, folder_digest
from scale_llm.errors import UserError
from scale_llm.files import folder_file, read_folder_file
from scale_llm.model.hf import FromHF, config_problems, from_hf_config, shape_problems

log = logging.getLogger(__name__)
WHAT = "model.init_from"
MAX_SHAPE_LINES = 8


def check_init_from(
    cfg: ModelConfig, tokenizer_sha256: str | None, tokenizer_files_sha256: str | None = None
) -> Path:
    """The folder `cfg.init_from`, after checking that it fits `cfg` and holds the tokenizer
    of data.dir: `tokenizer_sha256` is data.dir's tokenizer file's, `tokenizer_files_sha256` the
    digest of the folder data.tokenizer named, when prepare encoded data.dir with a model's
    tokenizer. Reads the config and the tensors' shapes, not the weights."""
    folder = Path(cfg.init_from)
    hf_config = read_hf_config(folder, WHAT)
    values, problems = from_hf_config(hf_config)
    problems += config_problems(cfg, values, f"{folder}/config.json")
    shapes = shape_problems(cfg, HFWeights(folder, WHAT).shapes())
    problems += shapes[:MAX_SHAPE_LINES]
    if len(shapes) > MAX_SHAPE_LINES:
        problems.append(f"... and {len(shapes) - MAX_SHAPE_LINES} more tensors")
    problems += _tokenizer_problems(folder, tokenizer_sha256, tokenizer_files_sha256)
    if problems:
        raise UserError(
            f"{WHAT}={folder} cannot start this run:\n  - "
            + "\n  - ".join(problems)
            + "\nMake the model section match the checkpoint, or pick another folder."
        )
    return folder


def load_init_weights(cfg: ModelConfig, folder: Path) -> Mapping[str, torch.Tensor]:
    """Our parameters from `folder` (checked by `check_init_from`), as fp32 on the CPU, each
    read when asked: a sharded start holds one full parameter at a time."""
    log.info("init_from: %s: the optimizer starts from zero", folder)
    return FromHF(cfg, HFWeights(folder, WHAT).get)


def _tokenizer_problems(
    folder: Path, data_sha256: str | None, files_sha256: str | None
) -> list[str]:
    if not any(folder_file(folder, name, WHAT) for name in ENCODERS):
        log.warning(
            "init_from: %s has no tokenizer (tokenizer.json or tokenizer.model), so whether "
            "data.dir was tokenized with the tokenizer these weights learned cannot be checked; "
            "the ids must mean the same pieces or training starts from nonsense",
            folder,
        )
        return []
    prepare_with = f"set data.tokenizer={folder} and run `scale-llm prepare` (it encodes with it)"
    if files_sha256 is not None:  # data.dir was encoded with a folder's tokenizer
        if folder_digest(folder, WHAT) != files_sha256:
            return [
                f"{folder}'s tokenizer files differ from those of the data.tokenizer data.dir "
                f"was encoded with: the weights learned other token ids; {prepare_with}"
            ]
        return []
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
