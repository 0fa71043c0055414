"""Every random generator a rank uses, as plain tensors and numbers (so checkpoints stay loadable
with weights_only=True), gathered from all ranks and handed back to each on resume."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from scale_llm.components.distributed import rank_and_world

log = logging.getLogger(__name__)


def gather_all_ranks() -> list[dict[str, Any]]:
    """Every rank's torch (CPU and CUDA), numpy and Python generator states, in rank order (a
    collective: call it on every rank)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    mine = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": {"version": version, "state": list(py_state), "gauss": py_gauss},
    }
    if torch.cuda.is_available():
        mine["cuda"] = torch.cuda.get_rng_state()
    if (world := rank_and_world()[1]) == 1:
        return [mine]
    states: list[Any] = [None] * world
    dist.all_gather_object(states, mine)
    return states


def restore_for_rank(states: list[dict[str, Any]], rank: int) -> None:
    """This rank's saved states; on a different world size, rank 0's (the generators do not
    affect which data is read, which is fixed by the stream position)."""
    if len(states) != (world := rank_and_world()[1]):
        log.info(
            f"rng: checkpoint from {len(states)} ranks, now {world}: every rank takes rank 0's "
            f"generator states"
        )
        rank = 0
    state = states[rank]
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
