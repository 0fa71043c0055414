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


def test_the_gpu_check_runs_on_the_cpu_and_writes_its_report(data_dir, corpus_dir, tmp_path):
    """launch/gpu-check.sh's checks without a GPU, at the test corpus's tiny size."""
    from scale_llm.check import run_check
    from tests.helpers import TINY_MODEL

    same_data = [  # the session's prepared data: prepare finds it up to date
        f"data.source={corpus_dir}",
        f"data.dir={data_dir}",
        "data.tokenizer_sample_bytes=500000",
        "data.val_fraction=0.1",
    ]
    small = [*TINY_MODEL, *same_data, "train.micro_batch_size=4", "train.lr=1e-2"]
    report = run_check(tmp_path, steps=4, overrides=small)
    assert report["ok"], [(c["first_loss"], c["last_loss"]) for c in report["curves"]]
    assert [(c["precision"], c["compile"]) for c in report["curves"]] == [
        ("fp32", False),
        ("fp32", True),
    ]
    assert report["curves"][1]["first_step_diff_vs_cpu_fp32"] < 1e-4
    assert len(report["sweep"]) == 4 and all("ms_per_step" in r for r in report["sweep"])
    assert report["reference"]["first_loss_framework"] == pytest.approx(
        report["reference"]["first_loss_reference"], 1e-6
    )
    md = (tmp_path / "report.md").read_text()
    assert "(a) tiny.yaml curves" in md and "(b) sweep" in md and "(c) the framework" in md
    assert (tmp_path / "report.json").is_file()
