"""The train loader over ranks: disjoint, seeded, prefetched, resumable and reshardable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scale_llm.data.loader import TokenWindows, TrainLoader
from tests.helpers import batch_plan

CPU = torch.device("cpu")
SEQ = 8


def windows(n_windows=96, shards=3):
    """Token i*SEQ starts window i (one shard holds consecutive windows): row[0] // SEQ names it."""
    data = np.arange(n_windows * SEQ + 1, dtype=np.uint16)
    cuts = np.linspace(0, n_windows, shards + 1).astype(int)
    return TokenWindows([data[a * SEQ : b * SEQ + 1] for a, b in zip(cuts[:-1], cuts[1:])], SEQ)


def make(w, mb, accum, world=1, rank=0, seed=0, prefetch=0):
    return TrainLoader(w, batch_plan(mb, accum, world, rank), seed, prefetch=prefetch)


def ids(batches) -> list[int]:
    """Window ids of one rank's step, in micro-batch order."""
    return [int(x[0]) // SEQ for inputs, _ in batches for x in inputs]


def step_of_all_ranks(loaders) -> list[int]:
    """The global batch of one step: rank 0's slice, then rank 1's, ..."""
    return [i for ld in loaders for i in ids(ld.next_batches())]


def stream(w, count, seed=0):
    """The first `count` windows of the seeded stream, read one at a time."""
    one = make(w, 1, 1, seed=seed)
    return [ids(one.next_batches())[0] for _ in range(count)]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_read_disjoint_windows_that_tile_the_stream(world):
    w = windows()
    ranks = [make(w, 2, 3, world, r, seed=5, prefetch=2) for r in range(world)]
    per_step = 2 * 3 * world
    steps = len(w) // per_step  # one epoch
    seen: list[list[int]] = [[] for _ in range(world)]
    for _ in range(steps):
        for r, ld in enumerate(ranks):
            seen[r] += ids(ld.next_batches())
    for a in range(world):
        for b in range(a + 1, world):
            assert not set(seen[a]) & set(seen[b])  # disjoint over the whole epoch
    assert sorted(i for s in seen for i in s) == list(range(len(w)))  # every window once
    for ld in ranks:
        ld.close()


def test_order_is_fixed_by_the_seed():
    w = windows()
    assert stream(w, 40, seed=1) == stream(w, 40, seed=1)
    assert stream(w, 40, seed=1) != stream(w, 40, seed=2)


def test_prefetch_reads_exactly_the_same_batches():
    w = windows()
    plain, ahead = make(w, 4, 2, seed=3), make(w, 4, 2, seed=3, prefetch=3)
    for _ in range(30):  # several epochs
        a, b = plain.next_batches(), ahead.next_batches()
        assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
    assert ahead.state_dict() == plain.state_dict()  # the read-ahead is not counted
    assert ahead.state_dict()["position"] == 30 * 8
    ahead.close()


def test_resume_gives_the_identical_next_batches():
    w = windows()
    a = make(w, 2, 2, world=2, rank=1, seed=9, prefetch=2)
    for _ in range(5):
        a.next_batches()
    state = a.state_dict()
    expected = [a.next_batches() for _ in range(4)]
    b = make(w, 2, 2, world=2, rank=1, seed=9, prefetch=2)
    b.next_batches()  # a fresh loader that already read ahead from position 0
    b.load_state_dict(state)
    for want in expected:
        got = b.next_batches()
        assert all(torch.equal(x, y) for (x, _), (y, _) in zip(want, got))
    a.close()
    b.close()


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 4)])
def test_reshard_with_the_same_global_batch_continues_step_for_step(before, after):
    """Same global batch (micro x accum x world = 8): each step holds what it would have."""
    w = windows()
    layout = {1: (4, 2), 2: (2, 2), 4: (1, 2)}  # world -> (micro_batch_size, grad_accum)
    old = [make(w, *layout[before], before, r, seed=4) for r in range(before)]
    for _ in range(3):
        step_of_all_ranks(old)
    state = old[0].state_dict()
    new = [make(w, *layout[after], after, r, seed=4) for r in range(after)]
    for ld in new:
        ld.load_state_dict(state)
    for _ in range(15):  # across the epoch boundary
        assert step_of_all_ranks(new) == step_of_all_ranks(old)


@pytest.mark.parametrize(("before", "after"), [((2, 2, 2), (3, 1, 1)), ((1, 1, 1), (2, 3, 2))])
def test_reshard_with_another_global_batch_neither_repeats_nor_skips(before, after):
    """(micro, accum, world) changes the global batch: the stream continues where it stopped."""
    w = windows()
    mb, accum, world = before
    old = [make(w, mb, accum, world, r, seed=6) for r in range(world)]
    trained = [i for _ in range(5) for i in step_of_all_ranks(old)]
    mb, accum, world = after
    new = [make(w, mb, accum, world, r, seed=6) for r in range(world)]
    for ld in new:
        ld.load_state_dict(old[0].state_dict())
    trained += [i for _ in range(20) for i in step_of_all_ranks(new)]
    assert trained == stream(w, len(trained), seed=6)


def test_epoch_wrap_is_logged(logs):
    w = windows(n_windows=20, shards=1)
    ld = make(w, 4, 2, seed=0)
    for _ in range(3):  # positions 0, 8, 16: the third step crosses into epoch 1
        ld.next_batches()
    assert any("epoch 1 of 20 training windows begins" in r.message for r in logs.records)
