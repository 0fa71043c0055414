"""Logging: INFO from the main rank, warnings and errors from every rank (tagged with the rank)."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(rank: int | None = None) -> None:
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"[rank {rank}] " if world > 1 else ""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S"))
    root = logging.getLogger("scale_llm")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False
