"""The trainer's checks of what is already on disk, run before any work: pure functions that
read the file system and raise a UserError naming the path and the fix, so that a run dir the
loop could not write into stops at launch, not at the first save after hours of training."""

from __future__ import annotations

from collections.abc import Sized
from pathlib import Path
from typing import Any

from scale_llm.config import Config
from scale_llm.config.plan import RunPlan
from scale_llm.data.pretrained_tokenizer import BUNDLE_FILE, vocab_problem
from scale_llm.errors import UserError
from scale_llm.files import describe_kind

METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step
WANDB_ID_FILE = "wandb-id.txt"  # the W&B run id, so that a resumed run logs to the same run

# What the trainer creates inside RUN_DIR, by the kind it must be: a name that exists as
# another kind (a file where a folder belongs, a folder or named pipe where a file belongs)
# would fail at its first write, or block on the pipe.
RUN_DIR_FOLDERS = {
    "checkpoints": "its checkpoints",
    "tensorboard": "its TensorBoard event files",
    "wandb": "its offline Weights & Biases logs",
}
RUN_DIR_FILES = {
    "config.yaml": "its config",
    "plan.json": "its resolved plan",
    "tokenizer.model": "its copy of the tokenizer",
    BUNDLE_FILE: "its copy of the tokenizer (a model's own: data.tokenizer)",
    "ds_config.json": "its DeepSpeed config",
    "deepspeed.log": "what DeepSpeed prints while it consolidates a checkpoint",
    METRICS_FILE: "its metric rows",
    WANDB_ID_FILE: "its Weights & Biases run id",
}


# What only a run dir holds: a folder with none of these (and anything at all in it) is someone
# else's, whose files (a config.yaml, say) the run would replace.
RUN_MARKS = ("plan.json", "checkpoints", METRICS_FILE, ".lock")


def check_run_dir(run_dir: Path) -> None:
    """`run_dir` is new, empty or a run's, and every name the trainer writes there is missing
    or of the kind it writes (a symlinked folder is fine, e.g. checkpoints on another disk; a
    symlinked file is not: the run writes its files itself, by rename)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return  # a new run dir (require_writable_dir checks that it can be made)
    entries = sorted(p.name for p in run_dir.iterdir())
    if entries and not any((run_dir / mark).exists() for mark in RUN_MARKS):
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise UserError(
            f"{run_dir} holds files but is not a run directory (no {', '.join(RUN_MARKS[:3])}): "
            f"{shown}; a run writes its config and files there, so it stops. Pick another "
            f"run.name (or run.dir), or empty that folder"
        )
    for name, what in RUN_DIR_FOLDERS.items():
        _check_kind(run_dir / name, "a folder", what)
    for name, what in RUN_DIR_FILES.items():
        _check_kind(run_dir / name, "a regular file", what)


def check_metrics_file(path: Path) -> None:
    """RUN_DIR/metrics.jsonl is missing or a regular file: a folder cannot be appended to, and
    opening a named pipe blocks until something reads it."""
    _check_kind(path, "a regular file", RUN_DIR_FILES[METRICS_FILE])


def _check_kind(path: Path, kind: str, what: str) -> None:
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_dir() if kind == "a folder" else (path.is_file() and not path.is_symlink()):
        return
    found = describe_kind(path)
    if path.is_symlink():
        target = describe_kind(path.resolve())
        found = f"a symlink to {'nothing' if target == 'missing' else target}"
    raise UserError(
        f"{path} is {found}, but the run keeps {what} there, as {kind}; move it away (or pick "
        f"another run.name) and launch again"
    )


def check_vocab(cfg: Config, manifest: dict[str, Any]) -> None:
    """The model embeds every id of data.dir's tokenizer: exactly the pieces of the one prepare
    trained; at least the ids of a model's own (data.tokenizer), whose rows HF models pad."""
    check_document_end(cfg, manifest)
    tok_vocab = manifest["tokenizer"]["vocab_size"]
    if manifest["tokenizer"]["file"] == BUNDLE_FILE:
        where = f"the tokenizer of data.dir={cfg.data.dir}"
        if isinstance(manifest["tokenizer"].get("from"), str):
            where += f" (prepared with data.tokenizer={manifest['tokenizer']['from']})"
        problem = vocab_problem(where, tok_vocab, cfg.model.vocab_size, cfg.model.init_from)
        if problem:
            raise UserError(problem)
        return
    if tok_vocab != cfg.model.vocab_size:
        raise UserError(
            f"model.vocab_size={cfg.model.vocab_size} does not match the tokenizer in "
            f"data.dir={cfg.data.dir} ({tok_vocab} pieces); set model.vocab_size={tok_vocab}, or "
            f"re-run `scale-llm prepare` with the vocab size you want"
        )


def check_document_end(cfg: Config, manifest: dict[str, Any]) -> None:
    """model.attention_mask=document splits sequences at model.document_end_id: it must be the
    id that ends each document in the shards."""
    eos = manifest["tokenizer"].get("eos_id")
    if cfg.model.attention_mask == "document" and cfg.model.document_end_id != eos:
        raise UserError(
            f"model.attention_mask=document ends documents at model.document_end_id="
            f"{cfg.model.document_end_id}, but the tokenizer of data.dir={cfg.data.dir} ends "
            f"them with id {eos}; set model.document_end_id={eos}"
        )


def check_windows(cfg: Config, plan: RunPlan, train: Sized, val: Sized) -> None:
    """The data can feed this run: windows of seq_len in both splits, and more training
    windows than one optimizer step reads."""
    if len(train) == 0 or len(val) == 0:
        raise UserError(
            f"data.dir={cfg.data.dir} has too few tokens for model.seq_len={cfg.model.seq_len} "
            f"(train windows: {len(train)}, val windows: {len(val)}); use a larger corpus or a "
            f"shorter seq_len"
        )
    per_step = plan.sequences_per_step
    if per_step > len(train):
        raise UserError(
            f"one optimizer step reads {per_step:,} sequences (train.micro_batch_size "
            f"{plan.micro_batch_size} x train.grad_accum {plan.grad_accum} x {plan.dp_degree} "
            f"rank(s)) but data.dir={cfg.data.dir} holds {len(train):,} training windows of "
            f"model.seq_len {cfg.model.seq_len}: every step would repeat the data; lower "
            f"train.grad_accum or train.micro_batch_size, or prepare more data"
        )


def out_of_memory(error: Exception, cfg: Config, plan: RunPlan, step: int) -> str:
    """The one paragraph a device's out-of-memory error in step `step + 1` becomes: what ran
    out, what the estimate says of these settings, and the ways to fit."""
    import torch

    from scale_llm.analysis.memory import estimate

    est, gib = estimate(cfg, plan), 2**30
    what = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
    size, capacity = "SIZE", ""
    if plan.device.type == "cuda":
        total = torch.cuda.get_device_properties(plan.device).total_memory
        size, capacity = f"{total / gib:.0f}GiB", f" of its {total / gib:.1f} GiB"
    config = cfg.run_dir / "config.yaml"
    return (
        f"rank {plan.rank} ran out of {plan.device.type.upper()} memory{capacity} in step "
        f"{step + 1} ({what}). The estimate for these settings is {est.gpu['total'] / gib:,.1f} "
        f"GiB per device (micro-batch {plan.micro_batch_size} x seq_len {cfg.model.seq_len}, "
        f"activation_checkpointing.mode={cfg.activation_checkpointing.mode}, backend "
        f"{plan.backend}, {plan.world_size} process(es)); `scale-llm estimate {config} --fit "
        f"{size}` prints settings that fit, as --set overrides, and `train --fit auto` applies "
        f"them at launch. By hand: a smaller train.micro_batch_size (with train.grad_accum "
        f"raised to keep the batch), activation_checkpointing.mode=full, or "
        f"parallel.backend=fsdp to shard the model over more GPUs."
    )
