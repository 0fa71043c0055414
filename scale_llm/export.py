"""`scale-llm export`: a checkpoint of any backend -> a Hugging Face Llama folder (config,
safetensors, tokenizer, scale_llm_export.json), converted tensor by tensor in a temporary folder
renamed into place at the end: --out is either absent or complete."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from scale_llm.components.checkpoint import (
    CLAIM,
    TRAINER_STATE,
    CheckpointWeights,
    checkpoint_around,
    checkpoint_digest,
    read_trainer_state,
    resolve_checkpoint,
    saved_model_config,
)
from scale_llm.components.hf_files import require
from scale_llm.components.precision import DTYPES
from scale_llm.config import ModelConfig
from scale_llm.data.hf_tokenizer import write_tokenizer_files
from scale_llm.data.pretrained_tokenizer import PretrainedTokenizer
from scale_llm.data.tokenizer import (
    Tokenizer,
    file_sha256,
    load_tokenizer,
    refuse_unfit,
    run_tokenizer_path,
)
from scale_llm.errors import UserError, short
from scale_llm.files import (
    atomic_write_json,
    describe_kind,
    folder_file,
    fsync_dir,
    fsync_tree,
    json_object_or_none,
    made_folder,
    new_file_mode,
    require_writable_dir,
    temporary_sibling,
)
from scale_llm.model import build_model
from scale_llm.model.hf import to_hf, to_hf_config
from scale_llm.version import __version__

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD = 5 * 10**9  # bytes per safetensors file (transformers' usual 5GB)
EXPORT_INFO = "scale_llm_export.json"
UNLISTED = f"its {EXPORT_INFO} lists no files"
UNSTATED = f"its {EXPORT_INFO} records no file sizes and times"
# what an export from before a format's first commit lacks, and that commit
OLDER = {UNLISTED: "ef32426 of 2026-12-03", UNSTATED: "69a6692 of 2026-12-06"}


@dataclass
class Source:
    """A checkpoint to export and what it was trained with."""

    checkpoint: Path
    run_dir: Path
    step: int
    model: ModelConfig
    precision: str  # what the run trained in (the plan's resolved precision)
    tokenizer: Tokenizer | PretrainedTokenizer


@dataclass
class Exported:
    out: Path
    step: int
    dtype: str
    n_params: int
    files: list[str]


def read_source(path: str | Path) -> Source:
    ckpt = resolve_checkpoint(path)
    state = read_trainer_state(ckpt)  # checked: its step, its shape, what its files can hold
    model = saved_model_config(state)
    run_dir, tok_path = run_of(ckpt, state["tokenizer_sha256"])
    folder_file(run_dir, tok_path.name, "the run's tokenizer")  # (a link out: refused here)
    if not tok_path.is_file():
        raise UserError(
            f"{tok_path} is missing: the export needs the run's tokenizer; copy the data dir's "
            f"tokenizer.model (the one the run trained with) there"
        )
    tokenizer = load_tokenizer(tok_path)
    refuse_unfit(tokenizer, model.vocab_size, ckpt)
    if tokenizer.sha256() != state["tokenizer_sha256"]:
        raise UserError(
            f"{tok_path} is not the tokenizer {ckpt} was trained with (its SHA-256 differs); "
            f"restore the run's {tok_path.name}"
        )
    precision = state["plan"]["precision"]
    return Source(ckpt, run_dir, int(state["step"]), model, precision, tokenizer)


def run_of(ckpt: Path, sha256: str) -> tuple[Path, Path]:
    """The run dir of checkpoint `ckpt` and its tokenizer of this SHA-256: the folder above
    its checkpoints folder, as named, as the folder is (a link to another disk), or as the
    folder's claim names it; else the first, its tokenizer's path for the error to name."""
    runs = [ckpt.parent.parent]  # <run>/checkpoints/step_XXXXXXXX
    if (folder := checkpoint_around(ckpt.parent)) is not None:  # (abandoned-*/step_N too)
        claimed = (json_object_or_none(folder / CLAIM) or {}).get("run")
        runs += [folder.parent, *([Path(claimed)] if isinstance(claimed, str) else [])]
    for run in dict.fromkeys(runs):
        path = run_tokenizer_path(run, sha256)
        if path.is_file() and file_sha256(path) == sha256:
            return run, path
    return runs[0], run_tokenizer_path(runs[0], sha256)


def default_dtype(precision: str) -> str:
    """bf16 for bf16 and fp16 runs (bf16 keeps fp16's range problems away), fp32 for fp32."""
    return "bf16" if precision in ("bf16", "fp16") else "fp32"


def export(
    path: str | Path,
    out: str | Path,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD,
    force: bool = False,
) -> Exported:
    """Export a checkpoint (or a run directory's newest good one) to the folder `out`."""
    require("scale-llm export", "safetensors", "tokenizers")
    check_out(Path(out), force)  # before the weights are read
    src = read_source(path)
    check_not_inside_source(Path(out), src)
    dtype = dtype or default_dtype(src.precision)
    # read tensor by tensor as they are written: one safetensors shard in memory, not the model
    weights = OneAtATime(CheckpointWeights(src.checkpoint, build_model(src.model).state_dict()))
    info = {
        "scale_llm_version": __version__,
        "run_dir": str(src.run_dir.resolve()),
        "checkpoint": str(src.checkpoint.resolve()),
        # which bytes: equal only for the same checkpoint files (a later branch's step N differs)
        "checkpoint_digest": checkpoint_digest(src.checkpoint),
        "step": src.step,
        "trained_precision": src.precision,
        "tokenizer_sha256": src.tokenizer.sha256(),
    }
    return write_hf_folder(
        weights, src.model, src.tokenizer, out, dtype, max_shard_bytes, force, info
    )


class OneAtATime:
    """A Mapping's tensors handed out once each, as `to_hf` pops them (read when popped): no
    other access, so nothing reads a tensor it did not take."""

    def __init__(self, source: Mapping[str, torch.Tensor]):
        self.source, self.left = source, dict.fromkeys(source)

    def __contains__(self, name: object) -> bool:
        return name in self.left

    def __iter__(self) -> Iterator[str]:
        return iter(self.left)

    def __len__(self) -> int:
        return len(self.left)

    def pop(self, name: str) -> torch.Tensor:
        del self.left[name]
        return self.source[name]


def write_hf_folder(
    state: dict[str, torch.Tensor] | OneAtATime,
    cfg: ModelConfig,
    tokenizer: Tokenizer | PretrainedTokenizer,
    out: str | Path,
    dtype: str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD,
    force: bool = False,
    info: dict[str, Any] | None = None,
) -> Exported:
    """Write our state dict (consumed as written) as a Hugging Face folder at `out`, atomically."""
    out = Path(out)  # where the checks judged it, its links resolved (`link/../x`)
    if out.name in ("", ".."):  # `.`, `x/..`: its temporary sibling beside it, not inside
        out = Path(os.path.realpath(out))
    else:
        out = Path(os.path.realpath(out.parent)) / out.name
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    check_out(out, force)
    if cfg.attention_mask == "document":  # (transformers' Llama has no per-document mask)
        log.warning(
            f"export: the run trained with model.attention_mask=document; {out} computes with "
            f"causal attention over the whole input: the same logits for one document, others "
            f"where an input holds a document end ({cfg.document_end_id}), as lm-eval's EOS "
            f"prefix does (eval.tasks and eval --tasks score through this export)"
        )
    with made_folder(out.parent):  # (folders it makes above --out: removed if it fails)
        tmp = temporary_sibling(out)
        tmp.mkdir()  # a fresh name: this call's own folder, removed on failure
        try:  # (the tokenizer first: its files are checked before the weights take minutes)
            write_tokenizer_files(tokenizer, tmp, cfg.seq_len)
            n_params = _write_weights(state, cfg, DTYPES[dtype], tmp, max_shard_bytes)
            atomic_write_json(
                tmp / "config.json",
                to_hf_config(
                    cfg, DTYPES[dtype], tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
                ),
            )
            atomic_write_json(tmp / "generation_config.json", generation_config(tokenizer))
            files = sorted([*(p.name for p in tmp.iterdir()), EXPORT_INFO])
            stats = {p.name: file_stat(p) for p in tmp.iterdir()}
            # written last, naming every file and its size and time: what proves later that the
            # folder is this export, unchanged
            info = {**(info or {}), "dtype": dtype, "files": files, "stats": stats}
            atomic_write_json(tmp / EXPORT_INFO, info)
            fsync_tree(tmp)
            check_out(out, force)  # again: --out may have changed while the weights were written
            publish(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return Exported(out, int((info or {}).get("step", 0)), dtype, n_params, files)


def check_out(out: Path, force: bool) -> None:
    """--out can become the export: absent, or an earlier export with --force; writable."""
    if out.is_symlink():
        raise UserError(
            f"--out {out} is a symlink; give the folder itself (an export replaces only a folder "
            f"it wrote, never through a link)"
        )
    if out.exists() and not force:
        raise UserError(
            f"{out} already exists; pick another --out, remove it, or pass --force (which "
            f"replaces only an earlier export)"
        )
    if out.exists() and not out.is_dir():
        raise UserError(
            f"--out {out} is {describe_kind(out)}, and the export is a folder; remove it or pick "
            f"another --out (--force replaces only a folder that scale-llm export wrote)"
        )
    problem = not_an_export(out) if out.exists() else None
    if problem in OLDER:
        raise UserError(
            f"--out {out} was written by scale-llm export before {OLDER[problem]} ({problem}); "
            f"this scale_llm replaces only an export that records every file it wrote, so "
            f"--force leaves it alone: move it away, or pick another --out"
        )
    if problem:
        raise UserError(
            f"--out {out} is not an earlier export ({problem}), so --force leaves it alone: it "
            f"replaces only a folder that scale-llm export wrote, holding {EXPORT_INFO} and, "
            f"unchanged, the files it lists; move it away or pick another --out"
        )
    require_writable_dir(out.parent if out.exists() else out, "--out")  # (renamed in place)


def file_stat(path: Path) -> list[int] | None:
    """What an export records of each file it wrote: [size, modification time in ns]."""
    try:
        st = path.stat()
    except OSError:  # (gone since the folder was listed: not as written)
        return None
    return [st.st_size, st.st_mtime_ns]


def not_an_export(folder: Path) -> str | None:
    """Why `folder` is not an export as written (None if it is): its info, and only its files,
    each of the size and modification time the info records."""
    info_path = folder / EXPORT_INFO
    if info_path.is_symlink() or not info_path.is_file():
        return f"it has no {EXPORT_INFO}"
    if (info := json_object_or_none(info_path)) is None:
        return f"its {EXPORT_INFO} is not a JSON object"
    if "files" not in info:
        return UNLISTED
    if not isinstance(listed := info["files"], list) or not all(isinstance(x, str) for x in listed):
        return f"its {EXPORT_INFO} holds files: {short(listed, 40)}, not a list of file names"
    entries = sorted(p.name for p in folder.iterdir())
    foreign = [e for e in entries if e not in listed]
    foreign += [e for e in entries if e not in foreign and not (folder / e).is_file()]
    foreign += [e for e in entries if e not in foreign and (folder / e).is_symlink()]
    if foreign:
        return f"it also holds {_some(foreign)}, which no export writes"
    if not isinstance(stats := info.get("stats"), dict):
        return UNSTATED
    changed = [e for e in entries if e != EXPORT_INFO and stats.get(e) != file_stat(folder / e)]
    if changed:
        return (
            f"{_some(changed)} changed after the export wrote {'them' if changed[1:] else 'it'} "
            f"(size or modification time differs from what {EXPORT_INFO} records)"
        )
    return None


def unwritten_config_keys(folder: Path) -> str | None:
    """Why `folder`'s configs hold a key no export writes (None: they hold none). Some make
    transformers fetch and run code while loading, which `trust_remote_code=False` does not
    stop: `attn_implementation` naming a Hub kernel, some `quantization_config`s."""
    written = {
        "config.json": to_hf_config(ModelConfig(), torch.float32, 0, 0, 0),
        "generation_config.json": generation_config(SimpleNamespace(bos_id=0, eos_id=0, pad_id=0)),
    }
    for name, keys in written.items():
        if extra := sorted(set(json_object_or_none(folder / name) or {}) - set(keys)):
            return f"{folder / name} holds {_some(extra)}, which no export writes"
    return None


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_not_inside_source(out: Path, src: Source) -> None:
    """The export must not land on the run dir, a folder above it, or inside its checkpoints
    (or any checkpoint)."""
    target, run = Path(os.path.realpath(out)), Path(os.path.realpath(src.run_dir))
    if target == run or run.is_relative_to(target) or inside_checkpoints(out, src.checkpoint):
        raise UserError(
            f"--out {out} would overwrite the run it exports ({src.run_dir}, checkpoint "
            f"{src.checkpoint.name}) or lie in a checkpoint; pick a folder outside any run's "
            f"checkpoints, e.g. "
            f"--out exports/{src.run_dir.name}"
        )


def inside_checkpoints(out: Path, ckpt: Path) -> bool:
    """Whether `out` is in any checkpoint (a folder holding trainer.pt: a file there makes it
    count as damaged), or in the run's checkpoints folder that holds `ckpt`."""
    target, folder = Path(os.path.realpath(out)), ckpt.absolute().parent  # (a linked one too)
    return (
        (folder.name == "checkpoints" and target.is_relative_to(os.path.realpath(folder)))
        or any((d / TRAINER_STATE).is_file() for d in (target, *target.parents))
        or checkpoint_around(target) is not None  # (a claimed folder: linked, abandoned-*)
    )


def generation_config(tokenizer: Tokenizer | PretrainedTokenizer) -> dict[str, Any]:
    """`scale-llm generate`'s sampling defaults (temperature 0.8, top-k 50)."""
    return {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
        "do_sample": True,
        "temperature": 0.8,
        "top_k": 50,
    }


def _write_weights(
    state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    dtype: torch.dtype,
    folder: Path,
    max_shard_bytes: int,
) -> int:
    """model.safetensors, or shards and their index past the threshold; the parameters written."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    written, weight_map, total, n_params = [], {}, 0, 0

    def flush() -> None:
        name = f"part-{len(written):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        os.chmod(folder / name, new_file_mode())  # safetensors creates files owner-only (0600)
        weight_map.update(dict.fromkeys(shard, name))
        written.append(name)
        shard.clear()

    for name, tensor in to_hf(cfg, state):
        # a copy in the export dtype: q/k/v views of wqkv must not share storage on disk
        t = tensor.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
        if dtype == torch.float16 and not torch.isfinite(t).all() and tensor.isfinite().all():
            top = tensor.detach().abs().max().item()  # (fp16's largest is 65504)
            raise UserError(
                f"--dtype fp16: {name} holds a value of magnitude {top:.4g}, past fp16's 65504 "
                f"(it would be written as inf); export in bf16 or fp32 (--dtype bf16)"
            )
        del tensor
        if shard and sum(x.nbytes for x in shard.values()) + t.nbytes > max_shard_bytes:
            flush()
        shard[name] = t
        total += t.nbytes
        n_params += t.numel()
    flush()
    _name_shards(folder, written, weight_map, total)
    return n_params


def _name_shards(folder: Path, written: list[str], weight_map: dict[str, str], total: int) -> None:
    """One file: model.safetensors. Several: HF's shard names and model.safetensors.index.json."""
    if len(written) == 1:
        (folder / written[0]).rename(folder / "model.safetensors")
        return
    final = {
        w: f"model-{k + 1:05d}-of-{len(written):05d}.safetensors" for k, w in enumerate(written)
    }
    for old, new in final.items():
        (folder / old).rename(folder / new)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {name: final[w] for name, w in weight_map.items()},
    }
    atomic_write_json(folder / "model.safetensors.index.json", index)


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place (replacing an existing `out` once it is complete;
    cut between the two renames, by a stop signal or an error, the earlier one goes back)."""
    if not out.exists():
        tmp.rename(out)
        fsync_dir(out.parent)
        return
    old = temporary_sibling(out, "old")  # an earlier export (check_out proved it)
    try:
        out.rename(old)
        tmp.rename(out)
        fsync_dir(out.parent)
    except BaseException:
        if old.exists() and not out.exists():
            old.rename(out)
        raise
    finally:
        if old.exists() and out.exists():
            shutil.rmtree(old, ignore_errors=True)
