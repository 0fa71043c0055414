"""Logging: INFO from the main rank, warnings and errors from every rank (tagged with the rank)."""

from __future__ import annotations

import logging
import os
import sys


def _int_env(name: str, default: int) -> int:
    """An integer from the environment; an unparsable one is reported by the launch plan
    (scale_llm.plan.launch_env), so logging just falls back to the default here."""
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def setup_logging(rank: int | None = None) -> None:
    if rank is None:
        rank = _int_env("RANK", 0)
    world = _int_env("WORLD_SIZE", 1)
    prefix = f"[rank {rank}] " if world > 1 else ""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S"))
    root = logging.getLogger("scale_llm")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False
