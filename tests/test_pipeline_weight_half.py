"""A V schedule's weight half under activation checkpointing, in this process: torch's ZBV
schedule over the trainer's stages (both on one rank, a world of one)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

from scale_llm.components.loss import cross_entropy
from scale_llm.config import load_config
from scale_llm.model import build_model, materialize
from scale_llm.parallel.activation_checkpointing import apply_activation_checkpointing
from scale_llm.parallel.pipeline import Stage, pipeline_stages
from tests.helpers import TINY_MODEL

PIECES = 2
UNTIED = ["model.tie_embeddings=false"]  # (a tied head is refused with pipelining)


@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    """A gloo process group of this process alone (left as found: an earlier in-process run
    may have made one already)."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if made:
            dist.destroy_process_group()


def zbv_step(mode: str) -> tuple[list[int], dict[str, torch.Tensor]]:
    """One ZBV step of a 2-block model cut into stages 0 and 1 (block 0 and 1): how often
    stage 1's block ran its forward inside each of that stage's weight halves, and the
    gradients."""
    cfg = load_config(None, [*TINY_MODEL, *UNTIED, f"activation_checkpointing.mode={mode}"])
    torch.manual_seed(0)
    model = materialize(build_model(cfg.model), torch.device("cpu"))
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    modules = {0: Stage(model, range(0, 1), True, False), 1: Stage(model, range(1, 2), False, True)}
    stages = pipeline_stages(modules, 2, torch.device("cpu"))  # (the trainer's)
    runs = [0]  # (the checkpoint recomputes the block's forward, not its __call__: a child's)
    model.layers[1].attention_norm.register_forward_pre_hook(
        lambda *_: runs.__setitem__(0, runs[0] + 1)
    )
    per_weight_half = []
    weight_half = stages[1].backward_weight_one_chunk

    def counted(*args, **kwargs):
        before = runs[0]
        weight_half(*args, **kwargs)
        per_weight_half.append(runs[0] - before)

    stages[1].backward_weight_one_chunk = counted
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=PIECES, loss_fn=cross_entropy)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len + 1))
    schedule.step(tokens[:, :-1], target=tokens[:, 1:], losses=[])
    return per_weight_half, {n: p.grad for n, p in model.named_parameters()}


def test_a_checkpointed_weight_half_recomputes_its_block_once():
    """torch 2.13's weight half makes one autograd call per weight group (7 a block); alone,
    each recomputed the block (7 forwards a piece, measured 2026-12-05; the recomputations'
    unread tensors kept: 104.7 MiB against 8.1 for 3 tiny.yaml blocks, 2 rows). As one
    GraphExecGroup: one forward a piece, the gradients bitwise those of no checkpointing."""
    with world_of_one():
        full, grads = zbv_step("full")
        none, reference = zbv_step("none")
    assert full == [1] * PIECES
    assert none == [0] * PIECES
    for name, grad in reference.items():
        assert torch.equal(grads[name], grad), name
