"""Trainer: accumulation equals the big batch, clipping, precision, checkpoints and resume."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import shutil
from pathlib import Path

import pytest
import torch

from scale_llm.components.optim import lr_at, param_groups
from scale_llm.config import TrainConfig, load_config
from scale_llm.errors import UserError
from scale_llm.model import build_model
from scale_llm.train.trainer import Trainer
from tests.helpers import finished_run, make_config, plan_for, rows_of, trainer_for


def trainer(data_dir, tmp_path, *overrides) -> Trainer:
    cfg = make_config(data_dir, tmp_path / "runs", *overrides)
    return trainer_for(cfg)


def capture_grads(tr: Trainer) -> dict[str, torch.Tensor]:
    """Record the gradients the clip sees (after accumulation and unscaling) on each step."""
    seen: dict[str, torch.Tensor] = {}
    clip = tr.backend.clip_grad_norm

    def spy(max_norm):
        seen.update({n: p.grad.detach().clone() for n, p in tr.backend.module.named_parameters()})
        return clip(max_norm)

    tr.backend.clip_grad_norm = spy
    return seen


@pytest.mark.parametrize("ac", ["none", "full"])
def test_grad_accum_4_x_micro_2_equals_one_micro_batch_of_8(data_dir, tmp_path, ac):
    big = trainer(data_dir, tmp_path, "train.micro_batch_size=8", "train.grad_accum=1")
    small = trainer(
        data_dir,
        tmp_path,
        "train.micro_batch_size=2",
        "train.grad_accum=4",
        f"activation_checkpointing.mode={ac}",
    )
    g_big, g_small = capture_grads(big), capture_grads(small)
    loss_big, norm_big, _ = big.train_step()
    loss_small, norm_small, _ = small.train_step()
    assert g_big.keys() == g_small.keys()
    for name in g_big:
        torch.testing.assert_close(g_small[name], g_big[name], atol=1e-6, rtol=0, msg=name)
    assert loss_small.item() == pytest.approx(loss_big.item(), abs=1e-6)
    assert norm_small.item() == pytest.approx(norm_big.item(), rel=1e-5)


def norm_seen_by_optimizer(tr: Trainer) -> dict[str, float]:
    """The global gradient norm the optimizer step sees (after clipping), updated every step."""
    seen: dict[str, float] = {}

    def record(opt, args, kwargs):
        norms = [torch.linalg.vector_norm(p.grad) for p in tr.backend.module.parameters()]
        seen["norm"] = torch.linalg.vector_norm(torch.stack(norms)).item()

    tr.backend.optimizer.register_step_pre_hook(record)
    return seen


def test_clipping_caps_the_global_norm(data_dir, tmp_path):
    tr = trainer(data_dir, tmp_path, "train.grad_clip=0.05")
    seen = norm_seen_by_optimizer(tr)
    _, pre_clip, _ = tr.train_step()
    assert pre_clip.item() > 0.05
    assert seen["norm"] == pytest.approx(0.05, rel=1e-4)

    free = trainer(data_dir, tmp_path, "train.grad_clip=0")
    seen = norm_seen_by_optimizer(free)
    _, norm, _ = free.train_step()
    assert seen["norm"] == pytest.approx(norm.item(), rel=1e-5)  # not clipped


def test_fp16_scales_the_loss_and_bf16_does_not(data_dir, tmp_path):
    ratios = {}
    for precision in ("fp32", "bf16"):  # no scaler: the loss is backpropagated as it is
        tr = trainer(data_dir, tmp_path, f"train.precision={precision}")
        assert tr.backend.scaler is None
    for precision in ("fp16",):
        tr = trainer(data_dir, tmp_path, f"train.precision={precision}")
        scaler = tr.backend.scaler
        assert scaler.get_scale() == 2.0**16
        unscale = scaler.unscale_

        def spy(opt, unscale=unscale, tr=tr, precision=precision):
            before = torch.linalg.vector_norm(
                torch.stack([p.grad.float().norm() for p in tr.backend.module.parameters()])
            )
            unscale(opt)
            after = torch.linalg.vector_norm(
                torch.stack([p.grad.float().norm() for p in tr.backend.module.parameters()])
            )
            ratios[precision] = (before / after).item()

        scaler.unscale_ = spy
        tr.train_step()
    assert ratios["fp16"] == pytest.approx(2.0**16, rel=1e-3)  # GradScaler's initial scale


def poison(tr: Trainer, steps: set[int]) -> None:
    """Make the loss NaN on the given (0-based) optimizer steps."""
    forward = tr.model.forward

    def maybe_nan(*args, **kwargs):
        out = forward(*args, **kwargs)
        return out * float("nan") if tr.step in steps else out

    tr.model.forward = maybe_nan


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_non_finite_step_is_skipped_and_counted(data_dir, tmp_path, precision):
    tr = trainer(data_dir, tmp_path, f"train.precision={precision}", "train.max_steps=3")
    poison(tr, {1})
    changed = {}
    opt = tr.backend.optimizer
    step = opt.step

    def record(*a, **k):  # did this optimizer step change any weight or Adam state?
        def state():
            moments = [t for s in opt.state.values() for t in s.values()]
            return [p.detach().clone() for p in tr.backend.module.parameters()] + [
                t.clone() for t in moments
            ]

        before = state()
        out = step(*a, **k)
        changed[tr.step] = any(not torch.equal(b, a) for b, a in zip(before, state()))
        return out

    opt.step = record
    result = tr.fit()
    # step index 1 changed nothing: the fused AdamW got the verdict and skipped on the device
    assert changed == {0: True, 1: False, 2: True}
    assert result.steps == 3 and int(tr.skipped_steps) == 1
    for p in tr.backend.module.parameters():
        assert torch.isfinite(p).all()
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["skipped_steps"] == 1


def test_a_run_of_bad_steps_stops_with_causes_and_the_last_good_checkpoint(
    data_dir, tmp_path, logs
):
    """Steps 5.. are poisoned: step 6's checkpoint is still written (a skipped step changes no
    weight: it holds step 4's), and at 3 skipped in a row the run stops, naming it. Each
    skipped step is said once (a save on one said it twice)."""
    from scale_llm.components.checkpoint import load_model_weights
    from scale_llm.model import empty_state_dict
    from scale_llm.train.guards import TrainingDiverged

    settings = ["train.max_steps=20", "train.max_bad_steps=3", "checkpoint.every=2"]
    settings.append("checkpoint.keep_last=3")
    tr = trainer(data_dir, tmp_path, *settings)
    poison(tr, set(range(4, 20)))
    with pytest.raises(TrainingDiverged) as info:
        tr.fit()
    msg = str(info.value)
    assert "the last 3 optimizer steps had a non-finite loss" in msg
    assert "train.lr=" in msg and "train.precision=fp32" in msg and "data.dir=" in msg
    assert "step_00000006 (it holds step 4's weights)" in msg
    assert info.value.exit_code == 3
    assert tr.step == 7
    said = [m for m in logs if "consecutive steps skipped" in m]
    assert [m.split(":")[0] for m in said] == ["step 5", "step 6"], said
    saved = dict(tr.checkpointer.complete())
    assert sorted(saved) == [2, 4, 6]
    four, six, two = (
        load_model_weights(saved[s], empty_state_dict(tr.cfg.model)) for s in (4, 6, 2)
    )
    assert all(torch.equal(four[k], six[k]) for k in four)
    assert not all(torch.equal(four[k], two[k]) for k in four)  # steps 3-4 did change them
    assert all(torch.isfinite(v).all() for v in six.values())
    from scale_llm.train.runs import list_runs

    assert [(r.status, r.step, r.checkpoint) for r in list_runs(tr.run_dir.parent)] == [
        ("diverged", 7, "step_00000006")  # (`scale-llm runs` reads the row the stop wrote)
    ]
    last = rows_of(tr.run_dir)[7]  # the stop's row keeps the step's numbers (it held none)
    assert last["stopped"] == "diverged" and last["skipped_steps"] == 3
    assert last["loss"] == last["grad_norm"] == "nan"  # (JSON has no NaN: written as text)
    assert math.isnan(list_runs(tr.run_dir.parent)[0].loss)  # (step 1's loss was shown)
    again = trainer(data_dir, tmp_path, *settings)  # a resume continues the streak's count
    assert again.step == 6 and int(again.bad_streak) == 2 and int(again.skipped_steps) == 2
    assert list_runs(tr.run_dir)[0].status == f"running (pid {os.getpid()})"  # its lock
    again.loader.close()
    again.lock.release()
    assert list_runs(tr.run_dir)[0].status == "stopped"  # (its rows past step 6 were dropped)


def test_a_run_of_bad_steps_that_ended_between_checks_still_stops_the_run(data_dir, tmp_path, logs):
    """The streak was read only at logging steps and checkpoints: 5 skipped steps in a row
    (train.max_bad_steps=3) followed by a finite one before the check trained on to the end,
    without a word. And a stop found while a checkpoint step's evaluation had already been
    written wrote that step's row twice."""
    from scale_llm.train.guards import TrainingDiverged

    every = ("train.max_steps=12", "train.max_bad_steps=3", "logging.every=10")
    tr = trainer(data_dir, tmp_path, *every)
    poison(tr, set(range(1, 6)))  # steps 2-6 skipped, 7-9 finite again
    with pytest.raises(TrainingDiverged) as info:
        tr.fit()
    assert tr.step == 10 and "5 optimizer steps in a row since the check before" in str(info.value)
    assert "train.max_bad_steps=3; the steps after them were finite again" in str(info.value)
    assert rows_of(tr.run_dir)[10]["stopped"] == "diverged"
    # diverged at a checkpoint step that evaluates (not a logging step): one row for it
    tr = trainer(data_dir, tmp_path, *every, "run.name=b", "eval.every=4", "checkpoint.every=4")
    poison(tr, set(range(1, 12)))
    with pytest.raises(TrainingDiverged):
        tr.fit()
    lines = [json.loads(x) for x in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in lines]
    assert steps == sorted(set(steps)) and lines[-1]["stopped"] == "diverged", lines


def test_a_checkpoint_due_on_a_skipped_step_is_written(data_dir, tmp_path):
    """An fp16 overflow (or any skipped step) on the last step does not drop the final
    checkpoint: it is written, with the weights of the step before."""
    tr = trainer(data_dir, tmp_path, "train.max_steps=3")
    poison(tr, {2})
    result = tr.fit()
    assert result.steps == 3 and int(tr.skipped_steps) == 1
    assert result.checkpoint is not None and result.checkpoint.name == "step_00000003"
    assert [s for s, _ in tr.checkpointer.complete()] == [3]


def test_fp16_overflow_skips_the_step_and_counts_it(data_dir, tmp_path):
    tr = trainer(data_dir, tmp_path, "train.precision=fp16")
    tr.backend.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)  # overflows fp16 grads
    before = {n: p.clone() for n, p in tr.backend.module.named_parameters()}
    _, norm, _ = tr.train_step()
    assert not math.isfinite(norm.item())
    assert tr.skipped_steps.item() == 1
    for n, p in tr.backend.module.named_parameters():
        assert torch.equal(p, before[n]), n
    assert tr.backend.scaler.get_scale() < 2.0**120  # backed off


def run_until(tr: Trainer, stop_at: int):
    """Run fit() but die (like a killed job) when the next step would be `stop_at`."""
    step = tr.train_step

    def dying():
        if tr.step == stop_at:
            raise KeyboardInterrupt
        return step()

    tr.train_step = dying
    with pytest.raises(KeyboardInterrupt):
        tr.fit()


def test_resume_continues_the_same_loss_curve(data_dir, tmp_path):
    common = ["train.max_steps=8", "checkpoint.every=4", "train.grad_accum=2", "eval.every=4"]
    straight = trainer(data_dir, tmp_path, "run.name=straight", *common).fit()

    run_until(trainer(data_dir, tmp_path, "run.name=resumed", *common), stop_at=6)
    resumed_trainer = trainer(data_dir, tmp_path, "run.name=resumed", *common)
    assert resumed_trainer.step == 4
    resumed = resumed_trainer.fit()
    for step in range(5, 9):  # bit-identical on CPU in fp32
        assert resumed.losses[step] == straight.losses[step], step
    assert resumed.val_losses[8] == straight.val_losses[8]
    rows = [json.loads(x) for x in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))  # steps 5-6 logged once, not twice
    (aside,) = resumed.run_dir.glob("metrics-*.jsonl")  # the first attempt's 5-6, kept
    assert [json.loads(x)["step"] for x in aside.read_text().splitlines()] == [5, 6]


def test_every_launch_logs_its_first_and_the_last_step(data_dir, tmp_path):
    """Between logging steps a launch still shows where it starts: a resumed launch logs its
    first step (not only step 1 and the last), so its summary reads 'loss (step 3) -> (step 4)'."""
    common = ["train.max_steps=4", "checkpoint.every=2", "logging.every=10", "eval.every=0"]
    first = trainer(data_dir, tmp_path, *common, "train.exit_at_step=2").fit()
    assert sorted(first.losses) == [1, 2]  # (the step a launch stops at is logged too)
    second = trainer(data_dir, tmp_path, *common).fit()
    assert sorted(second.losses) == [3, 4]


def test_a_stopped_launch_names_one_step_in_its_checkpoint_done_line_and_runs(
    data_dir, tmp_path, logs, capsys
):
    """Stopped at step 7 between logging steps (every 2): the checkpoint was step_00000007 while
    the `done:` line said "(step 6)" and `runs` "6/20"; the stop step is logged now."""
    from scale_llm.cli import main
    from scale_llm.config import save_config

    cfg = make_config(
        data_dir,
        tmp_path / "runs",
        "train.max_steps=20",
        "logging.every=2",
        "checkpoint.every=5",
        "train.exit_at_step=7",
    )
    save_config(cfg, tmp_path / "run.yaml")
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    assert sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir())[-1] == "step_00000007"
    (done,) = [line for line in logs if line.startswith("done:")]
    assert "7 of 20 in total" in done and done.split(";")[2].endswith("(step 7)"), done
    capsys.readouterr()
    assert main(["runs", str(cfg.run_dir)]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[1] == "7/20" and row[-3] == "step_00000007", row


def test_validation_smaller_than_one_evaluation_scores_each_window_once(data_dir, tmp_path, logs):
    """eval.steps x the global batch beyond the validation windows: windows were scored again
    (wrapped around) without a word; now each once, said at the start."""
    import numpy as np

    from scale_llm.components.loss import cross_entropy

    tr = trainer(data_dir, tmp_path, "train.max_steps=1", "eval.every=1", "eval.steps=400")
    n = len(tr.val_windows)
    assert 4 * 400 > n > 4 * 200  # (the test data: ~1,000 windows)
    (said,) = [line for line in logs if line.startswith("eval: ")]
    assert said.startswith("eval: eval.steps=400 global batches of 4 sequences ask for 1600")
    assert f"({n:,} in data.dir): each evaluation scores those once each" in said
    assert said.endswith(f"or set eval.steps={n // 4} to score whole batches")
    scored: list[int] = []  # rows of each validation loss (training's run with gradients)
    loss_fn = tr.backend.loss_fn

    def spy(logits, targets):
        if not torch.is_grad_enabled():
            scored.append(len(targets))
        return loss_fn(logits, targets)

    tr.backend.loss_fn = spy
    val_loss = tr.fit().val_losses[1]
    assert sum(scored) == n and scored[-1] == (n % 4 or 4)
    tr.model.eval()
    with torch.no_grad():  # the mean over windows, each once
        batches = [tr.val_windows.get(np.arange(i, min(n, i + 4))) for i in range(0, n, 4)]
        total = sum(cross_entropy(tr.model(b[:, :-1]), b[:, 1:]).item() * len(b) for b in batches)
    assert val_loss == pytest.approx(total / n, rel=1e-5)


def test_a_metrics_line_nested_100000_deep_is_moved_aside_on_resume(data_dir, tmp_path, logs):
    """docs/reliability.md: a line of metrics.jsonl that is not a row moves aside with a warning;
    one nested 100,000 deep was a RecursionError that stopped every resume."""
    first = trainer(data_dir, tmp_path, "train.max_steps=4", "train.exit_at_step=2").fit()
    with open(first.run_dir / "metrics.jsonl", "a") as f:
        f.write("[" * 100_000 + "]" * 100_000 + "\n")
    trainer(data_dir, tmp_path, "train.max_steps=4").fit()
    assert any("1 line(s) of" in line and "are not metric rows; moved to" in line for line in logs)
    rows = [json.loads(x) for x in (first.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_metrics_rows_and_tensorboard_events(data_dir, tmp_path):
    result = trainer(
        data_dir, tmp_path, "logging.tensorboard=true", "eval.every=2", "eval.steps=2"
    ).fit()
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= r.keys()
    assert "val_loss" in rows[1] and "val_loss" not in rows[0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(result.run_dir / "tensorboard"))
    acc.Reload()
    assert {"loss/loss", "loss/val_loss", "train/lr", "train/grad_norm"} <= set(
        acc.Tags()["scalars"]
    )
    assert [e.step for e in acc.Scalars("loss/loss")] == [1, 2, 3, 4]
    assert (result.run_dir / "config.yaml").is_file()
    assert (result.run_dir / "tokenizer.model").is_file()
    saved = load_config(result.run_dir / "config.yaml")
    assert saved.model.d_model == 32
    assert saved.train.compile == "auto"  # as given (it held what auto became on this machine)


def read_wandb_records(run_dir: Path) -> list:
    """The records of an offline W&B run file (LevelDB-log framing of protobuf records)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, block, pending, records = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full, or the last piece
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_a_resume_applies_the_optimizers_changed_settings(data_dir, tmp_path, logs):
    """A resume that changed train.weight_decay, beta1, beta2 or eps kept the checkpoint's (the
    optimizer's groups were loaded with the saved ones): its steps were the unchanged run's, bit
    for bit, while config.yaml said otherwise. The new ones apply now, and the start says so."""
    finished_run(data_dir, tmp_path, "run.name=a", "train.exit_at_step=2")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    unchanged = trainer_for(make_config(data_dir, tmp_path, "run.name=a"))
    new = ("train.weight_decay=0.5", "train.beta2=0.5", "train.eps=1e-6")
    changed = trainer_for(make_config(data_dir, tmp_path, "run.name=b", *new))
    decay, no_decay = changed.backend.optimizer.param_groups
    assert (decay["weight_decay"], tuple(decay["betas"]), decay["eps"]) == (0.5, (0.9, 0.5), 1e-6)
    assert (no_decay["weight_decay"], tuple(no_decay["betas"])) == (0.0, (0.9, 0.5))
    said = [line for line in logs if "the optimizer's settings changed" in line]
    assert said == [
        "resume: the optimizer's settings changed (train.beta2: 0.95 -> 0.5, train.eps: 1e-08 -> "
        "1e-06, train.weight_decay: 0.1 -> 0.5): the new ones apply"
    ]
    unchanged.fit(), changed.fit()
    a, b = rows_of(tmp_path / "a"), rows_of(tmp_path / "b")  # (step 3: the loss before its update)
    assert a[3]["loss"] == b[3]["loss"] and a[4]["loss"] != b[4]["loss"]


def test_data_repeat_false_counts_the_steps_from_where_a_resume_continues(data_dir, tmp_path):
    """data.repeat=false's check counted train.max_steps x the batch from stream position 0: a
    resume with a smaller batch passed it, trained, saved and pruned, then stopped with the data
    used up; one with a larger batch that fits exactly was refused."""
    from scale_llm.data.mixture import open_training_data
    from scale_llm.train.preflight import check_data_epochs
    from scale_llm.train.resume import Resume

    def check(micro: int, max_steps: int, step: int, position: int) -> None:
        cfg = make_config(data_dir, tmp_path, "data.repeat=false", f"train.max_steps={max_steps}")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=micro))
        state = {"step": step, "data": {"position": position}}
        resume = Resume(tmp_path / "ckpt", state, True) if step else None
        check_data_epochs(cfg, plan_for(cfg), open_training_data(cfg), resume)

    windows = len(open_training_data(make_config(data_dir, tmp_path)).train)
    half = windows // 2
    check(1, windows, 0, 0)  # a fresh run of one epoch
    with pytest.raises(UserError, match=rf"\(resumed at step 100, stream position {half:,}\)"):
        check(1, windows - 10, 100, half)  # half read by a larger batch: 1.5 epochs in all
    check(2, 110, 100, windows - 20)  # 20 windows left, 10 steps of 2: it fits
    with pytest.raises(UserError, match="data.repeat=false, but train.max_steps=111"):
        check(2, 111, 100, windows - 20)


def test_options_this_run_does_not_read_are_said(data_dir, tmp_path, logs):
    """`auto` resolves to ddp under a launcher and to single alone: a replicate_degree meant for
    HSDP, DDP's or a pipeline's options were dropped without a word (config.yaml kept them)."""
    from scale_llm.train.preflight import preflight

    unread = ("parallel.fsdp.replicate_degree=2", "parallel.ddp.bucket_cap_mb=1")
    cfg = make_config(data_dir, tmp_path, *unread, "parallel.pipeline.microbatches=4")
    preflight(cfg, plan_for(cfg))
    said = [line for line in logs if "not read: this run's backend" in line]
    assert said == [
        "parallel.fsdp: replicate_degree=2 not read: this run's backend is single",
        "parallel.ddp: bucket_cap_mb=1 not read: this run's backend is single",
        "parallel.pipeline: microbatches=4 not read: this run's backend is single without "
        "pipeline stages",
    ]
    logs.clear()
    preflight(make_config(data_dir, tmp_path), plan_for(cfg))  # the defaults: nothing to say
    assert not [line for line in logs if "not read" in line]


def test_a_diverged_steps_nan_and_inf_reach_the_charts(tmp_path):
    """NaN and inf became strings for the JSON row before the charts' scalars were picked from
    it: TensorBoard (and W&B) drew a smooth line over the diverged step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from scale_llm.train.metrics import MetricsLogger

    metrics = MetricsLogger(tmp_path, True, load_config(None, ["logging.tensorboard=true"]), 0)
    for step, loss, norm in ((1, 5.0, 1.0), (2, math.nan, math.inf), (3, 4.0, 1.0)):
        metrics.log(step, {"loss": loss, "grad_norm": norm})
    metrics.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("loss/loss")]
    assert [step for step, _ in loss] == [1, 2, 3] and math.isnan(loss[1][1])
    assert [e.value for e in events.Scalars("train/grad_norm")] == [1.0, math.inf, 1.0]
    assert rows_of(tmp_path)[2] == {"step": 2, "loss": "nan", "grad_norm": "inf"}


def test_a_validation_loss_past_float64s_exp_logs_an_infinite_perplexity(
    data_dir, tmp_path, monkeypatch
):
    """val_perplexity was exp(min(val_loss, 80)): a loss of 800 logged 5.5e34 as if measured."""
    from scale_llm.train.callbacks import Validation

    monkeypatch.setattr(Validation, "evaluate", lambda self, trainer: {"": 800.0})
    tr = trainer(data_dir, tmp_path, "train.max_steps=2", "eval.every=1", "eval.steps=1")
    tr.fit()
    rows = rows_of(tr.run_dir)
    assert rows[1]["val_loss"] == 800.0 and rows[1]["val_perplexity"] == "inf"
    monkeypatch.setattr(Validation, "evaluate", lambda self, trainer: {"": 2.0})
    tr = trainer(data_dir, tmp_path, "run.name=b", "train.max_steps=1", "eval.every=1")
    tr.fit()
    assert rows_of(tr.run_dir)[1]["val_perplexity"] == pytest.approx(math.exp(2.0))


def test_a_rewritten_history_logs_to_a_new_wandb_run(tmp_path, monkeypatch, logs):
    """W&B drops a run's steps that do not increase: a resume at step 4 of a run that had logged
    step 6 kept its W&B run, so the steps rewritten were lost there; a start from another run's
    checkpoint (a fresh history) kept it too. Both start a new W&B run now."""
    wandb = pytest.importorskip("wandb")
    from scale_llm.train.metrics import MetricsLogger

    ids: list[str] = []

    class Run:
        def __init__(self, **kw):
            self.id = kw["id"]
            ids.append(self.id)

        def log(self, *args, **kwargs):
            pass

        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", Run)
    cfg = load_config(None, ["logging.tensorboard=false", "logging.wandb.project=p"])

    def launch(resume_step: int, steps: range, kept: int | None = None) -> str:
        metrics = MetricsLogger(tmp_path, True, cfg, resume_step, kept)
        for step in steps:
            metrics.log(step, {"loss": 1.0})
        metrics.close()
        return ids[-1]

    first = launch(0, range(1, 5))
    assert launch(4, range(5, 7)) == first  # a resume at the last row: the same W&B run
    assert not [line for line in logs if "wandb:" in line and "new W&B run" in line]
    rewound = launch(4, range(5, 6))  # at step 4 again, after step 6 was logged
    assert rewound != first and (tmp_path / "wandb-id.txt").read_text() == rewound + "\n"
    said = [line for line in logs if "new W&B run" in line]
    assert said == [
        f"wandb: this launch rewrites the 2 step(s) after 4 that W&B run {first} holds, which "
        f"W&B would drop (its steps only increase): logging to a new W&B run {rewound}, from "
        f"step 5"
    ]
    assert launch(5, range(6, 7)) == rewound  # then resumed as usual
    other = launch(2, range(3, 4), kept=0)  # another run's checkpoint
    assert other not in (first, rewound)
    # a rewind while W&B is off, then W&B on again: it continued `other` over the steps it held
    off = load_config(None, ["logging.tensorboard=false"])
    MetricsLogger(tmp_path, True, off, 2).close()  # (step 3's row goes)
    assert launch(2, range(3, 4)) not in (first, rewound, other)
    # W&B's service gone mid-run: a ConnectionResetError from wandb.log ended the training
    Run.log = lambda self, *args, **kwargs: (_ for _ in ()).throw(ConnectionResetError("gone"))
    logs.clear()
    metrics = MetricsLogger(tmp_path, True, cfg, 3)
    metrics.log(4, {"loss": 1.0})
    metrics.log(5, {"loss": 1.0})
    metrics.close()
    assert [r["step"] for r in rows_of(tmp_path).values()][-2:] == [4, 5]
    said = [line for line in logs if "W&B stops logging" in line]
    assert len(said) == 1 and said[0].startswith("wandb: ConnectionResetError: gone; W&B stops")


def test_a_rewritten_history_leaves_no_later_point_in_tensorboards_files(tmp_path):
    """TensorBoard's default (fast) reader ignores purge_step: after a resume at step 4 of a run
    that had logged step 8, its charts kept val_loss at 8 and the sample at 6 beside the new
    branch. The event files hold each step once: the training's rewritten from the rows kept,
    eval's of the checkpoints past the resume removed (its records stay)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    from scale_llm.evaluate import EVENTS_MARK
    from scale_llm.train.metrics import MetricsLogger

    folder = tmp_path / "tensorboard"

    def points() -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        for file in sorted(folder.glob("*tfevents*")):
            for event in LegacyEventFileLoader(str(file)).Load():
                for value in event.summary.value:
                    found.setdefault(value.tag.split("/text_summary")[0], []).append(event.step)
        return {tag: sorted(steps) for tag, steps in found.items()}

    cfg = load_config(None, ["logging.tensorboard=true"])
    metrics = MetricsLogger(tmp_path, True, cfg, 0)
    for step in range(1, 9):
        val = {"val_loss": 2.0} if step % 4 == 0 else {}
        text = {"samples_text": "def f"} if step == 6 else {}
        metrics.log(step, {"loss": float(step), "lr": 0.5, **val, **text})
    metrics.close()
    name = "events.out.tfevents.1.h.{n}.ab." + EVENTS_MARK + "-step_0000000{n}"  # (eval's)
    evals = {n: folder / name.format(n=n) for n in (4, 8)}
    for file in evals.values():
        file.write_bytes(b"")
    mine = folder / "events.out.tfevents.1.h.9.mine"  # a file of the user's: not the run's
    mine.write_bytes(b"")
    metrics = MetricsLogger(tmp_path, True, cfg, 4)
    metrics.log(5, {"loss": 50.0})
    metrics.close()
    seen = points()
    assert seen["loss/loss"] == [1, 2, 3, 4, 5] and seen["train/lr"] == [1, 2, 3, 4]
    assert seen["loss/val_loss"] == [4] and "samples/text" not in seen
    assert evals[4].exists() and not evals[8].exists() and mine.exists()
    files = sorted(folder.glob("*scale-llm-train"))
    MetricsLogger(tmp_path, True, cfg, 5).close()  # (nothing past step 5: nothing rewritten)
    assert set(files) <= set(folder.glob("*scale-llm-train")) and points()["loss/loss"][-1] == 5


def test_what_users_watch_tensorboard_wandb_samples_and_progress(
    data_dir, tmp_path, logs, monkeypatch
):
    """Config as hparams and text, validation perplexity, sample generations, the step line's
    % done / elapsed / ETA, and the same scalars and config in W&B (offline), all in the run dir
    (W&B's service wrote its log into ~/.cache/wandb)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert "WANDB_CACHE_DIR" not in os.environ
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    overrides = [
        "logging.tensorboard=true",
        "eval.every=2",
        "eval.steps=2",
        "eval.sample_every=2",
        "eval.sample_prompt=doc",
        "eval.sample_tokens=6",
        "logging.wandb.project=scale-llm-tests",
        "logging.wandb.mode=offline",
    ]
    result = trainer(data_dir, tmp_path, *overrides).fit()
    lines = [r.getMessage() for r in logs.records if r.getMessage().startswith("step ")]
    assert any(line.startswith("step 1/4 (25%) | loss") and "| eta " in line for line in lines)
    assert any("step 4/4 (100%)" in line and "eta 0s" in line for line in lines)

    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = {r["step"]: r["samples_text"] for r in rows if "samples_text" in r}
    assert sorted(samples) == [2, 4] and all(t.startswith("doc") for t in samples.values())
    ppl = {r["step"]: r["val_perplexity"] for r in rows if "val_perplexity" in r}
    assert ppl[4] == pytest.approx(math.exp(result.val_losses[4]))

    acc = EventAccumulator(str(result.run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss/val_perplexity")] == [2, 4]
    assert {"samples/text/text_summary", "config/yaml/text_summary"} <= set(acc.Tags()["tensors"])
    (text,) = [e for e in acc.Tensors("samples/text/text_summary") if e.step == 4]
    assert samples[4].split()[0] in text.tensor_proto.string_val[0].decode()
    hparams = acc.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in hparams
    assert b"train.lr" in hparams["_hparams_/session_start_info"]

    records = read_wandb_records(result.run_dir)
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
            history[int(items["_step"])] = items
    assert sorted(history) == [1, 2, 3, 4]
    assert float(history[4]["loss/loss"]) == pytest.approx(result.losses[4])
    assert json.loads(history[4]["samples/text"]) == samples[4]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "scale-llm-tests" and run.display_name == "test"
    config = {i.key: i.value_json for i in run.config.update}
    assert json.loads(config["train.max_steps"]) == 4
    assert not home.exists() or [p for p in home.rglob("*") if p.is_file()] == []
    assert "WANDB_CACHE_DIR" not in os.environ  # (set while W&B started)


def test_effective_batch_is_printed(data_dir, tmp_path, logs):
    tr = trainer(data_dir, tmp_path, "train.micro_batch_size=3", "train.grad_accum=5")
    tr.fit()
    assert "micro 3 x seq_len 32 x grad_accum 5 x world 1 = 15 sequences = 480 tokens" in (
        logs.text
    )
    assert "plan: backend single, precision fp32 on cpu, rank 0 of 1" in logs.text
    plan = json.loads((tr.run_dir / "plan.json").read_text())
    assert plan["backend"] == "single" and plan["precision"] == "fp32"
    assert plan["grad_accum"] == 5 and plan["tokens_per_step"] == 480


def test_the_run_dir_keeps_auto_and_the_plan_keeps_what_it_resolved_to(data_dir, tmp_path):
    cfg = make_config(data_dir, tmp_path / "runs", "train.precision=auto", "train.max_steps=1")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=8))
    result = trainer_for(cfg).fit()
    written = load_config(result.run_dir / "config.yaml")
    assert written.parallel.backend == "auto" and written.train.precision == "auto"
    assert written.train.global_batch_size == 8 and written.train.grad_accum == 1
    plan = json.loads((result.run_dir / "plan.json").read_text())
    assert plan["backend"] == "single" and plan["precision"] == "fp32"
    assert plan["grad_accum"] == 2 and plan["sequences_per_step"] == 8  # 8 / micro 4


def test_run_defining_keys_come_from_the_schema():
    from scale_llm.config import run_defining_keys

    keys = set(run_defining_keys())
    assert {"model.vocab_size", "model.d_model", "run.seed", "data.source"} <= keys
    assert not keys & {"train.lr", "train.max_steps", "model.attention", "data.dir"}


def test_checkpoints_are_pruned_and_a_torn_save_is_ignored(data_dir, tmp_path):
    tr = trainer(data_dir, tmp_path, "checkpoint.every=1", "checkpoint.keep_last=2")
    tr.fit()
    ckpts = tr.checkpointer.complete()
    assert [s for s, _ in ckpts] == [3, 4]
    # a save killed half-way leaves a .tmp dir (and maybe a dir without trainer state)
    (tr.checkpointer.dir / ".tmp-step_00000005").mkdir()
    (tr.checkpointer.dir / "step_00000006").mkdir()
    assert tr.checkpointer.latest().name == "step_00000004"
    again = trainer(data_dir, tmp_path, "checkpoint.every=1", "train.max_steps=5")
    assert again.step == 4


def test_pruning_removes_only_folders_a_save_wrote(data_dir, tmp_path, caplog):
    """keep_last prunes a step_N folder only when its integrity record lists every file in it
    and names this checkpoints folder: one holding a user's file (beside a trainer.pt, or a link
    named trainer.pt), or another run's checkpoint copied in, is left and named once; `.tmp-`
    folders go only under the name a save gives them."""
    other = trainer(data_dir, tmp_path, "checkpoint.every=2", "run.name=other")
    other.fit()
    tr = trainer(data_dir, tmp_path, "checkpoint.every=1", "checkpoint.keep_last=2")
    tr.fit()  # 4 steps: step_00000003 and step_00000004 kept
    ckpts = tr.checkpointer.dir
    shutil.copytree(other.checkpointer.dir / "step_00000002", ckpts / "step_00000002")
    mine = ckpts / "step_00000001"  # a user's folder, its trainer.pt a link
    mine.mkdir()
    (mine / "analysis.txt").write_text("notes")
    (mine / "trainer.pt").symlink_to(ckpts / "step_00000004" / "trainer.pt")
    noted = ckpts / "step_00000003"  # a checkpoint the user wrote a note into
    (noted / "notes.txt").write_text("the good one")
    (ckpts / ".tmp-step_notes").mkdir()
    (ckpts / ".tmp-step_notes" / "keep.txt").write_text("mine")
    (ckpts / ".tmp-step_00000009").mkdir()  # a killed save's
    caplog.set_level(logging.WARNING, logger="scale_llm")
    again = trainer(data_dir, tmp_path, "checkpoint.every=1", "checkpoint.keep_last=2",
                    "train.max_steps=6")  # fmt: skip
    assert again.step == 4
    again.fit()
    names = sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".scale-llm"))
    assert names == [".tmp-step_notes", "step_00000001", "step_00000002", "step_00000003",
                     "step_00000005", "step_00000006"]  # fmt: skip
    assert (mine / "analysis.txt").read_text() == "notes"
    assert (noted / "notes.txt").read_text() == "the good one"
    said = [r.getMessage() for r in caplog.records if "not pruning" in r.getMessage()]
    assert len(said) == 3 and all("it is left as it is" in m for m in said), said
    assert "step_00000002: its integrity record names another checkpoints folder" in said[1]


@pytest.mark.parametrize("claim", ["a claim without an id", "no claim"])
def test_checkpoints_saved_before_their_folder_had_an_id_are_pruned_as_the_runs(
    claim, data_dir, tmp_path
):
    """A run whose checkpoints were saved before the folder's claim held an id (integrity.json
    names no folder), or before it had a claim: its next launch gives them the id, so keep_last
    prunes them as before."""
    tr = trainer(data_dir, tmp_path, "checkpoint.every=1", "checkpoint.keep_last=4")
    tr.fit()
    ckpts = tr.checkpointer.dir
    run = json.loads((ckpts / ".scale-llm-run.json").read_text())["run"]
    if claim == "no claim":
        (ckpts / ".scale-llm-run.json").unlink()
    else:
        (ckpts / ".scale-llm-run.json").write_text(json.dumps({"run": run}))
    for step in ckpts.glob("step_*"):  # as such a save wrote them
        record = json.loads((step / "integrity.json").read_text())
        (step / "integrity.json").write_text(json.dumps({"files": record["files"]}))
    again = trainer(data_dir, tmp_path, "checkpoint.every=1", "checkpoint.keep_last=2",
                    "train.max_steps=6")  # fmt: skip
    again.fit()
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000005", "step_00000006"]
    assert json.loads((ckpts / ".scale-llm-run.json").read_text()).keys() == {"run", "id"}
    assert sorted(p.name for p in ckpts.iterdir() if "integrity" in p.name) == []  # (no temp)


def test_an_adoption_cut_short_is_finished_by_the_next_claim(tmp_path):
    """A launch killed while it gave its checkpoints the folder's new id left the claim marked
    `adopting`: the next claim keeps that id and gives it to the checkpoints still without."""
    from scale_llm.components.checkpoint import CLAIM, claim_folder, saved_into

    ckpts = tmp_path / "run" / "checkpoints"
    steps = [ckpts / f"step_0000000{i}" for i in (1, 2)]
    for step, record in zip(steps, [{"files": {}, "folder": "ab" * 16}, {"files": {}}]):
        step.mkdir(parents=True)
        (step / "integrity.json").write_text(json.dumps(record))
    run = str(tmp_path / "run")
    (ckpts / CLAIM).write_text(json.dumps({"run": run, "id": "ab" * 16, "adopting": True}))
    assert claim_folder(ckpts, run) == "ab" * 16
    assert [saved_into(step) for step in steps] == ["ab" * 16] * 2
    assert json.loads((ckpts / CLAIM).read_text()) == {"run": run, "id": "ab" * 16}


def test_loss_falls_on_real_text(data_dir, tmp_path):
    result = trainer(
        data_dir,
        tmp_path,
        "train.max_steps=60",
        "train.micro_batch_size=16",
        "train.lr=1e-2",
        "train.warmup_steps=6",
        "eval.every=60",
    ).fit()
    last = [result.losses[s] for s in range(51, 61)]
    assert sum(last) / len(last) < result.losses[1] - 1.0
    assert result.val_losses[60] < result.losses[1] - 1.0


def test_lr_schedule_warmup_then_cosine_to_min_lr():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 110))


def test_lr_schedules_linear_wsd_and_constant():
    base = dict(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    linear = TrainConfig(**base, lr_schedule="linear")
    assert [lr_at(s, linear) for s in (9, 10, 60, 110)] == pytest.approx([1.0, 1.0, 0.55, 0.1])
    constant = TrainConfig(**base, lr_schedule="constant")
    assert lr_at(0, constant) == pytest.approx(0.1) and lr_at(500, constant) == 1.0
    wsd = TrainConfig(**base, lr_schedule="wsd", decay_fraction=0.2)  # decays over 88..110
    assert all(lr_at(s, wsd) == 1.0 for s in range(10, 89))
    assert lr_at(99, wsd) == pytest.approx(0.55) and lr_at(110, wsd) == pytest.approx(0.1)
    # extending a wsd run before its decay leaves every LR so far unchanged; a cosine one not
    longer = dataclasses.replace(wsd, max_steps=300)
    assert all(lr_at(s, wsd) == lr_at(s, longer) for s in range(88))
    cosine = TrainConfig(**base)
    assert lr_at(50, cosine) != lr_at(50, dataclasses.replace(cosine, max_steps=300))


def test_a_resume_with_another_batch_says_the_curve_changes(data_dir, tmp_path, logs):
    """A resume with another micro-batch, grad_accum or world size continued in silence, on
    another curve than the checkpoint's settings give. It warns once, with both sizes; the
    same batch from other factors (micro 2 x accum 2 for micro 4) does not. The tokens trained
    count each step's own batch (they were tokens per step now x step), in the metrics row and
    the next checkpoint."""
    first = ["train.max_steps=6", "train.exit_at_step=2", "train.micro_batch_size=4"]
    finished_run(data_dir, tmp_path, *first)
    for change, warns in (
        (["train.micro_batch_size=2", "train.grad_accum=2"], False),
        (["train.micro_batch_size=8", "train.exit_at_step=3", "logging.every=1"], True),
    ):
        logs.records.clear()
        trainer = trainer_for(make_config(data_dir, tmp_path, "train.max_steps=6", *change))
        warned = [r.getMessage() for r in logs.records if "a step now takes" in r.getMessage()]
        assert trainer.step == 2 and len(warned) == warns, warned
        assert trainer.tokens(2) == 2 * 4 * 32
        if not warns:
            trainer.loader.close()
            trainer.lock.release()
    assert "not the 128 of the checkpoint's run (micro 8 x seq_len 32" in warned[0]
    from scale_llm.components.checkpoint import TRAINER_STATE
    from scale_llm.components.serialization import load_file

    trainer.fit()  # step 3: micro 8
    assert rows_of(tmp_path / "test")[3]["tokens"] == 2 * 4 * 32 + 8 * 32
    assert (
        load_file(tmp_path / "test" / "checkpoints" / "step_00000003" / TRAINER_STATE)["tokens"]
        == 2 * 4 * 32 + 8 * 32
    )


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_extending_a_run_warns_about_an_lr_jump_unless_the_schedule_extends(
    schedule, data_dir, tmp_path, logs
):
    """Issue 13: --train_steps 150 after 30 jumped the LR silently. Now a resume whose settings
    give another LR at that step warns once with both values; wsd before its decay does not."""

    first = ["train.max_steps=10", "train.exit_at_step=3", f"train.lr_schedule={schedule}"]
    finished_run(data_dir, tmp_path, *first)
    cfg = make_config(data_dir, tmp_path, "train.max_steps=30", f"train.lr_schedule={schedule}")
    trainer = trainer_for(cfg)
    trainer.loader.close()
    trainer.lock.release()
    assert trainer.step == 3
    warned = [r.getMessage() for r in logs.records if "LR schedule changed" in r.getMessage()]
    if schedule == "wsd":
        assert warned == []
    else:
        before = lr_at(3, TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, max_steps=10))
        assert len(warned) == 1 and "train.max_steps: 10 -> 30" in warned[0]
        assert f"not the {before:.3g}" in warned[0]


def test_no_weight_decay_on_norms_and_embeddings():
    from tests.test_model import small

    m = build_model(small(tie_embeddings=False))
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert "tok_embeddings.weight" not in decayed
    assert not any("norm" in n for n in decayed)
    assert "output.weight" in decayed and "layers.0.attention.wqkv.weight" in decayed
    assert no_decay["weight_decay"] == 0.0


def test_bench_runs_the_training_step_on_synthetic_tokens(tmp_path):
    from scale_llm.analysis.bench import bench

    cfg = make_config(tmp_path, tmp_path / "runs", "train.grad_accum=2")
    result = bench(cfg, plan_for(cfg), steps=2, warmup=1)
    assert result["tokens_per_step_per_rank"] == 4 * 32 * 2
    assert result["tokens_per_s_per_rank"] > 0 and result["ms_per_step"] > 0
    assert result["precision"] == "fp32" and "mfu" not in result  # no MFU without a known peak
    assert not (tmp_path / "runs").exists()  # bench writes nothing
    # bench's MFU and tokens/s per rank: a tensor- or pipeline-parallel group shares its tokens
    # (the whole micro-batch was counted on each rank: twice the MFU under tensor parallelism 2)
    from scale_llm.config.plan import target_plan

    for split in ("parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"):  # (8 ranks)
        untied = ("model.tie_embeddings=false", "model.n_layers=4")
        laid_out = make_config(tmp_path, tmp_path / "runs", "parallel.backend=fsdp", split, *untied)
        plan = target_plan(laid_out, 8)
        assert plan.tokens_per_step_per_rank * 8 == plan.tokens_per_step == 4 * 4 * 32, split


def test_each_bench_compiles_for_its_own_static_shapes(tmp_path, monkeypatch):
    """A process that measures one layout after another (the sweep, `scale-llm check`) compiles
    each as a fresh run would: with static shapes, not the dynamic ones torch.compile turns to
    when the same code meets a second shape (the recording backend stands in for inductor)."""
    from scale_llm.analysis.bench import bench

    graphs: list[list[str]] = []

    def recording(gm, example_inputs):
        graphs.append([type(x).__name__ for x in example_inputs])
        return gm.forward

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend=recording, **kw))
    for micro in (2, 3):
        cfg = make_config(
            tmp_path, tmp_path / "runs", "train.compile=true", f"train.micro_batch_size={micro}"
        )
        bench(cfg, plan_for(cfg), steps=1, warmup=0)
        assert graphs and all("SymInt" not in g for g in graphs), (micro, graphs)
        graphs.clear()


def test_every_generator_state_round_trips_through_a_checkpoint_file(tmp_path):
    import random

    import numpy as np

    from scale_llm.components.serialization import load_file, save_file
    from scale_llm.train import rng

    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    save_file({"rng": rng.gather_all_ranks()}, tmp_path / "state.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()  # move every generator on
    rng.restore_for_rank(load_file(tmp_path / "state.pt")["rng"], rank=0)  # weights_only load
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0])
    assert (got[1] == expected[1]).all() and got[2] == expected[2]


def test_bench_reference_runs_the_same_model_on_the_same_batch(tmp_path):
    from scale_llm.analysis.bench import bench_reference

    cfg = make_config(tmp_path, tmp_path / "runs", "train.grad_accum=2")
    result = bench_reference(cfg, plan_for(cfg), steps=1, warmup=0, rounds=1)
    # the same initial weights, batch and loss function: the same first loss, bit for bit (no
    # timing is asserted here)
    assert result["first_loss_framework"] == result["first_loss_reference"]
    assert result["ms_per_step_framework"] > 0 and result["ms_per_step_reference"] > 0
    # one round: its pair's ratio is the best-of ratio
    assert result["overhead_percent_median_of_rounds"] == pytest.approx(result["overhead_percent"])


def test_sweep_backends_name_their_config_and_refuse_what_the_launch_cannot_run():
    from scale_llm.analysis.bench import backend_changes

    # every entry but fsdp-tpN runs without tensor parallelism, whatever the config says
    plain = {"parallel.tensor_parallel": 1}
    assert backend_changes("fsdp", 2) == {"parallel.backend": "fsdp", **plain}
    zero3 = {"parallel.backend": "deepspeed", "parallel.deepspeed.zero_stage": 3, **plain}
    assert backend_changes("zero3", 2) == zero3
    assert backend_changes("single", 1) == {"parallel.backend": "single", **plain}
    with pytest.raises(UserError, match="--sweep-backend single: one process only, and this"):
        backend_changes("single", 2)
    with pytest.raises(UserError, match="--sweep-backend zero4: not a backend"):
        backend_changes("zero4", 1)
    tp2 = {"parallel.backend": "fsdp", "parallel.tensor_parallel": 2}
    assert backend_changes("fsdp-tp2", 4) == tp2
    with pytest.raises(UserError, match="fsdp-tp3: tensor parallelism 3 does not divide .* 4 "):
        backend_changes("fsdp-tp3", 4)
    with pytest.raises(UserError, match="use fsdp-tp2$"):
        backend_changes("fsdp-tp4", 2)


def _tp_of(cfg, plan):
    """1 without tensor parallelism, else what the config and the plan say of it."""
    if cfg.parallel.tensor_parallel == 1 and plan.tp_degree == 1:
        return 1
    mesh = plan.mesh
    return (cfg.parallel.tensor_parallel, plan.dp_degree, dict(zip(mesh["names"], mesh["shape"])))


def test_a_sweep_runs_the_plans_backend_unless_given_others(tmp_path, monkeypatch):
    """Without --sweep-backend a row runs what the launch resolved (`auto` is ddp under 2
    ranks), not the config's word for it."""
    import dataclasses

    import scale_llm.analysis.bench as bench_module
    import scale_llm.components.distributed as distributed

    seen = []
    monkeypatch.setattr(distributed, "start", lambda plan: None)
    monkeypatch.setattr(
        bench_module,
        "bench",
        lambda c, p, *_: seen.append((p.backend, _tp_of(c, p))) or {"ms_per_step": 1.0},
    )
    cfg = make_config(tmp_path, tmp_path / "runs")  # parallel.backend: auto
    plan = dataclasses.replace(  # as 2 ranks resolve it
        plan_for(cfg), backend="ddp", world_size=2, dp_degree=2
    )
    rows = bench_module.bench_sweep(cfg, plan, [2], ["none"], [False])
    rows += bench_module.bench_sweep(
        cfg, plan, [2], ["none"], [False], backends=["fsdp", "zero1", "fsdp-tp2"]
    )
    assert [b for b, _ in seen] == ["ddp", "fsdp", "deepspeed", "fsdp"]
    assert [r["backend"] for r in rows] == ["ddp", "fsdp", "zero1", "fsdp-tp2"]
    assert [tp for _, tp in seen] == [1, 1, 1, (2, 1, {"shard": 1, "tp": 2})]


def test_bench_interleaves_the_loops_in_turn_and_reverses_the_order_every_other_round():
    from scale_llm.analysis.bench import interleaved_times

    calls = []

    def loop(name):
        return lambda: calls.append(name) or torch.zeros(())

    times = interleaved_times({"a": loop("a"), "b": loop("b")}, 3, 2, torch.device("cpu"))
    assert calls == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]
    assert [len(t) for t in times.values()] == [3, 3] and min(times["a"] + times["b"]) > 0


def test_the_median_interval_brackets_the_median_and_narrows_with_rounds():
    """bench --reference's bootstrap 95% interval of the median of the rounds' ratios."""
    import statistics

    from scale_llm.analysis.bench import median_interval

    assert median_interval([1.02] * 5) == (1.02, 1.02)
    noisy = [1.0 + 0.01 * ((7 * i) % 11 - 5) for i in range(11)]  # 0.95 .. 1.05, median 1.0
    low, high = median_interval(noisy)
    assert low < statistics.median(noisy) < high and low >= 0.95 and high <= 1.05
    assert median_interval(noisy) == (low, high)  # a fixed seed: reproducible from the rounds
    low4, high4 = median_interval(noisy * 4)  # the same spread, 4x the rounds
    assert low <= low4 < high4 <= high and high4 - low4 < high - low
    shifted = median_interval([x + 0.1 for x in noisy * 4])
    assert shifted[0] > high4  # a 10% change is outside the interval of the first


def test_the_gpt2_reference_is_a_flop_matched_gpt2_and_learns(tmp_path):
    """bench --reference gpt2: the stand-in for the single-file trainers is what it says (a
    GPT-2 block layout, FLOPs counted as the trainer counts them, by hand here) and trains."""
    from torch.utils.flop_counter import FlopCounterMode

    from scale_llm.analysis.bench import GPT2Reference, bench_reference, reference_step

    V, d, L, H, T = 512, 32, 2, 4, 32
    g = GPT2Reference(V, d, L, H, T)
    assert g.flops_per_token() == 6 * (L * 12 * d * d + V * d) + 12 * L * d * T
    assert sorted(n for n, _ in g.layers[0].named_children()) == [
        "c_attn",
        "c_fc",
        "c_proj",
        "ln_1",
        "ln_2",
        "mlp_proj",
    ]
    x = torch.randint(0, V, (3, T + 1))
    with FlopCounterMode(display=False) as counter:  # it counts no CPU flash attention: matmuls
        torch.nn.functional.cross_entropy(g(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    assert counter.get_total_flops() == (g.flops_per_token() - 12 * L * d * T) * 3 * T
    g.zero_grad()
    opt = torch.optim.AdamW(g.parameters(), lr=1e-2)
    batch = [(x[:, :-1], x[:, 1:])]
    first = reference_step(g, opt, batch, 1.0).item()
    for _ in range(5):
        last = reference_step(g, opt, batch, 1.0).item()
    assert last < first - 0.5  # it memorizes one batch

    cfg = make_config(tmp_path, tmp_path / "runs")
    result = bench_reference(cfg, plan_for(cfg), steps=1, warmup=0, rounds=1, kind="gpt2")
    assert result["reference"] == "gpt2" and result["model_tflops_reference"] > 0
    assert result["first_loss_reference"] == pytest.approx(math.log(512), abs=0.3)


def test_peak_flops_tell_the_gpu_models_apart():
    from scale_llm.components.hardware import peak_flops, peak_for_name

    assert peak_for_name("NVIDIA H100 80GB HBM3", "bf16") == 989e12  # SXM
    assert peak_for_name("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_for_name("NVIDIA H100 NVL", "bf16") == 835e12
    assert peak_for_name("NVIDIA H200", "fp32") == 67e12
    assert peak_for_name("NVIDIA H200 NVL", "bf16") == 835e12
    assert peak_for_name("NVIDIA A100-SXM4-40GB", "bf16") == 312e12
    assert peak_for_name("NVIDIA L4", "bf16") == 121e12  # not taken for an L40S
    assert peak_for_name("NVIDIA L40S", "bf16") == 362e12
    assert peak_for_name("NVIDIA L40", "bf16") == 181e12  # not the L4's
    assert peak_for_name("AMD Instinct MI300X", "bf16") == 1307e12
    assert peak_for_name("Some Future GPU", "bf16") is None
    cpu = torch.device("cpu")
    assert peak_flops(cpu, "fp32") is None
    assert peak_flops(cpu, "fp32", override_tflops=1.5) == 1.5e12


def test_a_fused_adamw_skips_a_non_finite_step_on_the_device():
    """The CUDA path (fused AdamW gets the verdict as a tensor: no host sync), run with the
    CPU's fused AdamW: a finite step equals the foreach step, a non-finite one changes nothing."""
    from scale_llm.components.optim import step_if_finite

    torch.manual_seed(0)
    weights = [torch.randn(4, 3), torch.randn(5)]
    grads = [torch.randn(4, 3), torch.randn(5)]
    results = {}
    for fused in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = torch.optim.AdamW(params, lr=0.1, **({"fused": True} if fused else {"foreach": True}))
        for p, g in zip(params, grads):
            p.grad = g.clone()
        step_if_finite(opt, torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
        results[fused] = [p.detach().clone() for p in params]
        before = [p.detach().clone() for p in params]
        params[0].grad = torch.full((4, 3), float("nan"))
        step_if_finite(opt, torch.tensor(float("nan")))
        assert all(torch.equal(p, b) for p, b in zip(params, before)), fused
        assert not hasattr(opt, "found_inf")
    for a, b in zip(results[False], results[True]):
        torch.testing.assert_close(a, b)


def test_tensorboard_never_shows_a_step_twice(data_dir, tmp_path, monkeypatch):
    """A resume from an older checkpoint and a fresh restart in the same run dir: the event
    files, read back by TensorBoard's EventAccumulator, hold each step once and in order. The
    process's event files numbered from 8 (torch names them by second and number): at the
    resume a history rewritten into a file of its own (9) was read after the launch's (10)."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    count = event_file_writer.AtomicCounter(8)  # (the first launch's file: 8)
    monkeypatch.setattr(event_file_writer, "_global_uid", count)

    def steps(run_dir):
        acc = EventAccumulator(str(run_dir / "tensorboard"))
        acc.Reload()
        return [e.step for e in acc.Scalars("loss/loss")]

    tb = ["logging.tensorboard=true", "checkpoint.every=2"]
    first = trainer(data_dir, tmp_path, *tb).fit()
    assert steps(first.run_dir) == [1, 2, 3, 4]
    shutil.rmtree(first.run_dir / "checkpoints" / "step_00000004")  # back to step 2
    resumed = trainer(data_dir, tmp_path, *tb)
    assert resumed.step == 2
    resumed.fit()
    assert steps(first.run_dir) == [1, 2, 3, 4]
    shutil.rmtree(first.run_dir / "checkpoints")  # a fresh start in the same run dir
    trainer(data_dir, tmp_path, *tb, "train.max_steps=3").fit()
    assert steps(first.run_dir) == [1, 2, 3]
    rows = [json.loads(x) for x in (first.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


KEPT_MEMORY_PROBE = """
import ctypes, resource, torch
from scale_llm.components.hardware import keep_freed_cpu_memory
class Info(ctypes.Structure):  # glibc's struct mallinfo2 (2.33 and newer)
    _fields_ = [(f, ctypes.c_size_t) for f in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
kept = keep_freed_cpu_memory()
mapped = []  # bytes glibc serves from their own mmap while each 64 MiB tensor lives
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):  # what a step does with its logits: 64 MiB made, touched and freed, again
    before = libc.mallinfo2().hblkhd
    t = torch.empty(16 << 20)
    t.fill_(1.0)
    mapped.append(libc.mallinfo2().hblkhd - before)
    del t
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(kept, max(mapped), libc.mallinfo2().fordblks, faults)
"""


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc"
    or tuple(map(int, platform.libc_ver()[1].split(".")[:2])) < (2, 33),
    reason="mallopt is glibc's; mallinfo2 is 2.33's",
)
def test_a_cpu_run_keeps_the_memory_it_frees():
    """keep_freed_cpu_memory (called by every CPU run's start): a 64 MiB tensor comes from the
    heap and its memory stays there when it is freed, for the next one; opted out with
    SCALE_LLM_CPU_MALLOC=system, glibc's default maps each one fresh and unmaps it (8 x 16,384
    page faults). How many faults the kept heap takes depends on where the tensors' small
    objects land (0 to 4 regrowths seen), so only glibc's own counts are asserted for it."""
    import subprocess
    import sys

    from tests.helpers import env

    def probe(**extra: str) -> tuple[str, int, int, int]:
        kept, mapped, free, faults = subprocess.run(
            [sys.executable, "-c", KEPT_MEMORY_PROBE],
            env={**env(), **extra},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        return kept, int(mapped), int(free), int(faults)

    mib = 1 << 20
    kept, mapped, free, _ = probe()
    assert kept == "True" and mapped < mib, mapped  # served from the heap
    assert free >= 64 * mib, free  # and kept in it once freed
    kept, mapped, free, faults = probe(SCALE_LLM_CPU_MALLOC="system")
    assert kept == "False" and mapped >= 64 * mib and free < 64 * mib, (mapped, free)
    assert faults > 8 * 16_384 * 0.9, faults  # every one from fresh pages


@pytest.mark.parametrize("every", [0, 2])
def test_no_automatic_garbage_collection_runs_inside_a_step(data_dir, tmp_path, every):
    """Each step makes thousands of reference cycles (Python's automatic collector would run
    several times a step); with train.gc_every the only collections are the loop's own, at the
    end of every gc_every-th step and before checkpoints; afterwards gc is on again."""
    import gc

    tr = trainer(data_dir, tmp_path, "train.max_steps=4", f"train.gc_every={every}")
    forward = tr.model.forward

    def littering(*args, **kwargs):
        for _ in range(5000):
            cycle: list = []
            cycle.append(cycle)
        return forward(*args, **kwargs)

    tr.model.forward = littering
    seen = []

    def witness(phase, info):  # (ours?, automatic collection on?)
        if phase == "start":
            seen.append((tr.collector.collecting, gc.isenabled()))

    gc.callbacks.append(witness)
    try:
        tr.fit()
    finally:
        gc.callbacks.remove(witness)
    assert gc.isenabled()
    if every:
        # at the start (2), after steps 2 and 4 (1), before the checkpoint at step 4 (2); then
        # only once training is over (gc on again) may Python's own run
        n = next((i for i, (_, on) in enumerate(seen) if on), len(seen))
        assert seen[:n] == [(True, False)] * 4 and all(on for _, on in seen[n:]), seen
    else:
        assert len(seen) > 8 and not any(ours for ours, _ in seen)  # Python's own, mid-step


def test_mfu_is_reported_with_its_causal_figure(data_dir, tmp_path):
    """MFU counts attention whole, as the convention does; mfu_causal the half a causal kernel
    computes: both in every logged row, in the ratio of their FLOP counts."""
    tr = trainer(data_dir, tmp_path, "train.max_steps=2", "logging.peak_tflops=1")
    tr.fit()
    rows = [json.loads(x) for x in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]
    model = build_model(tr.cfg.model)
    ratio = model.flops_per_token(causal=True) / model.flops_per_token()
    assert ratio < 1
    for row in rows:
        assert row["mfu"] > 0 and row["mfu_causal"] == pytest.approx(row["mfu"] * ratio)


def test_the_eta_leaves_out_a_launchs_first_steps():
    """A first step of 60 s (compiling) then 1 s steps: the ETA is 1 s a step from the third
    step on (it was the mean over all steps, 60x too long at first); tokens/s is the window's."""
    from scale_llm.train.throughput import Throughput

    now = [0.0]
    clock = Throughput(tokens_per_step=1000, max_steps=100, start_step=0, clock=lambda: now[0])
    times = [60.0, 1.0, 1.0, 1.0]
    for step, seconds in enumerate(times, start=1):
        now[0] += seconds
        clock.step_done(step)
        if step <= 2:
            assert clock.eta(step) is None and clock.progress(step).endswith("eta ?")
    assert clock.eta(4) == pytest.approx(96.0)  # 2 settled steps of 1 s, 96 left
    assert clock.progress(4) == "elapsed 1m03s | eta 1m36s"
    assert clock.tokens_per_s(4) == pytest.approx(4000 / 63)
    clock.row_written(4)
    now[0] += 2.0
    assert clock.tokens_per_s(6) == pytest.approx(1000.0)  # since the row at step 4


def step_clock(monkeypatch, cls: type, name: str, seconds: float) -> None:
    """A loop clock that only the steps (1 s each) and `cls.name`'s calls (`seconds` each; a
    callback's, handed the trainer: only at a checkpoint's step) move."""
    from scale_llm.train import throughput, trainer

    now = [0.0]

    class Clock(throughput.Throughput):
        def __init__(self, *args):
            super().__init__(*args, clock=lambda: now[0])

    step, work = Trainer.train_step, getattr(cls, name)

    def timed_step(self):
        now[0] += 1.0
        return step(self)

    def timed_work(self, *args):
        at_step = args and isinstance(args[0], Trainer)  # (a callback's: trainer, step end)
        if not at_step or args[0].cadence.checkpoints(args[1].step):
            now[0] += seconds
        return work(self, *args)

    monkeypatch.setattr(trainer, "Throughput", Clock)
    monkeypatch.setattr(Trainer, "train_step", timed_step)
    monkeypatch.setattr(cls, name, timed_work)


def test_tokens_per_s_leaves_out_every_save(data_dir, tmp_path, monkeypatch):
    """A save was charged to the next row (its tokens/s and MFU dipped after every checkpoint),
    while an evaluation was left out: now both are, at a logged step or between two (saves at
    steps 2 and 4, rows at 1 and 4). A clock that only the steps (1 s each) and the saves (100
    s each) move."""
    step_clock(monkeypatch, Trainer, "save_checkpoint", 100.0)
    for every, logged in ((2, (2, 4)), (4, (1, 4))):
        settings = [f"logging.every={every}", "checkpoint.every=2"]
        t = trainer_for(make_config(data_dir, tmp_path / str(every), *settings))
        t.fit()
        rows = rows_of(t.run_dir)
        per_step = t.plan.tokens_per_step
        assert [rows[n]["tokens_per_s"] for n in logged] == [per_step / 1.0] * 2, every
        assert sorted(rows) == sorted({1, *logged}), every


def test_tokens_per_s_leaves_out_the_profilers_trace_writing(data_dir, tmp_path, monkeypatch):
    """train.profile's trace, written after its last step (100 s on this clock), was charged to
    the next row: tokens/s fell by half on a CPU, MFU with it. On a logged step or any other."""
    from scale_llm.train import profiling

    step_clock(monkeypatch, profiling.StepProfiler, "_write_trace", 100.0)
    for last in (3, 4):  # (a step between rows; a row's)
        traced = [f"train.profile.start_step={last}", "train.profile.warmup_steps=0"]
        traced += ["train.profile.enabled=true", "train.profile.active_steps=1"]
        settings = ["logging.every=2", "train.max_steps=6", *traced]
        t = trainer_for(make_config(data_dir, tmp_path / str(last), *settings))
        t.fit()
        rows = rows_of(t.run_dir)
        assert (t.run_dir / "profile" / f"rank0_steps{last}-{last}.pt.trace.json").is_file()
        per_step = t.plan.tokens_per_step
        assert [rows[n]["tokens_per_s"] for n in (2, 4, 6)] == [per_step / 1.0] * 3, last


def test_a_run_stopped_by_bad_steps_at_a_save_says_so_in_its_last_row(data_dir, tmp_path):
    """A stop found by a checkpoint's save (not a logged step) wrote {"stopped": "diverged"}
    alone, and `runs` showed step 1's loss as the run's."""
    from scale_llm.train.guards import TrainingDiverged
    from scale_llm.train.runs import list_runs

    settings = ["train.max_steps=20", "train.max_bad_steps=3", "checkpoint.every=1"]
    tr = trainer(data_dir, tmp_path, *settings, "logging.every=100")
    poison(tr, set(range(4, 20)))
    with pytest.raises(TrainingDiverged):
        tr.fit()
    rows = rows_of(tr.run_dir)
    assert rows[tr.step] == {"step": tr.step, "skipped_steps": 3, "stopped": "diverged"}
    (summary,) = list_runs(tr.run_dir.parent)
    assert summary.status == "diverged" and summary.loss is None


def test_the_cadence_of_logging_eval_samples_and_checkpoints():
    from scale_llm.train.cadence import Cadence

    cfg = load_config(
        None,
        [
            "train.max_steps=12",
            "logging.every=5",
            "eval.every=4",
            "eval.sample_every=6",
            "checkpoint.every=8",
            "train.exit_at_step=7",
        ],
    )
    c = Cadence(cfg, start_step=2)  # resumed at step 2: step 3 is this launch's first
    steps = range(3, 13)
    assert [s for s in steps if c.logs(s)] == [3, 5, 10, 12]
    assert [s for s in steps if c.evaluates(s)] == [4, 8, 12]
    assert [s for s in steps if c.samples(s)] == [6, 12]
    assert [s for s in steps if c.checkpoints(s)] == [8, 12]
    assert [s for s in steps if c.syncs(s)] == [3, 4, 5, 7, 8, 10, 12]


def test_every_callback_ends_when_one_of_them_fails(data_dir, tmp_path):
    """A callback whose end raises (a background save that failed, say) does not keep the
    others from ending: Python's garbage collector is on again, and the error is raised."""
    import gc

    from scale_llm.train.callbacks import Callback

    class Failing(Callback):
        def end(self, trainer, failing):
            raise OSError("no space left on device")

    tr = trainer(data_dir, tmp_path, "train.max_steps=2", "train.gc_every=2")
    tr.callbacks.append(Failing())
    with pytest.raises(OSError, match="no space left"):
        tr.fit()
    assert gc.isenabled()
