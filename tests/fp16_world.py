"""Run under torchrun (2 gloo ranks) by tests/test_distributed.py: fp16 where only a GPU usually
runs it, on DDP and FSDP2. Rank 0 writes what every rank saw as JSON.

For each backend:
- straight: 4 steps; step 1's loss is NaN on rank 1, so the GradScaler halves its scale there;
- resumed: the same, stopped after step 2 (its checkpoint), then a new trainer resumes to 4: the
  scale (and the curve) must continue as in the straight run;
- shard (FSDP2): at step 2 one element of rank 1's own gradient shard is made inf after the
  reduction, where only rank 1 can see it: the scaler's inf check must be reduced over the mesh,
  so every rank skips that step (no shard changes) and every rank halves its scale.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from scale_llm.components.distributed import start
from scale_llm.config import load_config
from scale_llm.config.plan import launch_env, resolve_plan
from scale_llm.train.trainer import Trainer
from tests.helpers import leave_world, trainer_for

RANK = int(os.environ.get("RANK", "0"))


def trainer(settings: list[str], name: str, *extra: str) -> Trainer:
    cfg = load_config(None, [*settings, f"run.name={name}", *extra])
    plan = resolve_plan(cfg, launch_env())
    start(plan)  # the process group (once), as the CLI does
    return trainer_for(cfg, plan)


def nan_loss_on_rank_1(tr: Trainer, steps: set[int]) -> None:
    if RANK != 1:
        return
    loss_fn = tr.backend.loss_fn

    def poisoned(logits, targets):
        loss = loss_fn(logits, targets)
        return loss * float("nan") if tr.step in steps else loss

    tr.backend.loss_fn = poisoned


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def inf_in_rank_1s_shard(tr: Trainer, step: int) -> dict[str, bool]:
    """After the reduction, before the unscale: rank 1 alone holds an inf in its shard. Returns
    {"changed": whether this rank's shard changed in that step}, filled in when it ran."""
    seen: dict[str, bool] = {}
    clip_and_step = tr.backend.clip_and_step

    def poisoned():
        if tr.step != step:
            return clip_and_step()
        params = list(tr.backend.model.parameters())  # (a pipeline's: this rank's stage)
        if RANK == 1:
            local(params[0].grad).view(-1)[0] = float("inf")
        before = [local(p.detach()).clone() for p in params]
        norm = clip_and_step()
        # (this rank's shards: a DTensor's torch.equal all-reduces over every rank, and the
        # pipeline's stages hold different parameters)
        seen["changed"] = any(not torch.equal(b, local(p.detach())) for b, p in zip(before, params))
        return norm

    tr.backend.clip_and_step = poisoned
    return seen


def rows(tr: Trainer) -> dict[int, dict]:
    dist.barrier()  # (rank 0 writes the last step's row after that step's save)
    lines = (tr.run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def main(out: str, settings: list[str], cases: dict[str, list[str]]) -> None:
    results: dict[str, dict] = {}
    for name, overrides in cases.items():
        seen: dict[str, object] = {}
        tr = trainer(settings, f"{name}-straight", *overrides)
        nan_loss_on_rank_1(tr, {0})
        tr.fit()
        seen["straight"] = rows(tr)
        first = trainer(settings, f"{name}-resumed", *overrides, "train.exit_at_step=2")
        nan_loss_on_rank_1(first, {0})
        first.fit()
        again = trainer(settings, f"{name}-resumed", *overrides)
        seen["resumed_at"] = again.step
        again.fit()
        seen["resumed"] = rows(again)
        if "fsdp" in name:
            tr = trainer(settings, f"{name}-shard", *overrides)
            seen["shard"] = inf_in_rank_1s_shard(tr, 1)
            tr.fit()
            seen["shard_rows"] = rows(tr)
            seen["shard_skipped"] = int(tr.skipped_steps)
            seen["shard_scale"] = tr.backend.loss_scale()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, seen)
        results[name] = everyone
    if RANK == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    leave_world()


if __name__ == "__main__":
    main(sys.argv[1], *(json.loads(a) for a in sys.argv[2:4]))
