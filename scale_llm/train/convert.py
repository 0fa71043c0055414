"""`scale-llm convert`: any checkpoint -> one fp32 file of {model, config, step, qkv_layout}
that `torch.load(path, weights_only=True)` reads anywhere. qkv_layout "grouped": wqkv's rows by
kv head (`scale_llm.model.split_qkv`); a file without it is an older convert's."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from scale_llm.components.checkpoint import (
    load_model_weights,
    read_trainer_state,
    resolve_checkpoint,
    saved_model_config,
)
from scale_llm.errors import UserError
from scale_llm.export import inside_checkpoints
from scale_llm.files import (
    describe_kind,
    fsync_dir,
    made_folder,
    temporary_sibling,
    unwritable_dir,
)
from scale_llm.model import empty_state_dict

QKV_LAYOUT = "grouped"  # attention.wqkv's rows, as the file says under "qkv_layout"
OUTPUT_KEYS = {"model", "config", "step", "qkv_layout"}  # exactly what a convert output holds
LAYOUT_SINCE = "14fc0dd of 2026-12-03"  # the first convert that wrote "qkv_layout"


def convert(checkpoint: str | Path, out: str | Path, force: bool = False) -> tuple[Path, int]:
    if str(out).endswith(("/", os.sep)):  # (Path drops the slash that names a folder)
        example = Path(out) / "model.pt"
        raise UserError(f"--out {out} names a folder; give the file to write, e.g. --out {example}")
    out = Path(out)
    check_out(out, force)
    if found := unwritable_dir(out.parent):  # (--out names the file: its folder is the problem)
        existing, why = found
        where = existing.absolute().parent if why == "file" else Path.home()
        raise UserError(
            f"--out {out}: {existing} is "
            + (f"{describe_kind(existing)}, not a folder" if why == "file" else "not writable")
            + f", so {out.name} cannot be written there; give a path in a folder you can write, "
            f"e.g. --out {where / out.name}"
        )
    ckpt = resolve_checkpoint(checkpoint)
    if inside_checkpoints(out, ckpt):
        raise UserError(
            f"--out {out} is inside a checkpoint directory; write the file elsewhere (not in "
            f"{ckpt.parent} or a checkpoint: a file there makes it count as damaged), e.g. "
            f"--out {ckpt.absolute().parent.parent.name}.pt"
        )
    state = read_trainer_state(ckpt)  # checked: the step, and a shape its files can hold
    loaded = load_model_weights(ckpt, empty_state_dict(saved_model_config(state)))  # its shape
    weights = {k: v.float().contiguous() for k, v in loaded.items()}
    tmp = temporary_sibling(out)  # a fresh name: nothing else is ever written over
    with made_folder(out.parent):
        try:
            with open(tmp, "xb") as f:
                saved = {"model": weights, "config": state["config"], "step": state["step"]}
                torch.save({**saved, "qkv_layout": QKV_LAYOUT}, f)  # (OUTPUT_KEYS)
                f.flush()
                os.fsync(f.fileno())
            check_out(out, force)  # still absent, or an earlier output, as at the start
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    fsync_dir(out.parent)
    return out, sum(v.numel() for v in weights.values())


def check_out(out: Path, force: bool) -> None:
    """--out is new, or (with --force) a regular file an earlier `convert` wrote: nothing else."""
    if not (out.exists() or out.is_symlink()):
        return
    if out.is_dir() and not out.is_symlink():
        raise UserError(
            f"--out {out} is a directory; give the file to write, e.g. --out {out / 'model.pt'}"
        )
    if out.is_symlink() or not out.is_file():
        raise UserError(
            f"--out {out} is {describe_kind(out)}; convert writes a new regular file and never "
            f"replaces anything else: pick another --out"
        )
    if not force:
        raise UserError(
            f"--out {out} already exists; pick another --out, or pass --force to replace it "
            f"(--force replaces only a file that scale-llm convert wrote)"
        )
    try:  # the top-level mapping, through mmap (the tensors' bytes are not read)
        saved = torch.load(out, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a torch zip file, or one with objects outside the allow-list
        saved = None
    keys = set(saved) if isinstance(saved, dict) else set()
    if keys == OUTPUT_KEYS - {"qkv_layout"}:
        raise UserError(
            f"--out {out} was written by scale-llm convert before {LAYOUT_SINCE} (no "
            f"qkv_layout: q/k/v stacked, or not recorded); this scale_llm replaces only a file "
            f"of its own layout (qkv_layout: {QKV_LAYOUT}), so --force leaves it alone: move "
            f"it away, or pick another --out"
        )
    if keys != OUTPUT_KEYS or saved["qkv_layout"] != QKV_LAYOUT:
        raise UserError(
            f"--out {out} is not a file scale-llm convert wrote (it does not hold exactly "
            f"model, config, step and qkv_layout: {QKV_LAYOUT}), so --force leaves it alone; "
            f"pick another --out"
        )
