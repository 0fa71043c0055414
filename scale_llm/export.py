"""`scale-llm export`: a checkpoint of any backend -> a Hugging Face Llama folder.

The folder loads with `transformers` (`LlamaForCausalLM`, `AutoTokenizer`) and serves with vLLM:
config.json, model.safetensors (or shards + model.safetensors.index.json past --max-shard-size),
generation_config.json, the tokenizer (tokenizer.json built from our SentencePiece model,
tokenizer_config.json, special_tokens_map.json, tokenizer.model) and scale_llm_export.json (which
run, step and tokenizer it came from). The weights are read once (`load_model_weights` reads
single, DDP, FSDP2 and DeepSpeed checkpoints on the CPU) and converted tensor by tensor, so the
export holds one copy of the model plus one shard. It is built in a temporary folder beside
--out and renamed into place at the end: --out is either absent or complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from scale_llm.components.checkpoint import (
    TRAINER_STATE,
    fsync_tree,
    load_model_weights,
    resolve_checkpoint,
)
from scale_llm.components.hf_files import require
from scale_llm.components.serialization import load_file
from scale_llm.config import ModelConfig
from scale_llm.data.hf_tokenizer import write_tokenizer_files
from scale_llm.data.tokenizer import Tokenizer, file_sha256
from scale_llm.errors import UserError, require_writable_dir
from scale_llm.model import empty_state_dict
from scale_llm.model.hf import to_hf, to_hf_config
from scale_llm.version import __version__

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_MAX_SHARD = 5 * 10**9  # bytes per safetensors file (transformers' usual 5GB)
EXPORT_INFO = "scale_llm_export.json"


@dataclass
class Source:
    """A checkpoint to export and what it was trained with."""

    checkpoint: Path
    run_dir: Path
    step: int
    model: ModelConfig
    precision: str  # what the run trained in (the plan's resolved precision)
    tokenizer: Tokenizer


@dataclass
class Exported:
    out: Path
    step: int
    dtype: str
    n_params: int
    files: list[str]


def read_source(path: str | Path) -> Source:
    ckpt = resolve_checkpoint(path)
    state = load_file(ckpt / TRAINER_STATE)
    saved = state["config"]["model"]
    model = ModelConfig(**{f.name: saved[f.name] for f in fields(ModelConfig) if f.name in saved})
    run_dir = ckpt.parent.parent  # <run>/checkpoints/step_XXXXXXXX
    tok_path = run_dir / "tokenizer.model"
    if not tok_path.is_file():
        raise UserError(
            f"{tok_path} is missing: the export needs the run's tokenizer; copy the data dir's "
            f"tokenizer.model (the one the run trained with) there"
        )
    want = state.get("tokenizer_sha256")
    if want is not None and file_sha256(tok_path) != want:
        raise UserError(
            f"{tok_path} is not the tokenizer {ckpt} was trained with (its SHA-256 differs); "
            f"restore the run's tokenizer.model"
        )
    precision = (state.get("plan") or {}).get("precision", "fp32")
    return Source(ckpt, run_dir, int(state["step"]), model, precision, Tokenizer(tok_path))


def default_dtype(precision: str) -> str:
    """bf16 for runs that trained in bf16 or fp16 (bf16 keeps fp16's range problems away),
    fp32 for fp32 runs."""
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
    dtype = dtype or default_dtype(src.precision)
    weights = load_model_weights(src.checkpoint, empty_state_dict(src.model))
    info = {
        "scale_llm_version": __version__,
        "run_dir": str(src.run_dir.resolve()),
        "checkpoint": str(src.checkpoint.resolve()),
        "step": src.step,
        "trained_precision": src.precision,
        "tokenizer_sha256": src.tokenizer.sha256(),
    }
    return write_hf_folder(
        weights, src.model, src.tokenizer, out, dtype, max_shard_bytes, force, info
    )


def write_hf_folder(
    state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    tokenizer: Tokenizer,
    out: str | Path,
    dtype: str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD,
    force: bool = False,
    info: dict[str, Any] | None = None,
) -> Exported:
    """Write our state dict (consumed: each tensor is dropped once written) as a Hugging Face
    folder at `out`, atomically."""
    out = Path(out)
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    check_out(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        n_params = _write_weights(state, cfg, DTYPES[dtype], tmp, max_shard_bytes)
        _write_json(
            tmp / "config.json",
            to_hf_config(cfg, DTYPES[dtype], tokenizer.bos_id, tokenizer.eos_id, tokenizer.eos_id),
        )
        _write_json(tmp / "generation_config.json", generation_config(tokenizer))
        write_tokenizer_files(tokenizer, tmp, cfg.seq_len)
        _write_json(tmp / EXPORT_INFO, {**(info or {}), "dtype": dtype})
        files = sorted(p.name for p in tmp.iterdir())
        fsync_tree(tmp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, int((info or {}).get("step", 0)), dtype, n_params, files)


def check_out(out: Path, force: bool) -> None:
    """--out can become the export folder: absent (or a folder, with --force), in a directory
    that is, or can become, writable."""
    if out.exists() and not force:
        raise UserError(f"{out} already exists; pick another --out, remove it, or pass --force")
    if out.exists() and not out.is_dir():
        raise UserError(
            f"--out {out} is a file, and the export is a folder; remove the file or pick "
            f"another --out (--force replaces only a folder)"
        )
    require_writable_dir(out.parent if out.exists() else out, "--out")  # (renamed in place)


def generation_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """`scale-llm generate`'s sampling defaults (temperature 0.8, top-k 50)."""
    return {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.eos_id,
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
    """model.safetensors, or model-0000k-of-0000n.safetensors + the index past the threshold;
    returns the number of parameters written."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    shard_bytes, written, weight_map, total, n_params = 0, [], {}, 0, 0

    def flush() -> None:
        name = f"part-{len(written):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        os.chmod(folder / name, _file_mode())  # safetensors creates files owner-only (0600)
        weight_map.update(dict.fromkeys(shard, name))
        written.append(name)
        shard.clear()

    for name, tensor in to_hf(cfg, state):
        # a copy in the export dtype: q/k/v views of wqkv must not share storage on disk
        t = tensor.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
        del tensor
        nbytes = t.numel() * t.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
            shard_bytes = 0
        shard[name] = t
        shard_bytes += nbytes
        total += nbytes
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
    _write_json(folder / "model.safetensors.index.json", index)


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place (an existing --out, with --force, is replaced
    only once the new one is complete)."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _file_mode() -> int:
    """The mode a new file gets here (0644 under the usual umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
