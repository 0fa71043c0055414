"""Logging: INFO from the main rank, warnings and errors from every rank (tagged with the rank).
Lines are `HH:MM:SS message`; warnings and errors carry their level (`HH:MM:SS WARNING: ...`)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any


def _int_env(name: str, default: int) -> int:
    """An integer from the environment, else `default` (the launch plan reports a bad one)."""
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
        marked = record.levelno >= logging.WARNING
        return self._marked.format(record) if marked else super().format(record)


def setup_logging(rank: int | None = None, stream: Any = None) -> None:
    """The console's log lines: on stdout, or `stream` (stderr where stdout is a command's YAML
    or JSON, which a line would break)."""
    rank = _int_env("RANK", 0) if rank is None else rank
    prefix = f"[rank {rank}] " if _int_env("WORLD_SIZE", 1) > 1 else ""
    root = logging.getLogger("scale_llm")
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(_Formatter(prefix))
    handler.scale_llm_console = True  # the one handler this replaces on a second call
    kept = [h for h in root.handlers if not getattr(h, "scale_llm_console", False)]
    root.handlers[:] = [*kept, handler]  # a caller's own handlers stay attached
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False
