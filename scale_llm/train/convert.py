"""`scale-llm convert`: any checkpoint -> one self-describing fp32 file.

The file holds {"model": state_dict, "config": the run's resolved config, "step": N}; it loads
with `torch.load(path, weights_only=True)` anywhere, without torch.distributed or DeepSpeed.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from scale_llm.components.checkpoint import (
    TRAINER_STATE,
    load_model_weights,
    resolve_checkpoint,
)
from scale_llm.components.serialization import load_file
from scale_llm.config import ModelConfig
from scale_llm.errors import UserError, require_writable_dir
from scale_llm.model import empty_state_dict


def convert(checkpoint: str | Path, out: str | Path) -> tuple[Path, int]:
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if out.is_dir():
        raise UserError(
            f"--out {out} is a directory; give the file to write, e.g. --out {out / 'model.pt'}"
        )
    if tmp.is_dir():
        raise UserError(f"{tmp} (convert's temporary file) is a directory; remove it first")
    require_writable_dir(out.parent, "--out")
    ckpt = resolve_checkpoint(checkpoint)
    state = load_file(ckpt / TRAINER_STATE)
    # the checkpoint records its own shape (older ones also held keys that have moved since)
    saved = state["config"]["model"]
    model_cfg = ModelConfig(
        **{f.name: saved[f.name] for f in fields(ModelConfig) if f.name in saved}
    )
    loaded = load_model_weights(ckpt, empty_state_dict(model_cfg))
    weights = {k: v.float().contiguous() for k, v in loaded.items()}
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": weights, "config": state["config"], "step": state["step"]}, tmp)
    tmp.replace(out)
    return out, sum(v.numel() for v in weights.values())
