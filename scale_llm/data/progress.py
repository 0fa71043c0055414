"""Progress of a long data job: a tqdm bar on a terminal, and an INFO line every so often (which
carries the same numbers where stderr is not a terminal)."""

from __future__ import annotations

import logging
import time

from tqdm import tqdm

log = logging.getLogger(__name__)
LOG_EVERY = 30.0  # seconds between INFO lines


class Progress:
    def __init__(self, desc: str, total: int | None = None, initial: int = 0):
        """`initial`: documents done before this run (a resumed job); rates exclude them."""
        self.desc = desc
        self.bar = tqdm(
            total=total, initial=initial, desc=desc, unit="doc", disable=None, dynamic_ncols=True
        )
        self.start = self.last_log = time.perf_counter()
        self.docs = self.tokens = self.chars = 0

    def update(self, docs: int, tokens: int = 0, chars: int = 0) -> None:
        self.docs += docs
        self.tokens += tokens
        self.chars += chars
        self.bar.update(docs)
        now = time.perf_counter()
        self.bar.set_postfix_str(self.rates(now - self.start), refresh=False)
        if now - self.last_log >= LOG_EVERY:
            self.last_log = now
            log.info("data: %s: %s", self.desc, self.summary(now - self.start))

    def rates(self, seconds: float) -> str:
        seconds = max(seconds, 1e-9)
        if self.tokens:
            return f"{self.tokens / seconds / 1e6:.2f}M tok/s"
        return f"{self.chars / seconds / 1e6:.1f} MB/s"

    def summary(self, seconds: float) -> str:
        done = f"{self.tokens:,} tokens" if self.tokens else f"{self.chars / 1e6:.1f} MB"
        per_s = self.docs / max(seconds, 1e-9)
        return (
            f"{self.docs:,} documents, {done} in {seconds:.0f}s ({per_s:,.0f} docs/s, "
            f"{self.rates(seconds)})"
        )

    def close(self) -> None:
        self.bar.close()
