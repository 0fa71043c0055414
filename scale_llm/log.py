"""Logging: INFO from the main rank, warnings and errors from every rank (tagged with the rank).

Info lines are `HH:MM:SS message`; a warning or an error carries its level after the time
(`HH:MM:SS WARNING: message`), so it stands out among the step lines and can be grepped.
"""

from __future__ import annotations

import logging
import os
import sys


def _int_env(name: str, default: int) -> int:
    """An integer from the environment; an unparsable one is reported by the launch plan
    (scale_llm.config.plan.launch_env), so logging just falls back to the default here."""
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class _Formatter(logging.Formatter):
    """The level in the line for warnings and errors only."""

    def __init__(self, prefix: str):
        super().__init__(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S")
        self._marked = logging.Formatter(
            f"%(asctime)s {prefix}%(levelname)s: %(message)s", "%H:%M:%S"
        )

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno >= logging.WARNING:
            return self._marked.format(record)
        return super().format(record)


def setup_logging(rank: int | None = None) -> None:
    if rank is None:
        rank = _int_env("RANK", 0)
    world = _int_env("WORLD_SIZE", 1)
    prefix = f"[rank {rank}] " if world > 1 else ""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_Formatter(prefix))
    handler.scale_llm_console = True  # the one handler this replaces on a second call
    root = logging.getLogger("scale_llm")
    kept = [h for h in root.handlers if not getattr(h, "scale_llm_console", False)]
    root.handlers[:] = [*kept, handler]  # a caller's own handlers stay attached
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False
