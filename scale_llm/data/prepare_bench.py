"""`scale-llm prepare --bench`: tokens/s of prepare's pipeline (in this process, and in
`data.num_proc` workers, start-up included) vs a plain `sp.encode` loop, on the first `megabytes`
of the source in memory, with data.dir's tokenizer or one trained first (not timed)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from scale_llm.config import Config
from scale_llm.data.documents import Document
from scale_llm.data.encode import Encoder, batched, cpu_count
from scale_llm.data.prepare_source import TOKENIZER_FILE
from scale_llm.data.shards import token_dtype
from scale_llm.data.sources import open_source
from scale_llm.data.tokenizer import Tokenizer, train_tokenizer
from scale_llm.errors import UserError


def bench_prepare(cfg: Config, megabytes: float) -> dict[str, Any]:
    """Timings of the three ways to encode the same text (a mixture: its first source)."""
    if cfg.data.sources:
        from scale_llm.data.mixture import source_config

        cfg = source_config(cfg, cfg.data.sources[0])
    if cfg.data.tokenizer:
        raise UserError(
            f"prepare --bench times SentencePiece encoding (prepare's own tokenizer); "
            f"data.tokenizer={cfg.data.tokenizer} names a model's tokenizer, which it does not "
            f"time: run it without data.tokenizer (--set data.tokenizer=null) to time the "
            f"pipeline, or time `scale-llm prepare` itself on a copy of data.dir"
        )
    source = open_source(cfg.data)
    if not (docs := _read(source, int(megabytes * 1e6))):
        raise UserError(f"data.source={cfg.data.source!r} yielded no documents to benchmark")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(cfg.data.dir) / TOKENIZER_FILE
        label = str(model)
        if not model.is_file():
            model, label = Path(tmp) / TOKENIZER_FILE, "trained on the bench text"
            train_tokenizer((d.text for d in docs), cfg.model.vocab_size, model)
        vocab_size = Tokenizer(model).vocab_size  # (data.dir's: a damaged one is named)
        rows = [_plain_loop(docs, model)]
        for num_proc in sorted({1, cfg.data.num_proc or cpu_count()}):
            rows.append(_pipeline(docs, model, cfg.data.val_fraction, num_proc))
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return {
        "source": source.spec,
        "documents": len(docs),
        "megabytes": sum(len(d.text) for d in docs) / 1e6,
        "tokenizer": label,
        "vocab_size": vocab_size,
        "cpus": cpu_count(),
        "rows": rows,
    }


def format_report(report: dict[str, Any]) -> str:
    head = (
        f"prepare benchmark: {report['megabytes']:.1f} MB, {report['documents']:,} documents "
        f"of {report['source']}; tokenizer {report['tokenizer']} ({report['vocab_size']} "
        f"pieces); {report['cpus']} CPUs"
    )
    lines = [head, f"{'method':<44}{'procs':>6}{'seconds':>9}{'tokens/s':>12}{'speedup':>9}"]
    for r in report["rows"]:
        lines.append(
            f"{r['method']:<44}{r['processes']:>6}{r['seconds']:>9.2f}"
            f"{r['tokens_per_s'] / 1e6:>11.2f}M{r['speedup']:>8.2f}x"
        )
    return "\n".join(lines)


def _read(source, max_chars: int) -> list[Document]:
    docs, chars = [], 0
    for doc in source.documents():
        docs.append(doc)
        chars += len(doc.text)
        if chars >= max_chars:
            break
    return docs


def _plain_loop(docs: list[Document], model: Path) -> dict[str, Any]:
    sp = spm.SentencePieceProcessor(model_file=str(model))
    dtype, bos, eos = token_dtype(sp.get_piece_size()), sp.bos_id(), sp.eos_id()
    t0, tokens = time.perf_counter(), 0
    for doc in docs:
        tokens += np.asarray([bos, *sp.encode(doc.text), eos], dtype=dtype).size
    return _row("plain loop: sp.encode per document", 1, time.perf_counter() - t0, tokens)


def _pipeline(docs: list[Document], model: Path, val_fraction: float, num_proc: int) -> dict:
    t0 = time.perf_counter()
    with Encoder(model, val_fraction, num_proc) as encoder:
        tokens = sum(b.tokens.size for b in encoder.map(batched(docs)))
        used = encoder.processes
    where = "in this process" if used == 1 else "worker processes"
    return _row(f"prepare pipeline, {where}", used, time.perf_counter() - t0, tokens)


def _row(method: str, processes: int, seconds: float, tokens: int) -> dict[str, Any]:
    row = dict(method=method, processes=processes, seconds=seconds, tokens=tokens)
    return {**row, "tokens_per_s": tokens / seconds}
