"""`scale-llm prepare`: corpus -> SentencePiece tokenizer -> token shards + manifest.

Steps: list the source's documents in a fixed order; split them into train / val by a stable hash
of each document's name; train the tokenizer on a sample of the train documents; encode every
document as [BOS] ids [EOS] into fixed-size shards; write manifest.json last. A second run on
unchanged input and settings finds the manifest's fingerprint equal and does no work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scale_llm.config import Config
from scale_llm.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    ShardWriter,
    shard_problems,
    token_dtype,
    write_manifest,
)
from scale_llm.data.sources import Document, Source, open_source
from scale_llm.data.tokenizer import Tokenizer, file_sha256, train_tokenizer
from scale_llm.errors import UserError

log = logging.getLogger(__name__)
TOKENIZER_FILE = "tokenizer.model"
_ENCODE_BATCH = 256  # documents per batched encode call


def is_val_document(doc_id: str, val_fraction: float) -> bool:
    """Stable split: the same document lands in the same split whatever else the corpus holds."""
    digest = hashlib.blake2b(doc_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


def prepare(cfg: Config, force: bool = False) -> dict[str, Any]:
    """Prepare `cfg.data.dir` from `cfg.data.source`; returns the manifest."""
    out = Path(cfg.data.dir)
    source = open_source(cfg.data.source, cfg.data.text_field)
    fingerprint = _fingerprint(cfg, source)
    current = _current_manifest(out)
    if (
        not force
        and current
        and current.get("fingerprint") == fingerprint
        and not shard_problems(out, current)
    ):
        log.info(
            "data: %s is up to date (%s train tokens); nothing to do",
            out,
            f"{current['splits']['train']['tokens']:,}",
        )
        return current

    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # from here on the directory reads as unprepared
    for stale in [*out.glob("train_*.bin"), *out.glob("val_*.bin")]:
        stale.unlink()
    t0 = time.perf_counter()
    log.info(
        "data: reading %s (%d files, %.1f MB)",
        source.spec,
        len(source.files),
        source.total_bytes() / 1e6,
    )
    docs = list(source.documents())
    if not docs:
        raise_empty(cfg)
    val = [d for d in docs if is_val_document(d.doc_id, cfg.data.val_fraction)]
    train = [d for d in docs if not is_val_document(d.doc_id, cfg.data.val_fraction)]
    if not val:  # tiny corpora: hold out the last document so eval has something to read
        val, train = train[-1:], train[:-1]
    if not train:
        raise_empty(cfg)
    if source.skipped:
        log.info(
            "data: skipped %d files that are not UTF-8 (e.g. %s)",
            len(source.skipped),
            source.skipped[0],
        )

    tokenizer = train_tokenizer(
        _sample(train, cfg.data.tokenizer_sample_bytes), cfg.model.vocab_size, out / TOKENIZER_FILE
    )
    log.info(
        "data: trained a %d-piece BPE tokenizer on %.1f MB in %.1fs",
        tokenizer.vocab_size,
        min(cfg.data.tokenizer_sample_bytes, sum(len(d.text) for d in train)) / 1e6,
        time.perf_counter() - t0,
    )
    dtype = token_dtype(tokenizer.vocab_size)
    splits = {
        name: _write_split(out, name, part, tokenizer, cfg.data.shard_tokens, dtype)
        for name, part in (("train", train), ("val", val))
    }
    manifest = {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "source": source.spec,
        "python": sys.version.split()[0],
        "dtype": dtype.name,
        "tokenizer": {
            "file": TOKENIZER_FILE,
            "sha256": file_sha256(out / TOKENIZER_FILE),
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
        },
        "splits": splits,
    }
    write_manifest(out, manifest)
    seconds = time.perf_counter() - t0
    total = sum(s["tokens"] for s in splits.values())
    log.info(
        "data: wrote %s train / %s val tokens (%d / %d documents) to %s in %.1fs (%.0fk tokens/s)",
        f"{splits['train']['tokens']:,}",
        f"{splits['val']['tokens']:,}",
        splits["train"]["documents"],
        splits["val"]["documents"],
        out,
        seconds,
        total / seconds / 1e3,
    )
    return manifest


def raise_empty(cfg: Config) -> None:
    raise UserError(
        f"data.source={cfg.data.source!r} yielded too few non-empty documents; "
        f"check the files and data.text_field={cfg.data.text_field!r}"
    )


def _fingerprint(cfg: Config, source: Source) -> str:
    settings = {
        "format": FORMAT_VERSION,
        "source": source.fingerprint(),
        "vocab_size": cfg.model.vocab_size,
        "val_fraction": cfg.data.val_fraction,
        "tokenizer_sample_bytes": cfg.data.tokenizer_sample_bytes,
        "shard_tokens": cfg.data.shard_tokens,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _current_manifest(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _sample(docs: list[Document], budget: int) -> Iterator[str]:
    """Documents in a fixed pseudo-random order until `budget` characters are taken."""
    order = sorted(
        docs,
        key=lambda d: hashlib.blake2b(
            d.doc_id.encode(), digest_size=8, person=b"tok-sample"
        ).digest(),
    )
    taken = 0
    for d in order:
        if taken >= budget:
            return
        text = d.text[: budget - taken]
        taken += len(text)
        yield text


def _write_split(
    out: Path, name: str, docs: list[Document], tokenizer: Tokenizer, shard_tokens: int, dtype
) -> dict[str, Any]:
    writer = ShardWriter(out, name, shard_tokens, dtype)
    for i in range(0, len(docs), _ENCODE_BATCH):
        batch = [d.text for d in docs[i : i + _ENCODE_BATCH]]
        for ids in tokenizer.encode_documents(batch):
            writer.add(ids)
    return writer.close()
