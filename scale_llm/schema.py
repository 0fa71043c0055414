"""Field metadata shared by every config section, wherever its schema lives."""

from __future__ import annotations

import dataclasses
from typing import Any


def run_defining(default: Any) -> Any:
    """A config field whose change makes a checkpoint belong to a different run: resuming
    across it is refused (the trainer reads this metadata; no list to keep in sync)."""
    return dataclasses.field(default=default, metadata={"run_defining": True})
