"""The `data:` config section and its checks (a schema module of scale_llm.config)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from scale_llm.config.schema import bound_problems, config_key

SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # a folder name and a metric tag


@dataclass
class SourceConfig:
    """One entry of `data.sources`: `data.source`'s reading keys, plus a name and a weight."""

    name: str = config_key("", "the source's name: its folder in data.dir and its metric tags")
    weight: float = config_key(1.0, "its share of the training tokens (weights are normalized)")
    source: str = config_key("builtin", "as `data.source`")
    text_field: str = config_key("text", "as `data.text_field`")
    hf_config: str | None = config_key(None, "as `data.hf_config`")
    hf_split: str = config_key("train", "as `data.hf_split`")
    hf_revision: str | None = config_key(None, "as `data.hf_revision`")
    streaming: bool = config_key(False, "as `data.streaming`")
    max_documents: int | None = config_key(None, "as `data.max_documents`, for this source")
    max_tokens: int | None = config_key(None, "as `data.max_tokens`, for this source")


# the keys of `data` that describe the one source of `data.source` (data.sources' entries own)
PER_SOURCE_KEYS = tuple(f.name for f in fields(SourceConfig) if f.name not in ("name", "weight"))


@dataclass
class DataConfig:
    source: str = config_key(
        "builtin",
        "`builtin` (this interpreter's standard library .py files); `hf:NAME` (a Hugging "
        "Face dataset from the Hub) or `hf:PATH` (a local dataset folder); or a file, a "
        "directory, or a glob of `.txt`/`.md`/`.py` (one document per file), `.jsonl` "
        "(one per line) and `.parquet` (one per row). A mixture (data.sources) leaves it "
        "unset (`data.source: null` where a `base:` file sets it)",
        run_defining=True,
        null_unsets=True,
    )
    sources: list[SourceConfig] = config_key(
        [],
        "a weighted mixture of sources, in place of `data.source`: a list of entries "
        "`{name, weight, source, ...}`, each taking `source`, `text_field`, `hf_config`, "
        "`hf_split`, `hf_revision`, `streaming`, `max_documents` and `max_tokens` as the "
        "`data.` keys of those names do; `weight`: its share of the training tokens "
        "(normalized); `name`: letters, digits, `_`, `-`, unique. One entry's key from the "
        "command line: `--set 'data.sources[0].weight=3'`. See data.md",
        run_defining=True,
        null_unsets=True,
    )
    repeat: bool = config_key(
        True,
        "a source whose training windows run out is read again in a new order (with a "
        "warning); false: a run that would need that is an error before it starts",
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
        "text", "field of `.jsonl` / `.parquet` / `hf:` records holding the text", null_unsets=True
    )
    hf_config: str | None = config_key(
        None, "`hf:` only: the dataset's configuration (subset), e.g. `sample-10BT`"
    )
    hf_split: str = config_key("train", "`hf:` only: the split to read", null_unsets=True)
    hf_revision: str | None = config_key(
        None, "`hf:` only: a branch, tag or commit to pin; pin a commit for a reproducible corpus"
    )
    streaming: bool = config_key(
        False,
        "`hf:` only: read the dataset as a stream (nothing stored but the shards) instead "
        "of downloading it whole into the Hugging Face cache",
        null_unsets=True,
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
    e = bound_problems(d, "tokenizer_sample_bytes shard_tokens max_documents", prefix="data.")
    e += bound_problems(d, "max_tokens tokenizer_sample_documents", prefix="data.")  # (None: none)
    e += bound_problems(d, "num_proc prefetch", ">= 0", "data.")
    if not d.sources and not (d.source or "").strip():  # (the working folder's files, read)
        e.append("data.source is empty; give builtin, hf:NAME, or files")
    if d.tokenizer is not None and not d.tokenizer.strip():
        e.append("data.tokenizer is empty; give a Hugging Face tokenizer folder, or null")
    if not 0.0 < d.val_fraction < 1.0:
        e.append(
            f"data.val_fraction={d.val_fraction} must be between 0 and 1 (e.g. "
            f"data.val_fraction=0.01)"
        )
    return e + (_sources_problems(d) if d.sources else [])


def _sources_problems(d: DataConfig) -> list[str]:
    """A mixture's entries: names, weights, caps, and no one-source key set beside them."""
    e, defaults = [], DataConfig()
    for key in PER_SOURCE_KEYS:
        if getattr(d, key) != getattr(defaults, key):
            e.append(
                f"data.{key}={getattr(d, key)!r} describes the one source of data.source, but "
                f"data.sources is set: give it per entry (data.sources[i].{key}) and remove "
                f"data.{key} (where a base: file sets it, unset it: data.{key}: null)"
            )
    seen: set[str] = set()
    for i, s in enumerate(d.sources):
        at = f"data.sources[{i}]"
        if not SOURCE_NAME.fullmatch(s.name):
            e.append(
                f"{at}.name={s.name!r} must be 1-64 letters, digits, '_' or '-' (it names a "
                f"folder and metric tags), e.g. name: web"
            )
        elif s.name.lower() in seen:
            e.append(f"{at}.name={s.name!r} is used twice (names are unique, in any case)")
        seen.add(s.name.lower())
        e += bound_problems(s, "weight", "> 0 (drop the entry to leave it out)", f"{at}.")
        if not s.source.strip():
            e.append(f"{at}.source is empty; give builtin, hf:NAME, or files")
        e += bound_problems(s, "max_documents max_tokens", prefix=f"{at}.")
    return e


HF_ONLY_KEYS = ("hf_config", "hf_split", "hf_revision", "streaming")


def unread_hf_keys(d: DataConfig) -> list[str]:
    """`hf:`-only keys set away from their defaults for a source that is not `hf:` (a base
    file's Hub source replaced by local files): prepare reads none of them, so it says so."""
    said = []
    entries = [(f"data.sources[{i}].", s) for i, s in enumerate(d.sources)] or [("data.", d)]
    for at, s in entries:
        if (s.source or "").startswith("hf:"):
            continue
        unread = [
            f"{at}{k}={str(v).lower() if isinstance(v, bool) else repr(v)}"
            for k in HF_ONLY_KEYS
            if (v := getattr(s, k)) != getattr(SourceConfig, k)
        ]
        if unread:
            are, them = ("are", "them") if len(unread) > 1 else ("is", "it")
            how = f"remove {them} from the entry" if d.sources else f"unset {them} with null"
            said.append(
                f"{', '.join(unread)} {are} not read: {at}source={s.source!r} is not an hf: "
                f"dataset ({how} to silence this)"
            )
    return said


def normalized_weights(weights: list[float]) -> list[float]:
    """Positive finite weights as shares that sum to 1. Weights whose sum overflows (1e308,
    1e308) are first divided by the largest; others take the plain division, which keeps the
    shares (and the streams) runs were read with."""
    total = sum(weights)
    if not math.isfinite(total):
        top = max(weights)
        weights = [w / top for w in weights]
        total = sum(weights)
    return [w / total for w in weights]


def mixture_weights(d: DataConfig) -> dict[str, float]:
    """{name: normalized weight} of data.sources (a one-source config: {} )."""
    return dict(zip([s.name for s in d.sources], normalized_weights([s.weight for s in d.sources])))
