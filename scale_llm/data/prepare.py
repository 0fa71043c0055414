"""`scale-llm prepare`: data.dir from `data.source` (prepare_source.py) or `data.sources` (a
mixture: mixture.py, each source the same way into data.dir/<name> under one tokenizer)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scale_llm.config import Config
from scale_llm.config.data import unread_hf_keys
from scale_llm.data.mixture import MIXTURE, prepare_mixture
from scale_llm.data.prepare_source import Kept, prepare_source, up_to_date
from scale_llm.data.sources import open_source
from scale_llm.data.tokenizer import check_vocab_size
from scale_llm.errors import UserError

log = logging.getLogger(__name__)


def prepare(cfg: Config, force: bool = False, keep: Kept | None = None) -> dict[str, Any]:
    """Prepare data.dir; its record: one source's manifest, or a mixture's mixture.json. With
    `keep`, a rebuild that would replace data.dir's tokenizer is refused before it publishes."""
    check_settings(cfg)
    for unread in unread_hf_keys(cfg.data):
        log.warning("data: %s", unread)
    with sigterm_interrupts():  # (from the start: reading, the tokenizer, the lock's wait)
        if cfg.data.sources:
            return prepare_mixture(cfg, force, keep)
        return prepare_source(cfg, force, keep=keep)


def check_settings(cfg: Config) -> None:
    """What the config alone tells prepare it cannot build (before any work, also the check's)."""
    if (shard := cfg.data.shard_tokens) <= (seq := cfg.model.seq_len):
        raise UserError(
            f"data.shard_tokens={shard} holds no window of model.seq_len + 1 = {seq + 1} tokens "
            f"(a window never crosses shards), so its shards would train nothing; raise "
            f"data.shard_tokens far above model.seq_len"
        )
    if cfg.data.tokenizer is None:  # (a tokenizer of prepare's own is trained)
        check_vocab_size(cfg.model.vocab_size)


def would_replace(cfg: Config) -> bool:
    """Whether `prepare(cfg)` would rebuild data that data.dir holds (prepared from other input
    or settings); False where it holds none, or is up to date. Reads only (a mixture's data.dir
    counts as other data: its sources are not compared)."""
    out = Path(cfg.data.dir)
    if cfg.data.sources or (out / MIXTURE).exists():
        return (out / MIXTURE).exists() or (out / "manifest.json").exists()
    if not (out / "manifest.json").exists():
        return False
    return up_to_date(cfg, open_source(cfg.data)) is None


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a job being stopped) ends prepare like Ctrl-C: what was written is kept."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    taken = []

    def interrupt(signum: int, frame: Any) -> None:  # a second (Slurm's and the launcher's) is
        taken.append(signal.signal(signal.SIGTERM, signal.SIG_IGN))  # taken as the first, to
        raise KeyboardInterrupt  # the end (where prepare says what it kept): no kill

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        if not taken:
            signal.signal(signal.SIGTERM, previous)
