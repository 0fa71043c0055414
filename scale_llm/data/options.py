"""The `data:` config section and its checks (a schema module: see parallel/options.py)."""

from __future__ import annotations

from dataclasses import dataclass

from scale_llm.schema import run_defining


@dataclass
class DataConfig:
    # "builtin", "hf:NAME", or a file / dir / glob (.txt .jsonl .parquet)
    source: str = run_defining("builtin")
    dir: str = "data/builtin"  # where the tokenizer, shards and manifest are written
    text_field: str = "text"  # the field holding the text in .jsonl / .parquet / hf: records
    hf_config: str | None = None  # hf: dataset configuration (subset), e.g. "sample-10BT"
    hf_split: str = "train"  # hf: split to read
    hf_revision: str | None = None  # hf: git revision (branch, tag or commit) to pin
    streaming: bool = False  # hf: read as a stream instead of downloading the whole dataset
    max_documents: int | None = None  # read at most this many documents (null: all)
    max_tokens: int | None = None  # stop once this many tokens are written (null: all)
    val_fraction: float = 0.02  # share of documents held out for validation
    tokenizer_sample_bytes: int = 8_000_000  # characters sampled to train the tokenizer
    tokenizer_sample_documents: int | None = None  # and at most this many documents (null: any)
    shard_tokens: int = 50_000_000  # tokens per shard file
    num_proc: int = 0  # tokenizer processes in prepare; 0: one per CPU core
    prefetch: int = 2  # training batches read ahead in a background thread; 0: none


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
    if not 0.0 < d.val_fraction < 1.0:
        e.append(f"data.val_fraction={d.val_fraction} must be between 0 and 1 (e.g. 0.01)")
    return e
