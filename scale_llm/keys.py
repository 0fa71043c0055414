"""What every config key means: the one source of `scale-llm config --keys` and of the key
tables in docs/config.md (generated: `scale-llm config --keys --markdown`; a test fails when the
file is stale). Types and defaults come from the dataclasses; only the meanings live here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from scale_llm.config import Config, all_keys

KEY_HELP: dict[str, str] = {
    "run.name": (
        "name of the run; the run directory is `<run.dir>/<run.name>`; a plain name (no "
        "separators, not `.`/`..`, no leading `-`). The no-config default is `defaults` "
        "(yaml/tiny.yaml's run is `tiny`)"
    ),
    "run.dir": "parent directory of run directories",
    "run.seed": "seeds weight init and the data order; part of a run's identity",
    "logging.every": (
        "optimizer steps between metric rows (metrics.jsonl, TensorBoard, console); each "
        "launch's first step and the run's last are logged too"
    ),
    "logging.tensorboard": "also write TensorBoard event files to `RUN_DIR/tensorboard`",
    "logging.peak_tflops": (
        "dense peak TFLOP/s per device, for MFU on devices the built-in table does not "
        "know (it knows H100 SXM / PCIe / NVL, H200 SXM / NVL, A100, L40S, L40, L4, RTX 4090, "
        "RTX A6000, MI300X); on a CPU MFU is reported only with this set"
    ),
    "logging.wandb.project": (
        "Weights & Biases project to log to (the same scalars, samples and the config; needs "
        "`pip install wandb`); null: no W&B. A resumed run logs to the same W&B run (its id is "
        "kept in `RUN_DIR/wandb-id.txt`)"
    ),
    "logging.wandb.name": "the W&B run's display name; null: run.name",
    "logging.wandb.mode": (
        "`online`, `offline` (written under `RUN_DIR/wandb/`, `wandb sync` uploads it later) "
        "or `disabled`"
    ),
    "model.vocab_size": (
        "tokenizer size; `prepare` trains a tokenizer of exactly this size and `train` "
        "refuses data whose tokenizer differs"
    ),
    "model.d_model": "residual width",
    "model.n_layers": "transformer blocks",
    "model.n_heads": "attention heads; must divide d_model, head size must be even (rotary)",
    "model.n_kv_heads": "key/value heads for grouped-query attention; null = n_heads",
    "model.seq_len": "context length in tokens",
    "model.mlp_hidden": "SwiGLU hidden width; null = 8/3 d_model rounded up to a multiple of 128",
    "model.tie_embeddings": "output head reuses the token embedding matrix",
    "model.attention": (
        "`sdpa` (`scaled_dot_product_attention`, fused kernels) or `eager` (materializes "
        "the (B, n_heads, T, T) score matrix; for teaching and memory comparisons)"
    ),
    "model.norm_eps": "RMSNorm epsilon",
    "model.rope_theta": "rotary base",
    "model.init_std": "init std; residual output projections use init_std / sqrt(2 n_layers)",
    "model.init_from": (
        "a local Hugging Face Llama folder (or a `scale-llm export`) whose weights start "
        "a fresh run (continued pretraining); not used when resuming; see "
        "[ecosystem.md](ecosystem.md)"
    ),
    "data.source": (
        "`builtin` (this interpreter's standard library .py files); `hf:NAME` (a Hugging "
        "Face dataset from the Hub) or `hf:PATH` (a local dataset folder); or a file, a "
        "directory, or a glob of `.txt`/`.md`/`.py` (one document per file), `.jsonl` "
        "(one per line) and `.parquet` (one per row)"
    ),
    "data.dir": "where the tokenizer, shards and manifest live",
    "data.text_field": "field of `.jsonl` / `.parquet` / `hf:` records holding the text",
    "data.hf_config": "`hf:` only: the dataset's configuration (subset), e.g. `sample-10BT`",
    "data.hf_split": "`hf:` only: the split to read",
    "data.hf_revision": (
        "`hf:` only: a branch, tag or commit to pin; pin a commit for a reproducible corpus"
    ),
    "data.streaming": (
        "`hf:` only: read the dataset as a stream (nothing stored but the shards) instead "
        "of downloading it whole into the Hugging Face cache"
    ),
    "data.max_documents": (
        "read at most this many documents (the first ones, in source order); null: all"
    ),
    "data.max_tokens": (
        "stop after the document that brings train + val to this many tokens; null: all"
    ),
    "data.val_fraction": (
        "share of documents held out for validation (split by a hash of each document's id)"
    ),
    "data.tokenizer_sample_bytes": "characters of train documents used to train the tokenizer",
    "data.tokenizer_sample_documents": "and at most this many documents; null: no document limit",
    "data.shard_tokens": "tokens per shard file",
    "data.num_proc": (
        "tokenizer processes in prepare; 0: one per CPU core; 1: no worker processes. "
        "Does not change the output"
    ),
    "data.prefetch": (
        "training batches a background thread reads ahead (pinned memory on CUDA); 0: "
        "read in the training loop. Does not change the batches"
    ),
    "train.micro_batch_size": "sequences per forward/backward on each rank",
    "train.grad_accum": "micro-batches per optimizer step; each micro-loss is divided by it",
    "train.global_batch_size": (
        "sequences per step over all ranks; when set, grad_accum = global_batch_size / "
        "(micro_batch_size x world size), and a world size that does not divide it is an "
        "error"
    ),
    "train.max_steps": "optimizer steps",
    "train.max_bad_steps": "stop (exit 3) after this many consecutive skipped (non-finite) steps",
    "train.gc_every": (
        "Python's garbage collector runs only at the end of every gc_every-th step, on every "
        "rank at the same step (a collection pausing one rank mid-step would stall the others at "
        "their next collective), plus a full collection before each checkpoint; what exists when "
        "training starts is frozen out of its scans. 0: Python's automatic collection"
    ),
    "train.exit_at_step": (
        "save a checkpoint and exit after this step (for time-limited jobs); the LR "
        "schedule still runs to max_steps and the next launch resumes"
    ),
    "train.lr": "peak learning rate",
    "train.min_lr": "learning rate at the end of the decay",
    "train.warmup_steps": "linear warmup steps",
    "train.lr_schedule": (
        "after warmup: `cosine`, `linear` (both to min_lr at max_steps), `wsd` (hold lr, "
        "decay linearly over the last decay_fraction; extends without a jump), `constant`"
    ),
    "train.decay_fraction": "`wsd`: share of max_steps spent decaying to min_lr",
    "train.weight_decay": "AdamW decay on matrices (not on norms, biases, embeddings)",
    "train.grad_clip": "max global gradient norm per step; 0 disables clipping",
    "train.precision": (
        "`auto` (bf16 on a bf16-capable GPU, fp32 on CPU), `bf16` (autocast, no scaler), "
        "`fp16` (autocast + GradScaler), `fp32`"
    ),
    "train.beta1": "AdamW beta1",
    "train.beta2": "AdamW beta2",
    "train.eps": "AdamW epsilon",
    "train.device": "`auto` (CUDA if visible), `cpu`, `cuda`",
    "train.compile": (
        "`torch.compile` each transformer block (`fullgraph=True`, after activation "
        "checkpointing, before DDP / FSDP / DeepSpeed wrap) and the loss. `auto`: on a GPU "
        "(the toolchain is checked at start-up, by compiling one small function; without a "
        "C++/C compiler, Triton or Python's headers the run goes eager with one warning), "
        "never on the CPU; `true`: always, and a missing toolchain stops the launch naming "
        "what to install; `false`: never. Under DeepSpeed ZeRO-3 the blocks stay eager (its "
        "parameter-gathering hooks sit inside each block), with one warning; the loss is still "
        "compiled. See [training.md](training.md)"
    ),
    "eval.every": "optimizer steps between evaluations (and at the last step); 0 disables",
    "eval.steps": (
        "validation batches per evaluation, each the size of a training step's global "
        "batch; the same windows each time, whatever the micro-batch, accumulation or "
        "world size"
    ),
    "eval.sample_every": (
        "optimizer steps between sample generations (and at the last step): a greedy "
        "continuation of eval.sample_prompt in TensorBoard's text tab, metrics.jsonl and the "
        "console; 0: none"
    ),
    "eval.sample_prompt": "prompt of the samples (after BOS); empty: a document's start",
    "eval.sample_tokens": "tokens generated per sample",
    "checkpoint.every": (
        "optimizer steps between checkpoints; the last step is always saved; 0 = only the last"
    ),
    "checkpoint.keep_last": "complete checkpoints kept; older ones are deleted",
    "checkpoint.resume": (
        "`auto`: continue from the newest complete checkpoint in the run dir, if any; "
        "`never`: start fresh (refused if the run dir already has checkpoints); or a "
        "checkpoint directory"
    ),
    "parallel.backend": (
        "`auto` (`single` when run as one process, `ddp` when a launcher starts several; "
        "the resolved name is in the run dir's `plan.json`), `single` (one process, no "
        "process group), `ddp`, `fsdp` (FSDP2) or `deepspeed`; see "
        "[backends.md](backends.md)"
    ),
    "parallel.ddp.bucket_cap_mb": "DDP gradient bucket size",
    "parallel.ddp.gradient_as_bucket_view": "gradients alias DDP's buckets (one copy less)",
    "parallel.ddp.static_graph": "DDP static-graph optimizations",
    "parallel.fsdp.reshard_after_forward": (
        "true: free gathered params after forward (ZeRO-3-like); false: keep them until "
        "backward (ZeRO-2-like)"
    ),
    "parallel.fsdp.cpu_offload": "params, grads and optimizer state in CPU memory (needs a GPU)",
    "parallel.fsdp.replicate_degree": (
        "HSDP: shard within groups, replicate across this many groups (usually the node "
        "count); must divide the world size"
    ),
    "parallel.fsdp.reduce_every_micro_step": (
        "with grad_accum > 1: true reduce-scatters every micro-step's gradients into the "
        "shards; false accumulates them unsharded in fp32 (4 B/param more per GPU) and "
        "reduces once per step (less traffic)"
    ),
    "parallel.deepspeed.zero_stage": "ZeRO stage 0-3",
    "parallel.deepspeed.offload_optimizer": (
        "`cpu`: optimizer state and step on the CPU (ZeRO >= 1)"
    ),
    "parallel.deepspeed.offload_param": "`cpu`: parameters in CPU memory (ZeRO-3 only)",
    "parallel.deepspeed.config": (
        "raw ds_config entries merged over the generated ones (keys the framework owns are refused)"
    ),
    "activation_checkpointing.mode": (
        "`none`, `full` (every block recomputes its forward in backward), `every_k` "
        "(blocks 0, k, 2k, ...), `selective` (keep matmul and attention outputs, "
        "recompute element-wise ops); numerics identical in all modes; see "
        "[memory.md](memory.md)"
    ),
    "activation_checkpointing.k": "k for `every_k`",
}

# a line under a section's heading in docs/config.md
SECTION_NOTES = {
    "data": "See [data.md](data.md) for what prepare does with these and what resume guarantees.",
    "parallel": "See [backends.md](backends.md) for what each backend does with these.",
}
BEGIN = "<!-- keys: generated by `scale-llm config --keys --markdown`; do not edit by hand -->"
END = "<!-- end of generated keys -->"


def _field(key: str) -> tuple[dataclasses.Field, Any]:
    """The dataclass field of `key` and its resolved type."""
    cls: Any = Config
    *sections, name = key.split(".")
    for section in sections:
        cls = typing.get_type_hints(cls)[section]
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field, typing.get_type_hints(cls)[name]


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if value == "":
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _type(hint: Any) -> str:
    """int, float | null, a | b | c (a Literal's choices), ... with markdown's | escaped."""
    parts = (
        typing.get_args(hint)
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else (hint,)
    )
    names = []
    for part in parts:
        if typing.get_origin(part) is typing.Literal:
            names += [
                str(c).lower() if isinstance(c, bool) else str(c) for c in typing.get_args(part)
            ]
        elif part is type(None):
            names.append("null")
        else:
            names.append(getattr(part, "__name__", str(part)))
    return " \\| ".join(names)


def key_rows() -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every config key, in the dataclasses' order."""
    rows = []
    for key in all_keys(Config):
        f, hint = _field(key)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((key, _type(hint), _yaml(default), KEY_HELP[key]))
    return rows


def markdown_keys() -> str:
    """The "## Keys" section of docs/config.md, between its BEGIN and END markers."""
    out, section = [BEGIN, "## Keys"], None
    for key, type_, default, meaning in key_rows():
        if key.split(".")[0] != section:
            section = key.split(".")[0]
            out += ["", f"### {section}"]
            if section in SECTION_NOTES:
                out += [SECTION_NOTES[section], ""]
            out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        out.append(f"| `{key}` | {type_} | `{default}` | {meaning} |")
    return "\n".join([*out, "", END])


def text_keys() -> str:
    """`scale-llm config --keys`: one block per key, for a terminal."""
    lines = []
    for key, type_, default, meaning in key_rows():
        lines.append(f"{key}  ({type_.replace(chr(92), '')}, default {default})")
        lines.append(f"    {meaning}")
    return "\n".join(lines)
