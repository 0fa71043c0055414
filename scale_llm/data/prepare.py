"""`scale-llm prepare`: data.dir from `data.source` (one source) or `data.sources` (a mixture).

One source is prepared by prepare_source.py (corpus -> tokenizer -> token shards + manifest); a
mixture by mixture.py, which prepares each of its sources the same way into data.dir/<name>
under one shared tokenizer.
"""

from __future__ import annotations

from typing import Any

from scale_llm.config import Config
from scale_llm.data.mixture import prepare_mixture
from scale_llm.data.prepare_source import prepare_source


def prepare(cfg: Config, force: bool = False) -> dict[str, Any]:
    """Prepare data.dir; returns its record: the manifest of one source, or a mixture's
    mixture.json."""
    if cfg.data.sources:
        return prepare_mixture(cfg, force)
    return prepare_source(cfg, force)
