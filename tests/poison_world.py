"""Run under torchrun (2 gloo ranks) by tests/test_distributed.py: for each backend, a short run
whose loss is made NaN on rank 1 alone on one step; rank 0 writes what every rank saw as JSON.

The NaN reaches every rank through the gradient reduction, so every backend must skip that
step on every rank (its update not applied: the later losses stay finite), count it, and still
write the final checkpoint due on it."""

from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext

import torch.distributed as dist

from scale_llm.components.distributed import start
from scale_llm.config import load_config
from scale_llm.config.plan import launch_env, resolve_plan
from tests.helpers import leave_world, trainer_for


def main(out: str, settings: list[str], cases: dict[str, list[str]], poisoned: list[int]) -> None:
    """`poisoned`: the 0-based optimizer steps whose loss is NaN on rank 1."""
    rank = int(os.environ["RANK"])
    results = {}
    for name, overrides in cases.items():
        cfg = load_config(None, [*settings, f"run.name={name}", *overrides])
        plan = resolve_plan(cfg, launch_env())
        start(plan)  # the process group (once), as the CLI does
        tr = trainer_for(cfg, plan)
        if rank == 1:
            loss_fn = tr.backend.loss_fn

            def nan_on_one_step(logits, targets, loss_fn=loss_fn, tr=tr):
                loss = loss_fn(logits, targets)
                return loss * float("nan") if tr.step in poisoned else loss

            tr.backend.loss_fn = nan_on_one_step
        result = tr.fit()
        seen = {
            "skipped": int(tr.skipped_steps),
            "grad_norms": {s: n for s, n in result.grad_norms.items()},
            "losses": {s: v for s, v in result.losses.items()},
            "checkpoint": result.checkpoint.name if result.checkpoint else None,
        }
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, seen)
        results[name] = everyone
        if name in ("ddp", "zero2"):
            results[f"{name} full disk"] = full_disk_on_rank_0(tr)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    leave_world()


def full_disk_on_rank_0(tr) -> dict[str, list]:
    """Saves where one rank alone runs out of disk, in each phase of a save (its folder, the
    backend's files on rank 1, the trainer state, the record and rename): what each rank raised,
    and the step folders left."""
    import errno
    from unittest import mock

    import torch
    import torch.distributed.checkpoint.filesystem as fs

    from scale_llm.components import checkpoint
    from scale_llm.errors import UserError
    from scale_llm.train import trainer

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    seen = {}
    backend = (torch, "save") if tr.plan.backend == "deepspeed" else (fs, "_write_item")
    for phase, where, rank in [
        ("folder", (checkpoint, "_remove_stale"), 0),
        ("backend", backend, 1),
        ("files", (trainer, "save_file"), 0),
        ("record", (checkpoint, "fsync_tree"), 0),
        ("publish", (checkpoint, "write_integrity"), 0),
    ]:
        tr.step += 1
        with mock.patch.object(*where, full) if dist.get_rank() == rank else nullcontext():
            try:
                tr.save_checkpoint()
                said = "saved"
            except UserError as e:
                said = str(e)
        dist.barrier()  # (rank 0 has removed what it wrote)
        left = sorted(p.name for p in tr.checkpointer.dir.iterdir() if "step_" in p.name)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [said, left])
        seen[phase] = everyone if rank == 0 else everyone[::-1]  # (the failing rank's first)
    return seen


if __name__ == "__main__":
    main(sys.argv[1], *(json.loads(a) for a in sys.argv[2:5]))
