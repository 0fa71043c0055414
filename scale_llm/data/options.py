"""The `data:` config section and its checks (a schema module: see parallel/options.py)."""

from __future__ import annotations

from dataclasses import dataclass

from scale_llm.schema import config_key


@dataclass
class DataConfig:
    source: str = config_key(
        "builtin",
        "`builtin` (this interpreter's standard library .py files); `hf:NAME` (a Hugging "
        "Face dataset from the Hub) or `hf:PATH` (a local dataset folder); or a file, a "
        "directory, or a glob of `.txt`/`.md`/`.py` (one document per file), `.jsonl` "
        "(one per line) and `.parquet` (one per row)",
        run_defining=True,
    )
    dir: str = config_key("data/builtin", "where the tokenizer, shards and manifest live")
    tokenizer: str | None = config_key(
        None,
        "a folder holding a Hugging Face model's tokenizer (`tokenizer.json` and/or "
        "`tokenizer.model`), e.g. the one `model.init_from` names or an export: prepare "
        "encodes with it, as transformers' AutoTokenizer does, then EOS after each document, "
        "instead of training a SentencePiece tokenizer of `model.vocab_size` pieces; the "
        "model needs `model.vocab_size` >= its ids. null: train one",
    )
    text_field: str = config_key(
        "text", "field of `.jsonl` / `.parquet` / `hf:` records holding the text"
    )
    hf_config: str | None = config_key(
        None, "`hf:` only: the dataset's configuration (subset), e.g. `sample-10BT`"
    )
    hf_split: str = config_key("train", "`hf:` only: the split to read")
    hf_revision: str | None = config_key(
        None, "`hf:` only: a branch, tag or commit to pin; pin a commit for a reproducible corpus"
    )
    streaming: bool = config_key(
        False,
        "`hf:` only: read the dataset as a stream (nothing stored but the shards) instead "
        "of downloading it whole into the Hugging Face cache",
    )
    max_documents: int | None = config_key(
        None, "read at most this many documents (the first ones, in source order); null: all"
    )
    max_tokens: int | None = config_key(
        None, "stop after the document that brings train + val to this many tokens; null: all"
    )
    val_fraction: float = config_key(
        0.02, "share of documents held out for validation (split by a hash of each document's id)"
    )
    tokenizer_sample_bytes: int = config_key(
        8_000_000, "characters of train documents used to train the tokenizer"
    )
    tokenizer_sample_documents: int | None = config_key(
        None, "and at most this many documents; null: no document limit"
    )
    shard_tokens: int = config_key(50_000_000, "tokens per shard file")
    num_proc: int = config_key(
        0,
        "tokenizer processes in prepare; 0: one per CPU core; 1: no worker processes. "
        "Does not change the output",
    )
    prefetch: int = config_key(
        2,
        "training batches a background thread reads ahead (pinned memory on CUDA); 0: "
        "read in the training loop. Does not change the batches",
    )


def validate_data(d: DataConfig) -> list[str]:
    e: list[str] = []
    for key in ("tokenizer_sample_bytes", "shard_tokens"):
        if getattr(d, key) <= 0:
            e.append(f"data.{key}={getattr(d, key)} must be > 0")
    for key in ("max_documents", "max_tokens", "tokenizer_sample_documents"):
        value = getattr(d, key)
        if value is not None and value <= 0:
            e.append(f"data.{key}={value} must be > 0")
    for key in ("num_proc", "prefetch"):
        if getattr(d, key) < 0:
            e.append(f"data.{key}={getattr(d, key)} must be >= 0")
    if d.tokenizer is not None and not d.tokenizer.strip():
        e.append("data.tokenizer is empty; give a Hugging Face tokenizer folder, or null")
    if not 0.0 < d.val_fraction < 1.0:
        e.append(
            f"data.val_fraction={d.val_fraction} must be between 0 and 1 (e.g. "
            f"data.val_fraction=0.01)"
        )
    return e
