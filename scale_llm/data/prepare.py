"""`scale-llm prepare`: data.dir from `data.source` (prepare_source.py) or `data.sources` (a
mixture: mixture.py, each source the same way into data.dir/<name> under one tokenizer)."""

from __future__ import annotations

from typing import Any

from scale_llm.config import Config
from scale_llm.data.mixture import prepare_mixture
from scale_llm.data.prepare_source import prepare_source


def prepare(cfg: Config, force: bool = False) -> dict[str, Any]:
    """Prepare data.dir; its record: one source's manifest, or a mixture's mixture.json."""
    return prepare_mixture(cfg, force) if cfg.data.sources else prepare_source(cfg, force)
