"""How every config section declares its keys, wherever its schema lives, and the bounds check
the sections' validations share."""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any


def config_key(
    default: Any, help: str, *, run_defining: bool = False, null_unsets: bool = False
) -> Any:
    """A config key: its default and meaning (the one source of `config --keys` and docs/config.md).
    `run_defining`: a change makes a checkpoint another run's (resuming across it is refused).
    `null_unsets`: null gives the default, so a file can drop what its `base:` file set."""
    if not help.strip():
        raise ValueError("a config key needs its meaning: config_key(default, help)")
    metadata = {"help": help, "run_defining": run_defining, "null_unsets": null_unsets}
    if isinstance(default, list):  # a fresh list per instance (dataclasses refuse a shared one)
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def bound_problems(section: Any, keys: str, rule: str = "> 0", prefix: str = "") -> list[str]:
    """`KEY=VALUE must be RULE` for each of `keys` (dotted, space-separated) whose value, where
    set (not null), breaks `rule`: `> N` or `>= N`, then what the message adds."""
    op, bound, tail = re.fullmatch(r"(>=?) (\d+)(.*)", rule).groups()
    e = []
    for key in keys.split():
        value = functools.reduce(getattr, key.split("."), section)
        if value is not None and (value <= int(bound) if op == ">" else value < int(bound)):
            e.append(f"{prefix}{key}={value} must be {op} {bound}{tail}")
    return e
