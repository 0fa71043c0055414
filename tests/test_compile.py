"""torch.compile per block and for the loss (`train.compile`): the same loss curve as eager,
no graph break, no recompilation while training, and an exact resume. CPU, inductor's C++
backend, fp32, the tiny model; one compile is shared by every test here (same code, same shapes)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from scale_llm.train.trainer import Trainer
from tests.helpers import make_config, plan_for

STEPS = 4
COMMON = [f"train.max_steps={STEPS}", "train.lr=1e-2", "activation_checkpointing.mode=full"]


def fit(data_dir, root, name, *overrides) -> tuple[Trainer, dict[int, float]]:
    cfg = make_config(data_dir, root, f"run.name={name}", *COMMON, *overrides)
    tr = Trainer(cfg, plan_for(cfg))
    return tr, tr.fit().losses


@pytest.fixture(scope="module")
def eager(data_dir, tmp_path_factory):
    return fit(data_dir, tmp_path_factory.mktemp("eager"), "eager")[1]


@pytest.fixture(scope="module")
def compiled(data_dir, tmp_path_factory):
    torch._dynamo.reset()
    counters.clear()
    root = tmp_path_factory.mktemp("compiled")
    cfg = make_config(data_dir, root, "run.name=compiled", *COMMON, "train.compile=true")
    tr = Trainer(cfg, plan_for(cfg))
    graphs = []
    step = tr.train_step

    def counted_step():
        out = step()
        graphs.append(counters["stats"]["unique_graphs"])
        return out

    tr.train_step = counted_step
    losses = tr.fit().losses
    return losses, graphs, dict(counters["graph_break"]), root


def test_compiled_run_follows_the_eager_curve(eager, compiled):
    losses = compiled[0]
    worst = max(abs(losses[s] - eager[s]) for s in range(1, STEPS + 1))
    print(f"\ncompiled vs eager (fp32, CPU): max |loss diff| over {STEPS} steps = {worst:.1e}")
    assert worst < 1e-4


def test_no_graph_break_and_no_recompilation_while_training(compiled):
    _, graphs, breaks, _ = compiled
    assert breaks == {}, breaks
    assert graphs[0] == 2  # one graph for every block (they share code), one for the loss
    assert graphs == [graphs[0]] * STEPS  # nothing recompiled after the first step


def test_compiled_resume_is_exact(data_dir, compiled):
    losses, _, _, root = compiled
    name = ["run.name=compiled-resumed", "train.compile=true"]
    cfg = make_config(data_dir, root, *name, *COMMON, "train.exit_at_step=2", "checkpoint.every=2")
    Trainer(cfg, plan_for(cfg)).fit()
    cfg = make_config(data_dir, root, *name, *COMMON)
    resumed = Trainer(cfg, plan_for(cfg))
    assert resumed.step == 2
    again = resumed.fit().losses
    for step in (3, 4):
        assert again[step] == losses[step], step
