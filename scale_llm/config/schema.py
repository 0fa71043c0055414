"""How every config section declares its keys, wherever its schema lives."""

from __future__ import annotations

import dataclasses
from typing import Any


def config_key(
    default: Any, help: str, *, run_defining: bool = False, null_unsets: bool = False
) -> Any:
    """A config key: its default and its meaning, the one source of `scale-llm config --keys`
    and of docs/config.md's key tables (scale_llm.config.keys renders them).

    `run_defining`: a change of this key makes a checkpoint belong to a different run, so
    resuming across it is refused (the trainer reads this metadata; no list to keep in sync).
    `null_unsets`: null (YAML or --set) gives the key its default, so a file can drop what its
    `base:` file set (a mixture's `data.source: null`).
    """
    if not help.strip():
        raise ValueError("a config key needs its meaning: config_key(default, help)")
    metadata = {"help": help, "run_defining": run_defining, "null_unsets": null_unsets}
    if isinstance(default, list):  # a fresh list per instance (dataclasses refuse a shared one)
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def key_help(f: dataclasses.Field) -> str | None:
    """The meaning `config_key` gave a dataclass field; None for a field declared without it."""
    return f.metadata.get("help")
