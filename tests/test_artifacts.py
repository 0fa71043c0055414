"""Damaged, foreign or impossible artifacts are never adopted silently: checkpoints without or
with a malformed integrity record, checkpoint directories that are symlinks into another run,
trainer states with impossible values, Hugging Face folders with impossible config values or
weights, and eval's reuse of exports and records of other weights at the same step.

Each case: `auto` falls back to an older good checkpoint with a warning naming what is wrong, a
named artifact is one paragraph with exit code 2 (no traceback), and nothing good is touched.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from scale_llm.cli import main
from scale_llm.components.checkpoint import (
    INTEGRITY,
    Checkpointer,
    damage,
    write_integrity,
)
from scale_llm.components.serialization import load_file, save_file
from scale_llm.errors import UserError
from scale_llm.train.trainer import Trainer
from tests.helpers import finished_run, make_config, plan_for

STEP2, STEP4 = "step_00000002", "step_00000004"


@pytest.fixture(scope="module")
def four_steps(data_dir, tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (read only: tests copy it)."""
    root = tmp_path_factory.mktemp("artifacts")
    return finished_run(data_dir, root, "checkpoint.every=2", "checkpoint.keep_last=2")


def copy_run(good: Path, tmp_path: Path, name: str = "test") -> Path:
    run = tmp_path / "runs" / name
    shutil.copytree(good, run, symlinks=True)
    return run


def resume_auto(data_dir: Path, tmp_path: Path, *overrides: str) -> Trainer:
    cfg = make_config(
        data_dir, tmp_path / "runs", "checkpoint.every=2", "train.max_steps=6", *overrides
    )
    return Trainer(cfg, plan_for(cfg))


def cli_error(argv: list[str], capsys) -> str:
    """Run the CLI, which must exit 2 with one message and no traceback; the message."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err


class Lines(list):
    @property
    def text(self) -> str:
        return "\n".join(self)


@contextlib.contextmanager
def logged() -> Iterator[Lines]:
    """The scale_llm logger's messages during the block (a handler of its own: the CLI resets
    that logger's handlers, and it does not propagate to pytest's)."""
    lines = Lines()
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("scale_llm")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def rewrite_state(ckpt: Path, **changes) -> None:
    """Change fields of a checkpoint's trainer state and its record with it (the checksums
    then match: the values themselves must be refused)."""
    state = load_file(ckpt / "trainer.pt")
    for key, value in changes.items():
        node = state
        *parents, last = key.split("__")
        for part in parents:
            node = node[part]
        node[last] = value
    save_file(state, ckpt / "trainer.pt")
    write_integrity(ckpt)


# ----------------------------------------------------------------------------- 1: missing record


@pytest.mark.parametrize("how", ["removed", "no files", "no trainer.pt", "no weights", "extra"])
def test_a_missing_or_incomplete_integrity_record_is_damage(
    how, four_steps, data_dir, tmp_path, capsys
):
    """Deleting integrity.json (or emptying it) turned the check off: step 4 was resumed as
    it was. Now, for a checkpoint whose trainer state says it was written with a record, that
    is damage: auto falls back to step 2 naming it, a named checkpoint is exit 2."""
    run = copy_run(four_steps, tmp_path)
    ckpt = run / "checkpoints" / STEP4
    record = json.loads((ckpt / INTEGRITY).read_text())
    if how == "removed":
        (ckpt / INTEGRITY).unlink()
        said = "integrity.json is missing, but"
    elif how == "no files":
        (ckpt / INTEGRITY).write_text('{"files": {}}')
        said = "does not list trainer.pt"
    elif how == "no trainer.pt":
        del record["files"]["trainer.pt"]
        (ckpt / INTEGRITY).write_text(json.dumps(record))
        said = "does not list trainer.pt"
    elif how == "no weights":
        record["files"] = {k: v for k, v in record["files"].items() if not k.startswith("dcp/")}
        (ckpt / INTEGRITY).write_text(json.dumps(record))
        said = "lists no model weights"
    else:  # a file added after the save (a loader would read it)
        (ckpt / "model.pt").write_bytes(b"weights from elsewhere")
        said = "model.pt is not in"
    assert said in damage(ckpt)
    err = cli_error(["convert", str(ckpt), "--out", str(tmp_path / "out.pt")], capsys)
    assert "is damaged" in err and said in err
    assert not (tmp_path / "out.pt").exists()
    with logged() as lines:
        tr = resume_auto(data_dir, tmp_path)
    assert tr.step == 2
    assert f"skipping {ckpt}" in lines.text and said in lines.text
    tr.lock.release()


def test_a_checkpoint_from_before_records_is_taken_as_it_is(four_steps, data_dir, tmp_path):
    """Checkpoints written before integrity records existed carry no mark in trainer.pt."""
    run = copy_run(four_steps, tmp_path)
    ckpt = run / "checkpoints" / STEP4
    state = load_file(ckpt / "trainer.pt")
    del state["integrity"]
    save_file(state, ckpt / "trainer.pt")
    (ckpt / INTEGRITY).unlink()
    assert damage(ckpt) is None
    tr = resume_auto(data_dir, tmp_path)
    assert tr.step == 4
    tr.lock.release()


# ----------------------------------------------------------------------------- 2: malformed


MALFORMED = {
    "files a list": ('{"files": [1, 2]}', "not {"),
    "entry a number": ('{"files": {"x": 3}}', "the entry of 'x' is 3"),
    "a list": ("[]", "holds [], not {"),
    "size a string": ({"size": "12"}, "the size of 'trainer.pt' is '12', not a byte count"),
    "size a bool": ({"size": True}, "the size of 'trainer.pt' is True"),
    "digest a number": ({"xxh3_64": 5}, "the xxh3_64 of 'trainer.pt' is 5"),
    "parent path": ({"name": "../../other/trainer.pt"}, "names '../../other/trainer.pt', which"),
    "absolute path": ({"name": "/etc/passwd"}, "names '/etc/passwd', which is not a file inside"),
    "not JSON": ("{files", "is not readable JSON"),
    "a directory": (None, "integrity.json is a directory"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_integrity_record_is_damage_with_one_line(
    case, four_steps, data_dir, tmp_path, capsys
):
    """A record of the wrong shape was a traceback (TypeError, AttributeError) that also
    blocked the fallback to step 2; names in it could point outside the checkpoint."""
    run = copy_run(four_steps, tmp_path)
    ckpt = run / "checkpoints" / STEP4
    path = ckpt / INTEGRITY
    change, said = MALFORMED[case]
    if change is None:
        path.unlink()
        path.mkdir()
    elif isinstance(change, str):
        path.write_text(change)
    else:
        record = json.loads(path.read_text())
        entry = record["files"].pop("trainer.pt")
        name = change.pop("name", "trainer.pt")
        record["files"][name] = {**entry, **change}
        path.write_text(json.dumps(record))
    problem = damage(ckpt)
    assert problem is not None and said in problem and "\n" not in problem, problem
    assert str(path) in problem or str(ckpt) in problem
    with logged() as lines:
        assert Checkpointer(run, 1).latest_good() == run / "checkpoints" / STEP2
    assert f"skipping {ckpt}: " in lines.text and "falling back" in lines.text
    err = cli_error(["convert", str(ckpt), "--out", str(tmp_path / "out.pt")], capsys)
    assert "is damaged" in err and said in err


# ----------------------------------------------------------------------------- 3: symlinks


def test_a_symlinked_step_dir_is_never_resumed_counted_or_pruned(four_steps, data_dir, tmp_path):
    """checkpoints/step_00000004 -> another run's checkpoint was resumed without a word, and
    the run's own checkpoints were then pruned. Now it is skipped with a warning naming it,
    and nothing is deleted through it."""
    other = copy_run(four_steps, tmp_path, "other")
    theirs = other / "checkpoints" / STEP4
    before = tree(theirs)
    run = copy_run(four_steps, tmp_path)
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / STEP4)
    (ckpts / STEP4).symlink_to(theirs)
    (ckpts / "step_00000009").symlink_to(theirs)  # a newer one: would push step 2 out
    mine = tree(ckpts / STEP2)
    checkpointer = Checkpointer(run, 1)
    with logged() as lines:
        assert checkpointer.complete() == [(2, ckpts / STEP2)]
        checkpointer.prune()  # keep_last 1: the links are not counted
    assert f"skipping {ckpts / STEP4}: it is a symlink (to {theirs})" in lines.text
    assert tree(ckpts / STEP2) == mine and tree(theirs) == before
    with logged() as lines:
        tr = resume_auto(data_dir, tmp_path, "checkpoint.keep_last=1")
    assert tr.step == 2 and tr.resume_from == ckpts / STEP2
    tr.fit()  # saves step 4 and 6, pruning down to one
    assert tree(theirs) == before and (other / "checkpoints" / STEP2).is_dir()
    assert [p.name for _, p in Checkpointer(run, 1).complete()] == ["step_00000006"]
    (aside,) = ckpts.glob("abandoned-*")  # the links were moved aside as links
    assert sorted(p.name for p in aside.iterdir()) == [STEP4, "step_00000009"]
    assert all((aside / name).is_symlink() for name in (STEP4, "step_00000009"))


def test_a_symlinked_file_inside_a_checkpoint_is_damage(four_steps, tmp_path, capsys):
    other = copy_run(four_steps, tmp_path, "other")
    run = copy_run(four_steps, tmp_path)
    ckpt = run / "checkpoints" / STEP4
    (ckpt / "trainer.pt").unlink()
    (ckpt / "trainer.pt").symlink_to(other / "checkpoints" / STEP4 / "trainer.pt")
    assert "trainer.pt is a symlink" in damage(ckpt)
    assert Checkpointer(run, 1).latest_good() == run / "checkpoints" / STEP2
    err = cli_error(["convert", str(ckpt), "--out", str(tmp_path / "o.pt")], capsys)
    assert "trainer.pt is a symlink" in err


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


# ----------------------------------------------------------------------------- 4: trainer state


IMPOSSIBLE = {
    "negative step": ({"step": -3}, "step: -3 is not a step count"),
    "step of another name": ({"step": 9}, "step: 9, but the directory step_00000004 is step 4"),
    "step a string": ({"step": "4"}, "step: '4' is not a step count"),
    "zero heads": ({"config__model__n_heads": 0}, "config.model.n_heads=0 must be > 0"),
    "layers a string": ({"config__model__n_layers": "x"}, "config.model.n_layers: expected an"),
    "a model its files cannot hold": (
        {"config__model__d_model": 2**20, "config__model__n_heads": 2**10},
        "but the checkpoint's weight files hold",
    ),
    "tokenizer hash": ({"tokenizer_sha256": 5}, "tokenizer_sha256: 5 is not a SHA-256"),
    "plan precision": ({"plan__precision": "fp8"}, "plan.precision: 'fp8' is not bf16"),
}


@pytest.mark.parametrize("case", list(IMPOSSIBLE))
def test_impossible_trainer_state_is_refused_before_use(
    case, four_steps, data_dir, tmp_path, capsys
):
    """A negative step trained with a negative LR and moved every good checkpoint aside; a
    step that disagrees with its directory was believed; a 20 KB trainer.pt could make convert
    build a model of terabytes. Each field is now checked first (the checksums match: the
    values are what is wrong), naming the file and the field; nothing is moved or written."""
    run = copy_run(four_steps, tmp_path)
    ckpt = run / "checkpoints" / STEP4
    changes, said = IMPOSSIBLE[case]
    rewrite_state(ckpt, **changes)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(UserError, match="trainer.pt holds values no run could have saved") as e:
        resume_auto(data_dir, tmp_path)
    assert said in str(e.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # nothing aside
    err = cli_error(["convert", str(ckpt), "--out", str(tmp_path / "out.pt")], capsys)
    assert said in err and str(ckpt / "trainer.pt") in err
    argv = ["generate", str(run), "--checkpoint", str(ckpt), "--max-new-tokens", "2"]
    assert said in cli_error(argv, capsys)
    if importlib.util.find_spec("safetensors") is not None:
        assert said in cli_error(["export", str(ckpt), "--out", str(tmp_path / "hf")], capsys)
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "hf").exists()


RESUME_ONLY = {
    "data position": ({"data__position": -1}, "data.position: -1 is not an integer >= 0"),
    "bad streak past the step": ({"bad_streak": 7}, "bad_streak: 7 is not a count of steps"),
    "rng garbage": ({"rng": [{"torch": "x"}]}, "rng[0].torch: not a torch generator state"),
    "train schedule": ({"config__train__lr": -1.0}, "config.train.lr=-1.0 must be > 0"),
    "backend layout": ({"backend": {"layout": 3}}, "backend: "),
}


@pytest.mark.parametrize("case", list(RESUME_ONLY))
def test_impossible_resume_fields_are_refused(case, four_steps, data_dir, tmp_path):
    run = copy_run(four_steps, tmp_path)
    changes, said = RESUME_ONLY[case]
    rewrite_state(run / "checkpoints" / STEP4, **changes)
    with pytest.raises(UserError, match="holds values no run could have saved") as e:
        resume_auto(data_dir, tmp_path)
    assert said in str(e.value)
    assert not list((run / "checkpoints").glob("abandoned-*"))


def test_a_good_trainer_state_reads_back(four_steps):
    from scale_llm.components.checkpoint import read_trainer_state

    state = read_trainer_state(four_steps / "checkpoints" / STEP4)
    assert state["step"] == 4 and state["integrity"] is True


# ----------------------------------------------------------------------------- 5: init_from


@pytest.fixture(scope="module")
def exported(four_steps, tmp_path_factory) -> Path:
    pytest.importorskip("safetensors")
    from scale_llm.export import export

    out = tmp_path_factory.mktemp("exported") / "hf"
    export(four_steps / "checkpoints" / STEP4, out, dtype="fp32")
    return out


def init_model(data_dir: Path, tmp_path: Path, folder: Path):
    return replace(make_config(data_dir, tmp_path).model, init_from=str(folder))


CONFIG_FIELDS = {
    "bool as a string": ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false'"),
    "zero heads": ({"num_attention_heads": 0}, "num_attention_heads=0 (an integer): expected"),
    "infinite epsilon": ({"rms_norm_eps": float("inf")}, "rms_norm_eps=inf (a number)"),
    "NaN theta": (
        {"rope_theta": float("nan"), "rope_parameters": None},
        "rope_theta=nan (a number): expected a finite number > 0",
    ),
    "layers as a float": ({"num_hidden_layers": 2.0}, "num_hidden_layers=2.0 (a number)"),
    "layers a bool": ({"num_hidden_layers": True}, "num_hidden_layers=True (a boolean)"),
    "heads not dividing": ({"num_attention_heads": 5}, "is not divisible by num_attention_heads"),
    "rope a list": ({"rope_parameters": [1]}, "rope_parameters=[1] (a JSON list)"),
}


@pytest.mark.parametrize("case", list(CONFIG_FIELDS))
def test_init_from_config_fields_are_checked_for_json_type_and_range(
    case, exported, data_dir, tmp_path
):
    """ "false" was read as true, zero heads and infinities were tracebacks."""
    from scale_llm.train.init_from import load_init_weights

    folder = tmp_path / "hf"
    shutil.copytree(exported, folder)
    hf = json.loads((folder / "config.json").read_text())
    changes, said = CONFIG_FIELDS[case]
    hf.update(changes)
    (folder / "config.json").write_text(json.dumps(hf))  # (inf / nan as Infinity / NaN)
    with pytest.raises(UserError) as e:
        load_init_weights(init_model(data_dir, tmp_path, folder), None)
    assert str(folder) in str(e.value) and said in str(e.value), str(e.value)
    assert "config.json" in str(e.value)


TENSORS = {
    "NaN": (lambda t: t.index_fill(0, torch.tensor([0]), float("nan")), "1 NaN or infinite"),
    "infinity": (lambda t: t.index_fill(0, torch.tensor([1]), float("inf")), "NaN or infinite"),
    "integers": (lambda t: t.round().to(torch.int64), "holds torch.int64 values, not floating"),
    "booleans": (lambda t: t > 0, "holds torch.bool values, not floating"),
}


@pytest.mark.parametrize("case", list(TENSORS))
def test_init_from_weights_must_be_finite_floats(case, exported, data_dir, tmp_path):
    from safetensors.torch import load_file as load_st
    from safetensors.torch import save_file as save_st

    from scale_llm.train.init_from import load_init_weights

    folder = tmp_path / "hf"
    shutil.copytree(exported, folder)
    tensors = load_st(folder / "model.safetensors")
    name = "model.norm.weight"
    change, said = TENSORS[case]
    tensors[name] = change(tensors[name])
    save_st(tensors, str(folder / "model.safetensors"), {"format": "pt"})
    with pytest.raises(UserError) as e:
        load_init_weights(init_model(data_dir, tmp_path, folder), None)
    msg = str(e.value)
    assert name in msg and str(folder / "model.safetensors") in msg and said in msg, msg


def test_a_good_export_still_inits(exported, data_dir, tmp_path):
    from scale_llm.train.init_from import load_init_weights

    state = load_init_weights(init_model(data_dir, tmp_path, exported), None)
    assert all(t.dtype == torch.float32 for t in state.values())


# ----------------------------------------------------------------------------- 6: eval


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
    Trainer(cfg, plan_for(cfg)).fit()
    assert export_for_eval(ckpt, run) == first
    assert (first / "config.json").stat().st_ino != made
    assert not torch.equal(load_st(first / "model.safetensors")["model.norm.weight"], old)
    assert [p.name for p in first.parent.iterdir()] == [STEP4]  # nothing left over
    from scale_llm.components.checkpoint import checkpoint_digest

    info = json.loads((first / "scale_llm_export.json").read_text())
    assert info["checkpoint_digest"] == checkpoint_digest(ckpt) and info["made_by"]


@pytest.mark.parametrize("kind", ["a folder of the user's", "an export eval did not make"])
def test_eval_never_replaces_an_export_folder_it_did_not_make(kind, evaluated, tmp_path, capsys):
    run, calls = evaluated
    out = run / "export" / STEP4
    if kind == "an export eval did not make":
        assert main(["export", str(run), "--out", str(out)]) == 0
    else:
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
    before = tree(out)
    err = cli_error(["eval", str(run), "--tasks", "fake_task"], capsys)
    assert f"{out} exists, but eval did not make it" in err and "move it away" in err
    assert tree(out) == before and calls == []


@pytest.fixture
def evaluated(four_steps, tmp_path, monkeypatch):
    """A copy of the run whose lm-eval tasks are stubbed (the export is real)."""
    import scale_llm.evaluate as evaluate

    run = copy_run(four_steps, tmp_path)
    calls = []

    def tasks(export_dir, names, *args, **kwargs):
        calls.append(export_dir)
        return {name: {"acc": 0.25} for name in names}

    monkeypatch.setattr(evaluate, "run_tasks", tasks)
    return run, calls


def test_eval_prints_only_this_calls_results_and_names_the_merged_file(evaluated, data_dir, capsys):
    """A second eval printed the first one's results too, as if they were new."""
    run, _ = evaluated
    assert main(["eval", str(run), "--perplexity", str(data_dir), "--limit", "2"]) == 0
    assert "perplexity on" in capsys.readouterr().out
    assert main(["eval", str(run), "--tasks", "fake_task"]) == 0
    out = capsys.readouterr().out
    assert "fake_task: acc 0.2500" in out and "perplexity on" not in out
    record = run / "eval" / f"{STEP4}.json"
    assert f"are kept in {record}: perplexity" in out
    merged = json.loads(record.read_text())
    assert set(merged["tasks"]) == {"fake_task"} and "perplexity" in merged


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


@pytest.mark.parametrize("case", ["eval is a file", "record is a directory", "read-only run"])
def test_eval_output_paths_are_checked_before_any_work(
    case, evaluated, data_dir, capsys, monkeypatch
):
    """A wrong kind of file where eval writes, or a run dir it cannot write to, was found only
    after the evaluation (or overwritten): now one paragraph before any of it."""
    import scale_llm.evaluate as evaluate

    run, calls = evaluated
    monkeypatch.setattr(evaluate, "held_out_perplexity", lambda *a: calls.append(a))
    if case == "eval is a file":
        (run / "eval").write_text("not a folder")
        said = "eval is a file, not a directory"
    elif case == "record is a directory":
        (run / "eval" / f"{STEP4}.json").mkdir(parents=True)
        said = f"{STEP4}.json is a directory, not eval's record file"
    else:  # (tests run as root, which may write anywhere: the check itself is what is tested)
        real = os.access
        monkeypatch.setattr(
            os, "access", lambda p, mode: False if Path(p) == run else real(p, mode)
        )
        said = f"{run} is not writable by this user, and eval writes its results"
    argv = ["eval", str(run), "--perplexity", str(data_dir)]
    if case != "read-only run":
        argv += ["--tasks", "fake_task"]
    err = cli_error(argv, capsys)
    assert said in err, err
    assert calls == [] and not (run / "export").exists()
