"""Run under torchrun (2 gloo ranks) by tests/test_memory.py: one optimizer step per case,
measured by category on every rank with `measure_step`; rank 0 writes the results as JSON (its
own, and every rank's under "ranks")."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from scale_llm.analysis.memory.measure import measure_step
from scale_llm.config import load_config
from tests.helpers import leave_world

SHAPE = [
    "model.vocab_size=2048",
    "model.d_model=256",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.seq_len=256",
    "train.micro_batch_size=4",
    "train.compile=false",
    "train.device=cpu",
]


def main(out: str, cases: list[dict]) -> None:
    results = []
    for case in cases:
        cfg = load_config(None, [*SHAPE, *case["set"]])
        mine = measure_step(cfg)
        ranks = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(ranks, mine)
        results.append({**case, **mine, "ranks": ranks})
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    leave_world()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
