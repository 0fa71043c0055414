"""Artifacts that are good are taken as they are: a checkpoint the user names through a
symlink (its target checked),
a good trainer state and a good export; eval reuses an export, and merges a record, only for
the same checkpoint bytes. (Damaged, foreign or impossible artifacts: tests/test_errors.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from scale_llm import files
from scale_llm.cli import main
from scale_llm.components.checkpoint import INTEGRITY, damage
from scale_llm.components.serialization import load_file, save_file
from scale_llm.errors import UserError
from scale_llm.train.trainer import Trainer
from tests.helpers import (
    REPO,
    copy_run,
    finished_run,
    make_config,
    rewrite_state,
    stub_eval_tasks,
    trainer_for,
    tree,
)

STEP2, STEP4 = "step_00000002", "step_00000004"


def resume_auto(data_dir: Path, tmp_path: Path, *overrides: str) -> Trainer:
    cfg = make_config(
        data_dir, tmp_path / "runs", "checkpoint.every=2", "train.max_steps=6", *overrides
    )
    return trainer_for(cfg)


# ----------------------------------------------------------------------------- 1: no record


def test_a_checkpoint_without_its_record_is_damaged_mark_or_not(four_steps, data_dir, tmp_path):
    """A checkpoint without integrity.json, its trainer.pt's mark removed too, was taken as one
    from before records (no trainer-state format this reads was ever saved without one): its
    files were never checked. auto now falls back to the older checkpoint."""
    run = copy_run(four_steps, tmp_path)
    ckpt = run / "checkpoints" / STEP4
    state = load_file(ckpt / "trainer.pt")
    del state["integrity"]
    save_file(state, ckpt / "trainer.pt")
    (ckpt / INTEGRITY).unlink()
    assert "integrity.json is missing" in damage(ckpt)
    tr = resume_auto(data_dir, tmp_path)
    assert tr.step == 2
    tr.lock.release()


# ----------------------------------------------------------------------------- 2: symlinks


def test_a_named_symlink_is_followed_and_its_target_checked(four_steps, data_dir, tmp_path, capsys):
    """checkpoint.resume=LINK: the user named it, so it is read where it points; the checks
    of the checkpoint itself (its name against its step) apply to the target."""
    other = copy_run(four_steps, tmp_path, "other")
    run = copy_run(four_steps, tmp_path)
    link = tmp_path / "chosen"
    link.symlink_to(other / "checkpoints" / STEP2)
    tr = resume_auto(data_dir, tmp_path, f"checkpoint.resume={link}")
    assert tr.step == 2 and tr.resume_from == (other / "checkpoints" / STEP2).resolve()
    tr.lock.release()
    rewrite_state(other / "checkpoints" / STEP2, step=4)  # a target whose step is not its name
    before = tree(run / "checkpoints")
    with pytest.raises(UserError, match="step: 4, but the directory step_00000002 is step 2"):
        resume_auto(data_dir, tmp_path, f"checkpoint.resume={link}")
    assert tree(run / "checkpoints") == before


# ----------------------------------------------------------------------------- 3: trainer state


def test_a_good_trainer_state_reads_back(four_steps):
    from scale_llm.components.checkpoint import read_trainer_state

    state = read_trainer_state(four_steps / "checkpoints" / STEP4)
    assert state["step"] == 4 and state["integrity"] is True


# ----------------------------------------------------------------------------- 4: init_from


def init_model(data_dir: Path, tmp_path: Path, folder: Path):
    return replace(make_config(data_dir, tmp_path).model, init_from=str(folder))


def test_a_good_export_still_inits(exported, data_dir, tmp_path):
    from tests.helpers import init_weights

    state = init_weights(init_model(data_dir, tmp_path, exported), None)
    assert all(t.dtype == torch.float32 for t in state.values())


# ----------------------------------------------------------------------------- 5: eval


def branch_run(data_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A run to step 4 (checkpoint every step); returns (run dir, step 2's checkpoint)."""
    common = ["train.max_steps=4", "checkpoint.every=1", "checkpoint.keep_last=5"]
    run = finished_run(data_dir, tmp_path / "runs", *common)
    return run, run / "checkpoints" / STEP2


def test_eval_reuses_an_export_only_of_the_same_checkpoint_bytes(data_dir, tmp_path):
    """After a branch (a resume from step 2 trains to step 4 again, with another LR), eval
    scored the export of the abandoned step 4: it was reused because the path matched."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file as load_st

    from scale_llm.evaluate import export_for_eval

    run, step2 = branch_run(data_dir, tmp_path)
    ckpt = run / "checkpoints" / STEP4
    first = export_for_eval(ckpt, run)
    made = (first / "config.json").stat().st_ino
    assert export_for_eval(ckpt, run) == first  # the same bytes: reused
    assert (first / "config.json").stat().st_ino == made
    old = load_st(first / "model.safetensors")["model.norm.weight"]
    common = ["train.max_steps=4", "checkpoint.every=1", "checkpoint.keep_last=5"]
    cfg = make_config(
        data_dir, tmp_path / "runs", *common, "train.lr=5e-3", f"checkpoint.resume={step2}"
    )
    trainer_for(cfg).fit()
    assert export_for_eval(ckpt, run) == first
    assert (first / "config.json").stat().st_ino != made
    assert not torch.equal(load_st(first / "model.safetensors")["model.norm.weight"], old)
    assert [p.name for p in first.parent.iterdir()] == [STEP4]  # nothing left over
    from scale_llm.components.checkpoint import checkpoint_digest

    info = json.loads((first / "scale_llm_export.json").read_text())
    assert info["checkpoint_digest"] == checkpoint_digest(ckpt) and info["made_by"]
    # a file gone, or one edited (another model): eval no longer scores it, nor replaces it
    weights = first / "model.safetensors"
    weights.rename(tmp_path / "aside.safetensors")
    with pytest.raises(UserError, match="lists model.safetensors, which is gone, so eval cannot"):
        export_for_eval(ckpt, run)
    (tmp_path / "aside.safetensors").rename(weights)
    config = first / "config.json"
    edited = {**json.loads(config.read_text()), "rms_norm_eps": 0.5}
    config.write_text(json.dumps(edited))
    with pytest.raises(UserError, match="these checkpoint bytes, but config.json changed after"):
        export_for_eval(ckpt, run)
    assert json.loads(config.read_text()) == edited


@pytest.fixture
def evaluated(four_steps, tmp_path, monkeypatch):
    """A copy of the run whose lm-eval tasks are stubbed (the export is real)."""
    run = copy_run(four_steps, tmp_path)
    return run, stub_eval_tasks(monkeypatch)


def test_eval_prints_only_this_calls_results_and_names_the_merged_file(evaluated, data_dir, capsys):
    """A second eval printed the first one's results too, as if they were new."""
    run, _ = evaluated
    assert main(["eval", str(run), "--perplexity", str(data_dir), "--limit", "2"]) == 0
    assert "perplexity on" in capsys.readouterr().out
    assert main(["eval", str(run), "--tasks", "fake_task"]) == 0
    out = capsys.readouterr().out
    assert "fake_task: acc 0.2500" in out and "perplexity on" not in out
    record = run / "eval" / f"{STEP4}.json"
    assert f"are kept in {record}: perplexity; written 20" in out  # (and when: a UTC time)
    merged = json.loads(record.read_text())
    assert set(merged["tasks"]) == {"fake_task"} and "perplexity" in merged


HOLD_EVAL_LOCK = """import sys, time
from pathlib import Path
from scale_llm.files import OwnerLock
lock = OwnerLock(Path(sys.argv[1]), "an eval", "wait")
lock.acquire()
print("held", flush=True)
for _ in range(600):  # until the other eval says it waits (or 60 s)
    if Path(sys.argv[3]).exists():
        break
    time.sleep(0.1)
Path(sys.argv[2]).write_text(repr(time.time()))
lock.release()
"""


def test_a_second_eval_of_a_run_waits_and_each_tasks_settings_are_kept(
    evaluated, data_dir, tmp_path, capsys, monkeypatch
):
    """Two evals of one run at once: each read the record, and the later write dropped the
    earlier's results; tasks scored with another --limit were recorded under the last call's."""
    run, _ = evaluated
    assert main(["eval", str(run), "--tasks", "a_task", "--limit", "3"]) == 0
    assert main(["eval", str(run), "--tasks", "b_task"]) == 0
    record = run / "eval" / f"{STEP4}.json"
    by_task = json.loads(record.read_text())["lm_eval"]["by_task"]
    assert by_task["a_task"]["limit"] == 3 and by_task["b_task"]["limit"] is None
    released, waits = tmp_path / "released", tmp_path / "waits"
    lock = str(run / "eval" / ".eval.lock")
    argv = [sys.executable, "-c", HOLD_EVAL_LOCK, lock, str(released), str(waits)]
    holder = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"  # another eval of the run is under way
    capsys.readouterr()
    said = files.log.info
    monkeypatch.setattr(  # (the holder lets go once this eval says it waits)
        files.log, "info", lambda *a, **k: said(*a, **k) or ("waiting" in a[0] and waits.touch())
    )
    assert main(["eval", str(run), "--perplexity", str(data_dir), "--limit", "2"]) == 0
    assert holder.wait(timeout=60) == 0
    said = "".join(capsys.readouterr())
    assert "eval: another eval of this run (pid" in said and "is running; waiting" in said
    assert record.stat().st_mtime >= float(released.read_text())  # written after it ended
    merged = json.loads(record.read_text())
    assert set(merged["tasks"]) == {"a_task", "b_task"} and "perplexity" in merged
    assert not (run / "eval" / ".eval.lock").exists()


def test_an_eval_run_again_shows_each_step_once_in_tensorboard(evaluated, data_dir, capsys):
    """Each eval of a checkpoint added its scalars to TensorBoard: a second --perplexity of
    step 4 drew two values at step 4, the record keeping only the newer."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = evaluated
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("tensorboard: false", "tensorboard: true"))
    for argv in (["--perplexity", str(data_dir), "--limit", "2"], ["--tasks", "fake_task"]):
        assert main(["eval", str(run), *argv]) == 0
    mine = run / "tensorboard" / "mine.txt"
    mine.write_text("a file of the user's")
    assert main(["eval", str(run), "--perplexity", str(data_dir), "--limit", "4"]) == 0
    record = json.loads((run / "eval" / f"{STEP4}.json").read_text())
    (events_file,) = (run / "tensorboard").glob("*scale-llm-eval*")
    assert record["tensorboard_file"] == events_file.name and mine.is_file()
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    (ppl,) = events.Scalars("eval/perplexity/loss")
    assert ppl.step == 4 and ppl.value == pytest.approx(record["perplexity"]["loss"])
    assert [e.value for e in events.Scalars("eval/fake_task/acc")] == [0.25]  # (kept)
    # an earlier record's values that are no numbers (edited): left out of the charts, and
    # this call's results written (a KeyError traceback lost them, after all the work)
    edited = {**record, "perplexity": {"loss": "x"}, "tasks": {"old": {"acc": "high"}}}
    (run / "eval" / f"{STEP4}.json").write_text(json.dumps(edited))
    assert main(["eval", str(run), "--tasks", "fake_task"]) == 0
    kept = json.loads((run / "eval" / f"{STEP4}.json").read_text())
    assert kept["tasks"]["fake_task"] == {"acc": 0.25} and kept["tasks"]["old"] == {"acc": "high"}


def test_an_earlier_records_lm_eval_settings_are_checked_before_any_work(evaluated, capsys):
    """An earlier record of these bytes whose lm_eval was no {by_task: {task: settings}} (edited)
    was an AttributeError traceback after the export was made and the tasks had run; it is
    refused before either, naming the record and its lm_eval."""
    run, calls = evaluated
    assert main(["eval", str(run), "--tasks", "fake_task"]) == 0
    path = run / "eval" / f"{STEP4}.json"
    record = json.loads(path.read_text())
    (run / "export" / STEP4).rename(run / "aside")
    calls.clear()
    for lm_eval in ("broken", {"by_task": ["fake_task"]}, {"by_task": {"fake_task": 3}}):
        path.write_text(json.dumps({**record, "lm_eval": lm_eval}))
        assert main(["eval", str(run), "--tasks", "b_task"]) == 2
        err = capsys.readouterr().err
        assert f"error: {path}: its lm_eval is not {{version" in err and "Traceback" not in err
        assert "move it away and run eval again" in err
        assert calls == [] and not (run / "export" / STEP4).exists()


def test_a_nan_loss_or_score_is_recorded_as_json(evaluated, data_dir, monkeypatch, capsys):
    """A NaN held-out loss (a diverged model) was written to the record as a bare NaN, which
    is no JSON (ppl beside it was "nan"), and a task's NaN score too. They are written as
    "nan" / "inf", as metrics.jsonl writes them, and read back by a later eval (its record
    and TensorBoard's scalars)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import scale_llm.evaluate as evaluate

    run, _ = evaluated
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("tensorboard: false", "tensorboard: true"))
    monkeypatch.setattr(evaluate, "cross_entropy", lambda *a: torch.tensor(float("nan")))
    scores = {"fake_task": {"acc": float("nan"), "acc_stderr": float("inf")}}
    monkeypatch.setattr(evaluate, "run_tasks", lambda *a, **k: scores)
    argv = ["eval", str(run), "--tasks", "fake_task", "--perplexity", str(data_dir)]
    assert main([*argv, "--limit", "2"]) == 0
    assert "fake_task: acc nan" in capsys.readouterr().out
    path = run / "eval" / f"{STEP4}.json"

    def strict(text: str) -> dict:
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the record"))

    record = strict(path.read_text())
    assert record["perplexity"]["loss"] == "nan" and record["perplexity"]["ppl"] == "nan"
    assert record["tasks"]["fake_task"] == {"acc": "nan", "acc_stderr": "inf"}
    monkeypatch.undo()  # a later eval of the same bytes keeps them
    stub_eval_tasks(monkeypatch)
    assert main(["eval", str(run), "--perplexity", str(data_dir), "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "loss nan" not in out and "kept in" in out
    record = strict(path.read_text())
    assert record["tasks"]["fake_task"]["acc"] == "nan"
    assert isinstance(record["perplexity"]["loss"], float)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    (acc,) = events.Scalars("eval/fake_task/acc")
    assert acc.step == 4 and acc.value != acc.value  # (NaN)


def test_a_perplexity_past_float64_is_recorded_as_inf():
    """exp(loss) of a diverged model (loss 800): an OverflowError traceback, the record lost."""
    from scale_llm.evaluate import _scores, format_record, perplexity_scalars

    scores = _scores(2, 800.0, 64)
    assert scores["ppl"] == "inf"
    record = {"step": 4, "checkpoint": "c", "perplexity": {"data_dir": "d", **scores}}
    assert "loss 800.0000, ppl inf" in format_record(record)
    assert perplexity_scalars(record["perplexity"])["eval/perplexity/ppl"] == float("inf")
    assert _scores(2, 2.0, 64)["ppl"] == pytest.approx(7.389056)


def test_eval_sets_aside_a_record_of_other_weights(evaluated, data_dir, capsys):
    run, _ = evaluated
    (run / "eval").mkdir()
    old = {"step": 4, "checkpoint": "x", "tasks": {"abandoned": {"acc": 1.0}}}
    (run / "eval" / f"{STEP4}.json").write_text(json.dumps(old))
    capsys.readouterr()
    assert main(["eval", str(run), "--tasks", "fake_task"]) == 0
    assert "held results of other weights" in capsys.readouterr().out  # (the CLI's log)
    merged = json.loads((run / "eval" / f"{STEP4}.json").read_text())
    assert set(merged["tasks"]) == {"fake_task"}
    (kept,) = (run / "eval").glob("step_00000004.other-weights-*.json")
    assert json.loads(kept.read_text()) == old
    # a file of the user's there, not eval's record: it was set aside (renamed) as one
    mine = run / "eval" / f"{STEP4}.json"
    mine.write_text('{"my_notes": "hand-written"}')
    assert main(["eval", str(run), "--tasks", "fake_task"]) == 2
    assert "is not a record eval wrote (it names no checkpoint and step)" in capsys.readouterr().err
    assert mine.read_text() == '{"my_notes": "hand-written"}'
    assert len(list((run / "eval").iterdir())) == 2


def test_a_record_of_other_weights_set_aside_takes_its_scalars_out_of_tensorboard(
    evaluated, capsys
):
    """A record of other weights was set aside, but the event file it named stayed: TensorBoard
    drew step 4 twice, with the other weights' task scores. Their file goes (their numbers
    stay in the record set aside); a file the record names that eval did not write stays."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = evaluated
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("tensorboard: false", "tensorboard: true"))
    assert main(["eval", str(run), "--tasks", "abandoned"]) == 0
    path = run / "eval" / f"{STEP4}.json"
    old = {**json.loads(path.read_text()), "checkpoint_digest": "of other weights"}
    path.write_text(json.dumps(old))
    assert main(["eval", str(run), "--tasks", "fake_task"]) == 0
    (kept,) = (run / "eval").glob("step_00000004.other-weights-*.json")
    assert json.loads(kept.read_text()) == old  # (the numbers, and the file it named)
    (events_file,) = (run / "tensorboard").glob("*scale-llm-eval*")
    assert json.loads(path.read_text())["tensorboard_file"] == events_file.name
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["eval/fake_task/acc"]
    assert [(e.step, e.value) for e in events.Scalars("eval/fake_task/acc")] == [(4, 0.25)]
    mine = run / "tensorboard" / "mine.txt"
    mine.write_text("a file of the user's")
    path.write_text(json.dumps({**old, "tensorboard_file": "mine.txt"}))
    assert main(["eval", str(run), "--tasks", "fake_task"]) == 0
    assert mine.is_file() and len(list((run / "eval").glob("*.other-weights-*.json"))) == 2


def test_eval_checks_perplexitys_data_and_its_exports_dtype_before_any_work(
    evaluated, data_dir, capsys
):
    """--perplexity with no data there was refused after the export and the tasks had run
    (their scores lost); a dtype edited in eval's export info (its file stats do not cover
    the info itself) was a KeyError traceback."""
    run, calls = evaluated
    argv = ["eval", str(run), "--tasks", "fake_task"]
    assert main([*argv, "--perplexity", str(run / "nowhere")]) == 2
    assert "holds no prepared shards" in capsys.readouterr().err
    assert calls == [] and not (run / "export").exists()
    assert main(argv) == 0
    info = run / "export" / STEP4 / "scale_llm_export.json"
    info.write_text(info.read_text().replace('"dtype": "fp32"', '"dtype": "float64"'))
    assert main(argv) == 2
    assert "names dtype 'float64', no export's" in capsys.readouterr().err
