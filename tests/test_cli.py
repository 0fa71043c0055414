"""End to end through the command line: prepare (built-in corpus) -> train -> generate."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SMALL = [
    "--set",
    "model.vocab_size=512",
    "--set",
    "model.d_model=64",
    "--set",
    "model.n_layers=2",
    "--set",
    "model.seq_len=64",
    "--set",
    "data.tokenizer_sample_bytes=1000000",
]


def scale_llm(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "scale_llm", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_prepare_train_generate_on_the_builtin_corpus(tmp_path):
    config = str(REPO / "yaml" / "tiny.yaml")
    data = ["--set", f"data.dir={tmp_path / 'data'}"]
    proc = scale_llm("prepare", config, *SMALL, *data, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "builtin:python" in proc.stdout and "train" in proc.stdout
    again = scale_llm("prepare", config, *SMALL, *data, cwd=tmp_path)
    assert "up to date" in again.stdout  # idempotent: no work the second time

    train_args = [
        "--train_steps",
        "12",
        "--batch_size",
        "4",
        "--grad-accum",
        "2",
        "--grad-checkpointing",
        "--report-memory",
        "--set",
        "eval.every=6",
        "--set",
        "eval.steps=2",
        "--set",
        "logging.every=3",
        "--set",
        "train.warmup_steps=2",
    ]
    proc = scale_llm("train", config, *SMALL, *data, *train_args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "memory estimate for" in proc.stdout and "fp32" in proc.stdout  # --report-memory
    assert "= 8 sequences = 512 tokens per step" in proc.stdout
    run = tmp_path / "runs" / "tiny"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3, 6, 9, 12]  # the first step, then every 3
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert "val_loss" in rows[2]
    assert (run / "checkpoints" / "step_00000012" / "dcp" / ".metadata").is_file()

    # the resolved config reproduces the run's settings when fed back
    written = yaml.safe_load((run / "config.yaml").read_text())
    assert written["activation_checkpointing"]["mode"] == "full"
    assert written["train"]["max_steps"] == 12

    proc = scale_llm(
        "generate",
        str(run),
        "--prompt",
        "def ",
        "--max-new-tokens",
        "20",
        "--seed",
        "1",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def ")
    assert len(proc.stdout) > len("def ") + 10


def test_cli_user_errors_exit_2_without_traceback(tmp_path):
    config = str(REPO / "yaml" / "tiny.yaml")
    cases = [
        (["train", config, "--set", f"data.dir={tmp_path}/none"], "holds no prepared shards"),
        (["train", str(tmp_path / "missing.yaml")], "does not exist"),
        (["generate", str(tmp_path)], "not a run directory"),
        (["train", config, "--set", "train.precison=fp16"], "did you mean train.precision?"),
    ]
    for args, expected in cases:
        proc = scale_llm(*args, cwd=tmp_path)
        assert proc.returncode == 2, (args, proc.stderr)
        assert expected in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_run_messages_count_this_launch_and_a_finished_run_is_left_alone(
    data_dir, tmp_path, capsys
):
    """Resume summary counts this launch's steps; the stop at the last step does not ask to
    continue; a finished run says so, exits 0 and writes nothing, and with other settings is
    refused naming them and --run-name; warmup >= max_steps warns."""
    from scale_llm.cli import main
    from tests.helpers import TINY_MODEL

    settings = [
        *TINY_MODEL,
        f"data.dir={data_dir}",
        f"run.dir={tmp_path}",
        "train.micro_batch_size=4",
        "train.max_steps=4",
        "train.warmup_steps=1",
        "train.device=cpu",
        "logging.tensorboard=false",
        "eval.every=0",
        "checkpoint.every=2",
    ]
    args = ["train", *[a for s in settings for a in ("--set", s)], "--run-name", "msgs"]
    assert main([*args, "--set", "train.exit_at_step=2"]) == 0
    out = capsys.readouterr().out
    assert "done: 2 steps in" in out and "2 of 4 in total" in out
    assert "launch again to continue to step 4, with train.exit_at_step above 2 or null" in out
    assert main([*args, "--set", "train.exit_at_step=4"]) == 0
    out = capsys.readouterr().out
    assert "done: 2 steps (steps 3-4) in" in out and "4 of 4 in total" in out
    assert "after step 4; the run is complete" in out and "launch again" not in out
    run = tmp_path / "msgs"
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "run already complete" in out and "step 4 of train.max_steps=4" in out
    assert "resume: continuing" not in out and "--run-name NAME" in out
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before
    # other settings in a finished run's dir: a new experiment, refused with the way to start it
    assert main([*args, "--set", "train.lr=3e-4", "--set", "train.micro_batch_size=2"]) == 2
    out, err = capsys.readouterr()
    assert "continuing" not in out and "nothing to do" not in out
    assert f"{run} holds a finished run (step 4 of its train.max_steps=4" in err
    assert "train.lr: 0.001 -> 0.0003; sequences a step: 4 -> 2" in err
    assert "start a new run: --run-name NAME" in err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before
    # the same batch split otherwise (a requeue on other hardware): the same, complete run
    assert main([*args, "--set", "train.micro_batch_size=2", "--set", "train.grad_accum=2"]) == 0
    assert "run already complete" in capsys.readouterr().out
    # over ranks too: 2 ranks of 2 are its 4 sequences a step (refused: "4 -> 2"), 2 of 4 not
    from scale_llm.cli import config_from_args, parse_args
    from scale_llm.components.checkpoint import read_trainer_state
    from scale_llm.config.plan import target_plan
    from scale_llm.train.resume import changed_settings

    state = read_trainer_state(run / "checkpoints" / "step_00000004")
    for micro, said in ((2, []), (4, ["sequences a step: 4 -> 8"])):
        two = config_from_args(parse_args([*args, "--set", f"train.micro_batch_size={micro}"]))
        assert changed_settings(state, two, target_plan(two, 2)) == said, micro
    assert (
        main(
            [
                *args,
                "--set",
                "train.lr=3e-4",
                "--run-name",
                "msgs-lr",
                "--set",
                "train.exit_at_step=1",
            ]
        )
        == 0
    )
    assert "done: 1 steps in" in capsys.readouterr().out and (tmp_path / "msgs-lr").is_dir()
    assert main([*args, "--run-name", "warm", "--set", "train.warmup_steps=10"]) == 0
    out = capsys.readouterr().out
    assert (
        "train.warmup_steps=10 >= train.max_steps=4" in out
        and "rises to 0.0004 at the last step" in out
    )


def test_runs_lists_each_run_and_writes_nothing(data_dir, tmp_path, capsys):
    """`scale-llm runs`: a complete run, one stopped by exit_at_step, a folder that is not a
    run (left out); every file, mtime and folder the same afterwards."""
    from scale_llm.cli import main
    from tests.helpers import finished_run, snapshot

    finished_run(data_dir, tmp_path, "run.name=done", "checkpoint.every=2", "eval.every=4")
    finished_run(data_dir, tmp_path, "run.name=half", "train.exit_at_step=2")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    before = snapshot(tmp_path)
    times = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    assert main(["runs", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "step", "loss", "val_loss", "status", "checkpoint", "size"]
    done, half = (line.split() for line in lines[1:])
    assert done[:2] == ["done", "4/4"] and done[4:6] == ["complete", "step_00000004"]
    assert float(done[2]) > 0 and float(done[3]) > 0  # the last loss and val_loss
    assert half[:2] == ["half", "2/4"] and half[3:6] == ["-", "stopped", "step_00000002"]
    assert done[-1] in ("KiB", "MiB") and float(done[-2]) > 0
    assert len(lines) == 3  # notes/ is not a run
    assert snapshot(tmp_path) == before
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == times
    # another user's private run in a shared run.dir: a PermissionError traceback hid every run
    import scale_llm.train.runs as runs
    from scale_llm.train.runs import metric_rows

    def private(path):
        if path.parent.name == "half":
            raise PermissionError(13, "Permission denied", str(path))
        return metric_rows(path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runs, "metric_rows", private)
        assert main(["runs", str(tmp_path)]) == 0
    said = [line.split(maxsplit=5) for line in capsys.readouterr().out.splitlines()[1:]]
    assert said[0][0] == "done" and said[1][:5] == ["half", "-/?", "-", "-", "unreadable"]
    assert "(Permission denied)" in said[1][5]
    assert main(["runs", str(tmp_path / "half")]) == 0  # one run directory
    assert capsys.readouterr().out.splitlines()[1].split()[0] == "half"
    assert main(["runs", str(tmp_path / "notes")]) == 0
    assert capsys.readouterr().out.startswith(f"no runs in {tmp_path / 'notes'}")
    assert main(["runs", str(tmp_path / "missing")]) == 2
    assert "missing: no such folder; give the run.dir" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()
    # a config.yaml emptied: its defaults' 200 steps stood in (done 4/200, "stopped")
    import shutil

    shutil.copytree(tmp_path / "done", tmp_path / "emptied")
    (tmp_path / "emptied" / "config.yaml").write_text("")
    assert main(["runs", str(tmp_path / "emptied")]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["emptied", "4/?"]


def test_runs_shows_a_run_as_a_relaunch_finds_it(data_dir, tmp_path, capsys):
    """A damaged newest checkpoint was listed as `complete`; the rows a resume drops (logged
    after the newest checkpoint, by a launch that was killed) were its step; a metrics line or
    a lock file nested thousands deep was a RecursionError. Now: the checkpoint a relaunch
    takes, the damaged one named, the rows up to it; damaged lines and records skipped."""
    import shutil

    from scale_llm.cli import main
    from tests.helpers import finished_run

    run = finished_run(data_dir, tmp_path, "checkpoint.every=2", "checkpoint.keep_last=2")
    for name in ("damaged", "killed"):
        shutil.copytree(run, tmp_path / name)
    weights = tmp_path / "damaged" / "checkpoints" / "step_00000004" / "dcp" / "__0_0.distcp"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    shutil.rmtree(tmp_path / "killed" / "checkpoints" / "step_00000004")  # killed before it
    with open(run / "metrics.jsonl", "a") as f:
        f.write("[" * 100_000 + "]" * 100_000 + "\n")
        f.write(json.dumps({"step": 4, "val_loss": 10**400}) + "\n")  # (float(): OverflowError)
    (run / ".lock").write_text("[" * 4000)  # (read as no owner: the run is not running)
    assert main(["runs", str(tmp_path)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    lines = (run / "metrics.jsonl").read_text().splitlines()[:4]
    losses = {r["step"]: r["loss"] for r in map(json.loads, lines)}
    damaged = rows["damaged"].split()
    assert damaged[1] == "2/4" and float(damaged[2]) == pytest.approx(losses[2], abs=1e-4)
    assert "stopped (step_00000004 damaged)  step_00000002" in rows["damaged"], rows["damaged"]
    killed = rows["killed"].split()
    assert killed[1] == "2/4" and killed[4:6] == ["stopped", "step_00000002"], killed
    test = rows["test"].split()
    assert test[1] == "4/4" and test[4:6] == ["complete", "step_00000004"], test
    # folders 1,100 deep in a checkpoint and beside it (RecursionError in the walks), a 2 MiB
    # line (read whole), a trainer.pt of random bytes without its record (an IndexError), and a
    # lock naming a host that writes terminal escapes (a forged row on the screen)
    import contextlib
    import os

    for name in ("deep", "garbage"):
        shutil.copytree(run, tmp_path / name)
    deep = [tmp_path / "deep" / "checkpoints" / "step_00000004", tmp_path / "deep" / "notes"]
    deep[1].mkdir()
    try:
        for top in deep:
            for k in range(1, 1101):
                (top / "/".join(["a"] * k)).mkdir()
        with open(tmp_path / "deep" / "metrics.jsonl", "ab") as f:
            f.write(b"x" * (2 << 20))
        garbage = tmp_path / "garbage" / "checkpoints" / "step_00000004"
        (garbage / "integrity.json").unlink()
        (garbage / "trainer.pt").write_bytes(b"a")
        host = "x)\r\x1b[2Kforged 4/4 0.0100 complete\x1b]0;title\x07("
        (tmp_path / "garbage" / ".lock").write_text(json.dumps({"pid": 1, "host": host}))
        assert main(["runs", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        rows = {line.split()[0]: line for line in out.splitlines()[1:]}
        assert rows["deep"].split()[4:6] == ["complete", "step_00000004"], rows["deep"]
        assert "\x1b" not in out and "\r" not in out and "\\r\\x1b[2Kforged" in rows["garbage"]
    finally:  # (pytest's clean-up of its folders recurses: 1,100 deep is past Python's limit)
        for top in deep:
            for k in range(1100, 0, -1):
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(top / "/".join(["a"] * k))


def test_a_check_report_says_no_errors_only_once_the_check_has_finished(tmp_path):
    """The report is rewritten after each item: one left by a check that stopped (its time
    limit, a refused setting, Ctrl-C) said "no errors (no curves run)" and ok: true."""
    from scale_llm.analysis.check import Report

    report = Report(tmp_path, budget_minutes=None)
    report.save()  # (as after the preflight)
    said = (tmp_path / "report.md").read_text()
    assert "the check did not finish (stopped, or still running): 0 errors so far" in said
    assert (
        "no errors" not in said
        and json.loads((tmp_path / "report.json").read_text())["ok"] is False
    )
    report.data["finished"] = True
    report.save()
    assert "no errors (no curves run)" in (tmp_path / "report.md").read_text()
    # items a budget skipped: said (a check that measured nothing said only "no errors")
    report.budget_s = -1.0
    report.attempt("reference", "bare loop", lambda: pytest.fail("run past the budget"))
    assert "no errors (no curves run); 1 item skipped over --budget-min (run them with --only)" in (
        (tmp_path / "report.md").read_text()
    )


def test_generate_reads_the_prompt_from_a_file_or_stdin_and_says_when_it_is_cut(
    data_dir, tmp_path, monkeypatch, capsys
):
    """--prompt-file PATH / - (a prompt with newlines without shell quoting); a prompt longer
    than model.seq_len (32 here) was cut silently."""
    import io

    from scale_llm.cli import main
    from tests.helpers import finished_run

    run = str(finished_run(data_dir, tmp_path))
    greedy = ["--temperature", "0", "--max-new-tokens", "4"]
    (tmp_path / "p.txt").write_text("def f(x):\n    return x\n")
    assert main(["generate", run, "--prompt-file", str(tmp_path / "p.txt"), *greedy]) == 0
    from_file = capsys.readouterr().out
    assert main(["generate", run, "--prompt", "def f(x):\n    return x\n", *greedy]) == 0
    assert capsys.readouterr().out == from_file and from_file.startswith("def f(x):\n    return")
    assert "WARNING" not in from_file
    long = "x = 1\n" * 40  # about 160 tokens
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(long.encode())))
    assert main(["generate", run, "--prompt-file", "-", *greedy]) == 0
    out, err = capsys.readouterr()
    assert "WARNING: generate: the prompt is" in err and "WARNING" not in out  # (apart)
    assert "more than the model's context of model.seq_len=32: only its last 32 tokens" in err
    assert out.startswith(long)  # the whole prompt, then the continuation


def test_generate_into_a_closed_pipe_or_an_ascii_terminal_ends_without_a_traceback(
    data_dir, tmp_path
):
    """`scale-llm generate ... | head -c 1` ends with nothing on stderr and 141, as a shell
    reports a command SIGPIPE stopped (it was a BrokenPipeError traceback); another pipe broken
    stays an internal error. A terminal that cannot show a character gets `?` for it."""
    import subprocess

    from tests.helpers import env, finished_run

    run = str(finished_run(data_dir, tmp_path))
    (tmp_path / "p.txt").write_text("abc " * 50_000)  # echoed whole: past a pipe's buffer
    cmd = [sys.executable, "-m", "scale_llm", "generate", run, "--prompt-file", "p.txt"]
    proc = subprocess.Popen(
        [*cmd, "--max-new-tokens", "2"],
        cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout.read(1)  # (its first line: the warning that the prompt was cut)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "Broken pipe" not in err, err
    from scale_llm import cli  # another pipe broken (a child's): an internal error, as before

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(cli.COMMANDS, "runs", broken)
        with pytest.raises(BrokenPipeError):
            cli.main(["runs", str(tmp_path)])
    ascii_only = env() | {"PYTHONIOENCODING": "ascii"}  # (a UnicodeEncodeError traceback)
    shown = subprocess.run(
        [*cmd[:-2], "--prompt", "caf\u00e9 ", "--max-new-tokens", "2"],
        cwd=tmp_path, env=ascii_only, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0 and "caf? " in shown.stdout, shown.stderr[-2000:]


# ----------------------------------------------------------------------------- packaging


def test_the_default_outputs_are_ignored_by_git():
    """What the commands write where the README runs them: run dirs (eval/ and export/ inside),
    prepared data, `export --out exports/...`, the check's reports."""
    from scale_llm.config import DataConfig, RunConfig

    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    written = [
        f"{RunConfig().dir}/tiny/eval/step_00000150.json",
        f"{DataConfig().dir}/manifest.json",
        "data/builtin-v2048/manifest.json",
        "exports/tiny/model.safetensors",
        "check/report.md",
        "gpu-check/report.md",
    ]
    for path in written:
        proc = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
        assert proc.returncode == 0, f"{path} is not in .gitignore"


def env_sh_python(root: Path, path_dirs: list[Path]) -> subprocess.CompletedProcess:
    """Source `root`/launch/_env.sh with PATH = path_dirs + the system dirs; print its $PY."""
    env = {k: v for k, v in os.environ.items() if k not in ("SCALE_LLM_PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = ":".join([*map(str, path_dirs), "/usr/bin", "/bin"])
    env["PYTHONPATH"] = ""
    script = f'source "{root}/launch/_env.sh" && echo "PY=$PY"'
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)


def test_launchers_use_the_active_python_then_the_venv_then_say_what_to_do(tmp_path):
    """The launchers run where scale_llm is installed in the active Python, without .venv."""
    active = tmp_path / "active-env" / "bin"
    active.mkdir(parents=True)
    (active / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # imports it
    (active / "python").chmod(0o755)
    proc = env_sh_python(REPO, [active])
    assert proc.returncode == 0 and f"PY={active / 'python'}" in proc.stdout, proc.stderr
    # no usable active Python: the checkout's .venv
    empty = tmp_path / "empty"
    empty.mkdir()
    venv_python = REPO / ".venv" / "bin" / "python"
    if venv_python.exists():
        proc = env_sh_python(REPO, [empty])
        assert f"PY={venv_python}" in proc.stdout, proc.stderr
    # neither: a clear error, exit 2
    bare = tmp_path / "bare-checkout"
    (bare / "launch").mkdir(parents=True)
    (bare / "launch" / "_env.sh").write_text((REPO / "launch" / "_env.sh").read_text())
    proc = env_sh_python(bare, [empty])
    assert proc.returncode == 2 and "PY=" not in proc.stdout
    assert "no Python that can import scale_llm" in proc.stderr
    assert "run 'bash launch/setup.sh' first, or install a built wheel" in proc.stderr
    assert "'pip install scale_llm'" not in proc.stderr  # (no such name on a package index)
    named = {**os.environ, "SCALE_LLM_PYTHON": str(empty / "python")}  # names the one it tried
    proc = subprocess.run(["bash", "-c", f'source "{REPO}/launch/_env.sh"'], env=named,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"SCALE_LLM_PYTHON={empty / 'python'} does not run" in proc.stderr


def test_launchers_run_a_checkout_with_a_python3_that_has_only_the_dependencies(tmp_path):
    """A lent GPU machine has an image's python3 with torch and no network: nothing can be
    installed there, so launch/gpu-check.sh runs the checkout it was handed through PYTHONPATH.
    Here: a venv that borrows this one's packages but not its editable scale_llm."""
    import sysconfig

    env = tmp_path / "image-python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = Path(sysconfig.get_paths(vars={"base": str(env), "platbase": str(env)})["purelib"])
    (site / "borrow.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # (no .pth inside)
    probe = [str(env / "bin" / "python3"), "-I", "-c", "import torch, yaml; import scale_llm"]
    assert (
        "No module named 'scale_llm'" in subprocess.run(probe, capture_output=True).stderr.decode()
    )
    checkout = tmp_path / "checkout"
    (checkout / "launch").mkdir(parents=True)
    (checkout / "launch" / "_env.sh").write_text((REPO / "launch" / "_env.sh").read_text())
    (checkout / "scale_llm").symlink_to(REPO / "scale_llm")
    proc = env_sh_python(checkout, [env / "bin"])
    assert proc.returncode == 0 and f"PY={env / 'bin' / 'python3'}" in proc.stdout, proc.stderr
    script = f'source "{checkout}/launch/_env.sh" && cd / && "$PY" -m scale_llm --version && '
    script += '"$PY" -c "import scale_llm; print(scale_llm.__file__)"'
    env_vars = {**os.environ, "PATH": f"{env / 'bin'}:/usr/bin:/bin", "PYTHONPATH": ""}
    env_vars.pop("SCALE_LLM_PYTHON", None)
    proc = subprocess.run(["bash", "-c", script], env=env_vars, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == str(checkout / "scale_llm" / "__init__.py")
    # an image without pyyaml: the checkout's yaml/ (its configs) imported as an empty package
    bare = tmp_path / "site-without-pyyaml"
    bare.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("yaml", "_yaml", "pyyaml")):
            (bare / entry.name).symlink_to(entry)
    (site / "borrow.pth").write_text(f"{bare}\n")
    (checkout / "yaml").mkdir()
    python3 = [str(env / "bin" / "python3"), "-c"]
    image = {**env_vars, "PYTHONPATH": str(checkout)}
    works = subprocess.run([*python3, "import torch, scale_llm.cli"], env=image, cwd="/")
    assert works.returncode == 0  # (torch and the CLI import: pyyaml alone is missing)
    nopyyaml = subprocess.run([*python3, "from yaml import safe_load"], env=image, cwd="/",
                              capture_output=True, text=True)  # fmt: skip
    assert "(unknown location)" in nopyyaml.stderr  # (the checkout's yaml/, as a package)
    proc = env_sh_python(checkout, [env / "bin"])  # torch alone is not enough
    assert proc.returncode == 2 and "no Python that can import scale_llm" in proc.stderr


def test_the_gpu_check_stops_when_torch_cannot_use_the_gpus_nvidia_smi_lists(tmp_path):
    """A CPU build of torch found first on a GPU machine would spend a lent GPU's minutes on the
    CPU checks: the launcher stops before any work (a stand-in nvidia-smi lists one GPU)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SCALE_LLM_PYTHON": sys.executable}
    cmd = ["bash", str(REPO / "launch" / "gpu-check.sh"), str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "nvidia-smi lists 1 GPU(s), but torch" in proc.stderr
    assert "SCALE_LLM_PYTHON" in proc.stderr and "SCALE_LLM_CHECK_ALLOW_CPU=1" in proc.stderr
    assert not (tmp_path / "out").exists()


LAUNCH_ENV = (
    "OMP_NUM_THREADS", "NGPU", "CUDA_VISIBLE_DEVICES", "NNODES", "NODE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "HOSTFILE", "DS_ENV_FILE", "DS_ACCELERATOR", "SKIP_PREPARE",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "SCALE_LLM_ROOT", "SCALE_LLM_CONTINUE",
    "SCALE_LLM_NODE_WAIT_MIN",
)  # fmt: skip


def stand_in_node(tmp_path: Path, python: str, gpus: int = 8, cores: int = 16) -> dict[str, str]:
    """A node for the launchers, without torch: stand-ins for nvidia-smi (`gpus` GPUs), nproc and
    the Python (`python`: the arms of a `case "$2" in` on the module it is asked to run; to
    _env.sh's probe its torch is 2.13 or newer and counts no GPU; every other call succeeds).
    Returns the environment that puts them first on PATH."""
    fake = tmp_path / "bin"
    fake.mkdir()
    listing = "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(gpus))
    scripts = {
        "nvidia-smi": listing,
        "nproc": f"echo {cores}\n",
        "pdsh": "exit 0\n",  # (DeepSpeed's runner starts other nodes with it)
        "python": f'case "$2" in\n{python}\n*os.environ.pop*) echo "probe 1 0";;\nesac\n',
    }
    for name, body in scripts.items():
        (fake / name).write_text("#!/bin/sh\n" + body)
        (fake / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return env | {"PATH": f"{fake}:{env['PATH']}", "SCALE_LLM_PYTHON": str(fake / "python")}


def launch(script: str, env: dict[str, str], *args: str, **kw) -> subprocess.CompletedProcess:
    cmd = ["bash", str(REPO / "launch" / script), "tiny.yaml", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, **kw)


# (torchrun runs as `python -c CODE ARGS`, CODE calling torch.distributed.run's main: _env.sh)
PRINT_LAUNCH = """*torch.distributed.run*) shift 2; echo "OMP=$OMP_NUM_THREADS $*";;
deepspeed.launcher.runner) echo "OMP=$OMP_NUM_THREADS CVD=${CUDA_VISIBLE_DEVICES-unset} $*";;"""


def test_each_launcher_splits_the_cores_between_its_own_processes(tmp_path):
    """On a 16-core node with 8 GPUs, torchrun.sh starts 8 processes of 2 threads each and
    2xh100.sh 2 processes of 8 (it split the cores 8 ways, as for every GPU). Stand-ins for
    nvidia-smi, nproc and the Python print what torchrun would have been given."""
    env = stand_in_node(tmp_path, PRINT_LAUNCH)
    seen = {}
    for script in ("2xh100.sh", "torchrun.sh"):
        proc = launch(script, env)
        assert proc.returncode == 0, proc.stderr
        words = proc.stdout.split()
        seen[script] = (words[0], words[words.index("--nproc_per_node") + 1])
    assert seen == {"2xh100.sh": ("OMP=8", "2"), "torchrun.sh": ("OMP=2", "8")}


def test_the_launchers_check_the_layout_for_the_world_they_start_before_prepare(tmp_path):
    """NGPU=3 with tensor_parallel=2: prepare did its work, then every rank refused the layout
    (docs/backends.md: before any process starts). Each launcher gives prepare its world."""
    prepare = 'scale_llm) echo "prepare world=${SCALE_LLM_LAUNCH_WORLD:-none}";;\n'
    env = stand_in_node(tmp_path, prepare + PRINT_LAUNCH)
    nodes = {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "node0", "NGPU": "4"}
    for script, extra, world in [
        ("2xh100.sh", {}, "2"),
        ("torchrun.sh", {}, "8"),
        ("torchrun.sh", nodes, "8"),
        ("deepspeed.sh", {"NGPU": "3"}, "3"),
    ]:
        proc = launch(script, env | extra)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[0] == f"prepare world={world}", (script, proc.stdout)
    layout = ["--set", "parallel.backend=fsdp", "--set", "parallel.tensor_parallel=2"]
    proc = subprocess.run(
        [sys.executable, "-m", "scale_llm", "prepare", "--as-train", "tiny", "--set", "data.dir=d"]
        + layout,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "SCALE_LLM_LAUNCH_WORLD": "3"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and not (tmp_path / "d").exists(), proc.stderr
    assert "parallel.tensor_parallel=2 does not divide the world size 3" in proc.stderr


def test_the_other_nodes_wait_for_node_0s_prepare(tmp_path):
    """Node 0 prepares while nodes 1..N wait in torchrun's rendezvous, which gave up after its
    own 15 minutes (a traceback on each, then Slurm's kill of node 0's prepare)."""
    env = stand_in_node(tmp_path, PRINT_LAUNCH)
    nodes = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0"}
    for extra, timeout in [({}, "86400"), ({"SCALE_LLM_NODE_WAIT_MIN": "90"}, "5400")]:
        proc = launch("torchrun.sh", env | nodes | extra)
        assert proc.returncode == 0, proc.stderr
        assert f"--rdzv_conf timeout={timeout} " in proc.stdout, proc.stdout
    proc = launch("torchrun.sh", env | nodes | {"SCALE_LLM_NODE_WAIT_MIN": "1h"})
    assert proc.returncode == 2 and not proc.stdout
    assert "SCALE_LLM_NODE_WAIT_MIN='1h' is not a number of minutes" in proc.stderr
    assert "--rdzv_conf" not in launch("torchrun.sh", env).stdout  # (one node: no rendezvous)


def test_a_stop_signal_during_prepare_reaches_prepare(tmp_path):
    """A SIGTERM to a launcher while node 0 prepared ended the launcher alone (exit 143, nothing
    said): prepare ran on, holding data.dir's lock, without anyone to stop it."""
    told = tmp_path / "told"
    prepare = f"""scale_llm) trap 'echo TERM > {told}; exit 143' TERM
echo preparing; sleep 30 >/dev/null & wait; echo never;;\n"""  # (the sleep: not our pipe)
    env = stand_in_node(tmp_path, prepare + PRINT_LAUNCH)
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), "tiny.yaml"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "preparing\n"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 143 and told.read_text() == "TERM\n"
    assert "never" not in out and "--nproc_per_node" not in out  # (no training started)


def test_the_launchers_refuse_settings_that_failed_after_prepare_or_were_ignored(tmp_path):
    """Each was a traceback after the data was prepared, a silent skip of prepare, or a run that
    ignored it: exit 2 now, before any work (nothing on stdout: no prepare, no torchrun)."""
    env = stand_in_node(tmp_path, PRINT_LAUNCH)
    nodes = {"NNODES": "2", "NODE_RANK": "0"}
    for script, extra, said in [
        ("torchrun.sh", {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5m"}, "is not a\nwhole number"),
        ("2xh100.sh", {"OMP_NUM_THREADS": "abc"}, "OMP_NUM_THREADS='abc' is not a number"),
        ("2xh100.sh", {"NODE_RANK": "1"}, "NODE_RANK=1 is set, but 2xh100.sh runs on this node"),
        ("deepspeed.sh", {"NODE_RANK": "1"}, "NODE_RANK=1 is set, but deepspeed.sh starts every"),
        ("deepspeed.sh", {"NNODES": "2"}, "NNODES=2 is set, but deepspeed.sh starts every node"),
        ("torchrun.sh", nodes | {"MASTER_ADDR": "-node0"}, "MASTER_ADDR='-node0' is not a host"),
        ("deepspeed.sh", {"MASTER_ADDR": "node 0"}, "MASTER_ADDR='node 0' is not a host name"),
    ]:
        proc = launch(script, env | extra)
        assert proc.returncode == 2 and not proc.stdout, (script, extra, proc.stdout)
        assert said.replace("\n", " ") in proc.stderr.replace("\n", " "), proc.stderr
    proc = subprocess.run(  # (each of these flags turned the other's section off: exit 0)
        ["bash", str(REPO / "launch" / "gpu-check.sh"), "out", "--calibration-only", "--fp8-only"],
        env=env | {"SCALE_LLM_CHECK_CALIBRATION": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "give one of --calibration-only and --fp8-only" in proc.stderr
    # a hostfile named like an option, an exported CDPATH, a relative SCALE_LLM_PYTHON (read
    # from /), a SCALE_LLM_ROOT that is no folder (bash's `cd:` line, exit 1)
    (tmp_path / "-hosts").write_text("node0 slots=8\n")
    proc = launch("deepspeed.sh", env | {"HOSTFILE": "-hosts"}, cwd=tmp_path)
    assert proc.returncode == 0 and " --hostfile=-hosts " in proc.stdout, proc.stderr
    taken = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0", "OMP_NUM_THREADS": "8,4"}  # (theirs to take)
    proc = launch("torchrun.sh", env | taken)
    assert proc.returncode == 0 and proc.stdout.startswith("OMP=8,4 "), proc.stderr
    (tmp_path / "cdp" / "launch").mkdir(parents=True)
    proc = launch("torchrun.sh", env | {"CDPATH": str(tmp_path / "cdp")}, cwd=REPO)
    assert proc.returncode == 0 and "--nproc_per_node 8" in proc.stdout, proc.stderr
    proc = launch("torchrun.sh", env | {"SCALE_LLM_PYTHON": "bin/python"}, cwd=tmp_path)
    assert proc.returncode == 0 and "--nproc_per_node 8" in proc.stdout, proc.stderr
    slurm = env | {"SLURM_JOB_ID": "7", "SCALE_LLM_ROOT": str(tmp_path / "none")}
    proc = launch("slurm.sbatch", slurm)
    assert proc.returncode == 2 and f"{tmp_path / 'none'} is not a folder" in proc.stderr


def test_the_launchers_use_the_gpus_cuda_visible_devices_leaves(tmp_path):
    """A job given GPUs 0,1 of an 8-GPU node started 8 processes under torchrun.sh (four to a
    GPU), and deepspeed.sh's --num_gpus made DeepSpeed drop CUDA_VISIBLE_DEVICES and take GPUs
    0..7, whoever they belonged to. Now: a process per visible GPU, named to DeepSpeed by index."""
    env = stand_in_node(tmp_path, PRINT_LAUNCH) | {"CUDA_VISIBLE_DEVICES": "0,1"}
    proc = launch("torchrun.sh", env)
    assert proc.returncode == 0, proc.stderr
    assert "--nproc_per_node 2 " in proc.stdout and proc.stdout.startswith("OMP=8 "), proc.stdout
    proc = launch("deepspeed.sh", env)
    assert proc.returncode == 0, proc.stderr
    assert "--include localhost:0,1 " in proc.stdout and "--num_gpus" not in proc.stdout
    assert "CVD=unset" in proc.stdout  # (DeepSpeed checks the indices against all the GPUs)
    assert "--hostfile /dev/null " in proc.stdout  # one node, whatever /job/hostfile lists
    proc = launch("deepspeed.sh", env | {"CUDA_VISIBLE_DEVICES": "5,6,7", "NGPU": "2"})
    assert "--include localhost:5,6 " in proc.stdout, proc.stderr
    # 2xh100.sh on one visible GPU put both its processes on it (NCCL: duplicate GPU)
    proc = launch("2xh100.sh", env | {"CUDA_VISIBLE_DEVICES": "3"})
    assert proc.returncode == 2 and "leaves 1 GPU visible" in proc.stderr and not proc.stdout
    # a GPU listed twice counted twice: two processes on it
    for script, listed in (
        ("torchrun.sh", "0,1,1"),
        ("deepspeed.sh", "2,3,2"),
        ("2xh100.sh", "1,1"),
    ):
        proc = launch(script, env | {"CUDA_VISIBLE_DEVICES": listed})
        said = f"lists GPU {listed[-1]} twice"
        assert proc.returncode == 2 and said in proc.stderr and not proc.stdout, proc.stderr
    proc = launch("torchrun.sh", env | {"CUDA_VISIBLE_DEVICES": "1,11"})
    assert "--nproc_per_node 2 " in proc.stdout, proc.stderr
    # more processes than visible GPUs put two on one GPU (NCCL: duplicate GPU)
    proc = launch("torchrun.sh", env | {"NGPU": "3"})
    assert proc.returncode == 2 and "NGPU=3 but this node leaves 2 GPU(s)" in proc.stderr
    every = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}  # (--num_gpus)
    proc = launch("deepspeed.sh", every | {"NGPU": "9"})
    assert proc.returncode == 2 and not proc.stdout
    assert "deepspeed.sh: NGPU=9 but this node leaves 8 GPU(s)" in proc.stderr
    # NGPU=0 divided the cores by zero; now a one-line error naming it
    proc = launch("torchrun.sh", env | {"NGPU": "0"})
    assert proc.returncode == 2 and "NGPU=0" in proc.stderr and not proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_launchers_count_gpus_with_torch_where_nvidia_smi_is_missing(tmp_path):
    """Containers started with NVIDIA_DRIVER_CAPABILITIES=compute have CUDA but no nvidia-smi:
    the launchers counted no GPU, started 2 CPU processes and told DeepSpeed to use the CPU.
    A stand-in Python whose torch counts the node's 2 GPUs (_env.sh's probe unsets
    CUDA_VISIBLE_DEVICES for that count), no nvidia-smi."""
    asked = tmp_path / "asked"  # the probe's argument at each launch: 1, count in torch
    counts = f"""*os.environ.pop*) echo "$3" >> {asked}; echo "probe 1 $(( $3 == 1 ? 2 : 0 ))";;"""
    prints = PRINT_LAUNCH.replace("CVD=", "DSA=${DS_ACCELERATOR-unset} CVD=")
    env = stand_in_node(tmp_path, f"{counts}\n{prints}", gpus=0)
    (tmp_path / "bin" / "nvidia-smi").unlink()
    proc = launch("torchrun.sh", env)
    assert proc.returncode == 0 and "--nproc_per_node 2 " in proc.stdout, proc.stderr
    proc = launch("deepspeed.sh", env)
    assert proc.returncode == 0 and "DSA=unset" in proc.stdout, proc.stdout + proc.stderr
    assert "--num_gpus 2 " in proc.stdout
    proc = launch("deepspeed.sh", env | {"CUDA_VISIBLE_DEVICES": "1"})
    assert "--include localhost:1 " in proc.stdout, proc.stdout + proc.stderr
    proc = launch("2xh100.sh", env | {"CUDA_VISIBLE_DEVICES": "1"})
    assert proc.returncode == 2 and "leaves 1 GPU visible" in proc.stderr
    (tmp_path / "cpu").mkdir()
    bare = stand_in_node(tmp_path / "cpu", prints, gpus=0)  # a CPU build: torch counts none
    (tmp_path / "cpu" / "bin" / "nvidia-smi").unlink()
    proc = launch("deepspeed.sh", bare)
    assert "DSA=cpu" in proc.stdout and "--num_gpus 2 " in proc.stdout, proc.stdout
    assert set(asked.read_text().split()) == {"1"}
    # where nvidia-smi lists the GPUs, torch is not asked (its count starts the CUDA driver)
    (tmp_path / "bin" / "nvidia-smi").write_text(
        "#!/bin/sh\necho 'GPU 0: H100'\necho 'GPU 1: H100'\necho 'GPU 2: H100'\n"
    )
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    proc = launch("torchrun.sh", env)
    assert "--nproc_per_node 3 " in proc.stdout and asked.read_text().split()[-1] == "0"


def test_deepspeed_hands_the_other_nodes_the_launchers_environment(tmp_path):
    """With a hostfile, DeepSpeed's runner starts the other nodes over pdsh with only NCCL*,
    PYTHON*, ... variables and those in the file DS_ENV_FILE names (else ~/.deepspeed_env,
    ./.deepspeed_env): the allocator setting, the thread split and SCALE_LLM_* never arrived.
    deepspeed.sh now writes them, then the user's own .deepspeed_env, to a file of its own."""
    runner = 'deepspeed.launcher.runner) echo "DS_ENV_FILE=$DS_ENV_FILE"; cat "$DS_ENV_FILE";;'
    env = stand_in_node(tmp_path, runner) | {"HOME": str(tmp_path), "HOSTFILE": "hosts"}
    env["SCALE_LLM_PG_TIMEOUT_MIN"] = "45"
    (tmp_path / "hosts").write_text("node0 slots=8\nnode1 slots=8\n")
    (tmp_path / ".deepspeed_env").write_text("MY_SETTING=a b\n\n")  # (the runner reads ./ too)
    proc = launch("deepspeed.sh", env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    first, *lines = proc.stdout.splitlines()
    path = Path(first.removeprefix("DS_ENV_FILE="))
    assert path.is_absolute() and not path.exists()  # removed when the run ends
    exports = dict(line.split("=", 1) for line in lines)  # as the runner reads it
    # (the stand-in's torch passes the launcher's check for torch >= 2.13)
    want = "expandable_segments:True,pinned_max_round_threshold_mb:1"
    assert exports["PYTORCH_CUDA_ALLOC_CONF"] == want
    assert exports["OMP_NUM_THREADS"] == "2" and exports["SCALE_LLM_PG_TIMEOUT_MIN"] == "45"
    assert exports["MY_SETTING"] == "a b"
    # not the runner's working folder first (its own PYTHONPATH export, which this line replaces)
    assert exports["PYTHONPATH"] == env.get("PYTHONPATH", "")
    (tmp_path / "older").mkdir()
    older = stand_in_node(tmp_path / "older", '*os.environ.pop*) echo "probe 0 0";;\n' + runner)
    older |= {"HOME": str(tmp_path), "HOSTFILE": "hosts"}
    proc = launch("deepspeed.sh", older, cwd=tmp_path)
    exports = dict(line.split("=", 1) for line in proc.stdout.splitlines()[1:])
    assert exports["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True", proc.stderr
    # a user's PYTORCH_ALLOC_CONF (torch's name for every device) stays the one torch reads: a
    # default under the other name would replace it (torch 2.13 reads PYTORCH_CUDA_ALLOC_CONF
    # alone where both are set), and it reaches the other nodes
    mine = {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    proc = launch("deepspeed.sh", env | mine, cwd=tmp_path)
    exports = dict(line.split("=", 1) for line in proc.stdout.splitlines()[1:])
    assert "PYTORCH_CUDA_ALLOC_CONF" not in exports, proc.stdout
    assert exports["PYTORCH_ALLOC_CONF"] == "expandable_segments:False", proc.stderr
    proc = launch("deepspeed.sh", env | {"HOSTFILE": "missing"}, cwd=tmp_path)
    assert proc.returncode == 2 and "HOSTFILE=missing" in proc.stderr and not proc.stdout
    proc = launch("deepspeed.sh", env | {"NGPU": "4"}, cwd=tmp_path)  # (the slots decide)
    assert proc.returncode == 2 and not proc.stdout
    assert "NGPU=4 is set, but with HOSTFILE each line's slots=N decide" in proc.stderr
    (tmp_path / "bin" / "pdsh").rename(tmp_path / "pdsh")  # (found only after prepare: refused)
    if not shutil.which("pdsh", path=os.environ.get("PATH")):  # (a node with its own pdsh)
        proc = launch("deepspeed.sh", env, cwd=tmp_path)
        assert proc.returncode == 2 and not proc.stdout, proc.stderr
        assert "lists 2 nodes, which DeepSpeed's runner starts with pdsh, not" in proc.stderr
    (tmp_path / "pdsh").rename(tmp_path / "bin" / "pdsh")
    # the runner writes `export NAME="VALUE";` into the shell command every node runs
    bad = [("MY_SETTING", "$(touch ran)"), ("A;touch ran;B", "1"), ("X", 'a"b'), ("R", "x\r;id")]
    for name, value in bad:  # (a carriage return ends a line where the runner reads it)
        (tmp_path / ".deepspeed_env").write_text(f"{name}={value}\n")
        proc = launch("deepspeed.sh", env, cwd=tmp_path)
        assert proc.returncode == 2 and not proc.stdout, (name, proc.stderr)
        assert f".deepspeed_env sets {name}: DeepSpeed's multi-node" in proc.stderr
        assert len(value) < 4 or value not in proc.stderr  # (a value may be a secret)
    (tmp_path / ".deepspeed_env").write_text("LD_LIBRARY_PATH=${HOME}/lib:$LD_LIBRARY_PATH\n")
    proc = launch("deepspeed.sh", env, cwd=tmp_path)  # a variable the other nodes expand: fine
    assert proc.returncode == 0 and "LD_LIBRARY_PATH=${HOME}/lib:$LD_LIBRARY_PATH" in proc.stdout
    work = tmp_path / "work"  # a folder of someone else's: its .deepspeed_env only when named
    work.mkdir()
    (work / ".deepspeed_env").write_text("LD_PRELOAD=/x/evil.so\n")
    hosts = {"HOSTFILE": str(tmp_path / "hosts")}
    proc = launch("deepspeed.sh", env | hosts, cwd=work)
    assert proc.returncode == 2 and "read only when named: DS_ENV_FILE=" in proc.stderr
    proc = launch("deepspeed.sh", env | hosts | {"DS_ENV_FILE": str(work / ".deepspeed_env")})
    assert proc.returncode == 0 and "LD_PRELOAD=/x/evil.so" in proc.stdout
    shown = stand_in_node(tmp_path / "work", 'deepspeed.launcher.runner) echo "RUNNER $*";;')
    proc = launch("deepspeed.sh", shown | hosts)
    assert f"--hostfile={hosts['HOSTFILE']} " in proc.stdout and "/dev/null" not in proc.stdout
    (tmp_path / ".deepspeed_env").unlink()
    proc = launch("deepspeed.sh", env | {"SCALE_LLM_X": "`touch ran`"}, cwd=tmp_path)
    assert proc.returncode == 2 and "the environment sets SCALE_LLM_X: DeepSpeed" in proc.stderr
    # the runner joins the train arguments into that command too (quoting only those with a
    # space, in "..."), exports PYTHON* etc. itself, and cds to the folder unquoted: each ran
    # (pdsh replaces %n by the node's number anywhere: run.name=lr%n named a run per node)
    for arg in [
        "run.name=x`touch ran`",
        "eval.sample_prompt=$(touch ran) now",
        "a=b;id",
        "lr%n",
        "",
    ]:
        proc = launch("deepspeed.sh", env, "--set", arg, cwd=tmp_path)
        assert proc.returncode == 2 and "would not arrive as written" in proc.stderr, arg
    proc = launch("deepspeed.sh", env | {"PYTHONX": "$(touch ran)"}, cwd=tmp_path)
    assert proc.returncode == 2 and "the environment sets PYTHONX: DeepSpeed" in proc.stderr
    proc = launch("deepspeed.sh", env | {"MASTER_ADDR": "x;touch ran"}, cwd=tmp_path)
    assert proc.returncode == 2 and "MASTER_ADDR='x;touch ran' is not a host" in proc.stderr
    (tmp_path / "my work").mkdir()
    (tmp_path / "plain").symlink_to(tmp_path / "my work")  # (the runner cds to the real path)
    for folder in ("my work", "plain"):
        proc = launch("deepspeed.sh", env | hosts, cwd=tmp_path / folder)
        assert proc.returncode == 2 and "with an unquoted 'cd " in proc.stderr, folder
    (tmp_path / "my py").mkdir()  # (its Python's path goes into that command unquoted too)
    spaced = stand_in_node(tmp_path / "my py", runner) | {"HOME": str(tmp_path), **hosts}
    proc = launch("deepspeed.sh", spaced, cwd=tmp_path)
    assert proc.returncode == 2 and "this Python's path unquoted" in proc.stderr
    (tmp_path / "named").mkdir()  # (a bare SCALE_LLM_PYTHON: the path it names itself by)
    itself = '*sys.executable*) echo "/opt/my py/bin/python3";;\n' + runner
    named = stand_in_node(tmp_path / "named", itself) | {"HOME": str(tmp_path), **hosts}
    proc = launch("deepspeed.sh", named, cwd=tmp_path)
    assert proc.returncode == 2 and "unquoted (/opt/my py/bin/python3)" in proc.stderr
    prompt = "eval.sample_prompt=def f(x): return {'a': x[0]}"  # (in "...": arrives as written)
    cluster = {"NCCL_SOCKET_IFNAME": "^lo,docker0", "MASTER_ADDR": "10.0.0.1"}
    proc = launch("deepspeed.sh", env | cluster, "--set", prompt, "--set", "x[0].y=3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "ran").exists()


def test_deepspeed_sh_reads_the_hostfile_and_the_accelerator_before_any_work(tmp_path):
    """The hostfile reached DeepSpeed's runner unread: a host named `-oProxyCommand=...` ran its
    command here (the runner's first ssh), a line the runner cannot read was a traceback after
    prepare, as were an unknown DS_ACCELERATOR and a TMPDIR that is not a folder; values this
    launcher sets for the other nodes (PYTORCH_CUDA_ALLOC_CONF, ...) skipped the check a user's
    own lines get. Stand-in node; its Python reads this DeepSpeed's accelerator names."""
    from importlib.util import find_spec

    if find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed")
    arms = f"""*SUPPORTED_ACCELERATOR_LIST*|*hostfile\\ as\\ UTF-8*) exec {sys.executable} "$@";;
scale_llm) echo "PREPARE";;
deepspeed.launcher.runner) echo "RUNNER $*"; cat "$DS_ENV_FILE";;"""
    env = stand_in_node(tmp_path, arms) | {"HOME": str(tmp_path), "HOSTFILE": "hosts"}
    hosts = tmp_path / "hosts"
    good = "# two nodes\n\nnode0 slots=8 # rack A\n  10.0.0.2\tslots=08  \r\nfe80::1%eth0 slots=1"
    for text in (good, good.replace("\r\n", "\r").replace("\n", "\r")):  # (as the runner splits)
        hosts.write_text(text)
        proc = launch("deepspeed.sh", env, cwd=tmp_path)
        assert proc.returncode == 0 and "PREPARE" in proc.stdout and "RUNNER" in proc.stdout
    bad = {
        "-oProxyCommand=touch${IFS}ran slots=1": "line 1 ('-oProxyCommand=touch${IFS}ran slots",
        "node0": "line 1 ('node0')",
        "node0 slots=0": "line 1 ('node0 slots=0')",
        "node0 slots=8\nnode0 slots=8": "line 2 ('node0 slots=8'): ",
        "node0 slots=0000000": "line 1",
        "node0 slots=8\r-oProxyCommand=x slots=1": "line 2 ('-oProxyCommand=x slots=1')",
        "# a note\r-oProxyCommand=x slots=1\nnode1 slots=1": "line 2 ('-oProxyCommand",
        "node0 slots=8\vx": "line 1 ('node0 slots=8?x')",
        "node0 slots=8\nu@-Elog slots=1": "line 2 ('u@-Elog slots=1')",  # (ssh's -E: a log file)
        "exec:node0 slots=1": "line 1 ('exec:node0",  # (pdsh's exec module: run here)
        "u@EXEC:node0 slots=1": "line 1 ('u@EXEC:node0",
        "node0 slots=1234567": "line 1 ('node0 slots=1234567')",
        "n,ode slots=1": "line 1",
    }
    for text, said in bad.items():
        hosts.write_text(text + "\n")
        proc = launch("deepspeed.sh", env, cwd=tmp_path)
        assert proc.returncode == 2 and not proc.stdout, (text, proc.stdout)
        assert f"deepspeed.sh: HOSTFILE=hosts {said}" in proc.stderr, (text, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1
    for text in ("", "# none\n\n"):
        hosts.write_text(text)
        proc = launch("deepspeed.sh", env, cwd=tmp_path)
        assert proc.returncode == 2 and "HOSTFILE=hosts lists no node" in proc.stderr
    for raw in (b"no\x00de slots=8\n", b"a slots=8 caf\xe9 x\n"):  # (the runner's traceback)
        hosts.write_bytes(raw)
        proc = launch("deepspeed.sh", env, cwd=tmp_path)
        assert proc.returncode == 2 and "HOSTFILE=hosts is not UTF-8 text" in proc.stderr
    hosts.write_text("node0 slots=8\n")
    for name in (
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
        "OMP_NUM_THREADS",
        "DS_ACCELERATOR",
    ):
        value = 'expandable_segments:True";touch ran;"'
        proc = launch("deepspeed.sh", env | {name: value}, cwd=tmp_path)
        assert proc.returncode == 2 and not proc.stdout, (name, proc.stdout)
        said = f"the environment sets {name}: DeepSpeed's multi-node"
        if name == "OMP_NUM_THREADS":  # (no number of threads: refused by every launcher)
            said = f"launch: OMP_NUM_THREADS='{value}' is not a number of threads"
        assert said in proc.stderr, proc.stderr
    proc = launch("deepspeed.sh", env | {"TMPDIR": str(tmp_path / "none")}, cwd=tmp_path)
    assert proc.returncode == 2 and f"TMPDIR={tmp_path / 'none'} (not a folder" in proc.stderr
    assert not proc.stdout
    for more in ({}, {"HOSTFILE": ""}):
        proc = launch("deepspeed.sh", env | more | {"DS_ACCELERATOR": "bogus"}, cwd=tmp_path)
        assert proc.returncode == 2 and not proc.stdout, proc.stdout
        said = "DS_ACCELERATOR=bogus is not one of DeepSpeed's accelerators (cuda, cpu, "
        assert said in proc.stderr, proc.stderr
    proc = launch("deepspeed.sh", env | {"DS_ACCELERATOR": "cpu"}, cwd=tmp_path)
    assert proc.returncode == 0 and "DS_ACCELERATOR=cpu" in proc.stdout, proc.stderr
    assert not (tmp_path / "ran").exists()


def test_deepspeed_sh_says_when_it_builds_ops_and_takes_a_free_port(tmp_path):
    """A first DeepSpeed run on the CPU sat silent for ~3 minutes while DeepSpeed compiled its
    C++ op; two one-node runs both took DeepSpeed's port 29500. Stand-ins: a Python whose torch
    cache lacks two ops and whose free port is 41234."""
    shown = 'deepspeed.launcher.runner) echo "RUNNER $*";;'
    ops = '*torch_extensions*) echo "deepspeed_shm_comm cpu_adam /cache/py311_cpu";;'
    port = "*getsockname*) echo 41234;;"
    env = stand_in_node(tmp_path, f"{ops}\n{port}\n{shown}", gpus=0)
    proc = launch("deepspeed.sh", env)
    assert proc.returncode == 0, proc.stderr
    assert (
        "deepspeed.sh: DeepSpeed builds its C++ op(s) deepspeed_shm_comm, cpu_adam on first use, "
        "into /cache/py311_cpu: about 3 minutes each on 2 CPU cores" in proc.stderr
    )
    assert "--master_port 41234 " in proc.stdout
    assert "--master_port 29999 " in launch("deepspeed.sh", env | {"MASTER_PORT": "29999"}).stdout
    (tmp_path / "hosts").write_text("node0 slots=2\n")
    multi = launch("deepspeed.sh", env | {"HOSTFILE": str(tmp_path / "hosts")})
    assert "--master_port" not in multi.stdout, multi.stdout  # the runner's own, on node 0
    (tmp_path / "built").mkdir()
    built = launch("deepspeed.sh", stand_in_node(tmp_path / "built", f"{port}\n{shown}"))
    assert "C++ op" not in built.stderr and "--master_port 41234 " in built.stdout


def test_deepspeed_sh_checks_that_a_cached_op_was_built_for_this_python(tmp_path):
    """The op-build notice looked only for the op's .so: one built by another venv or checkout
    into the same torch_extensions cache (which torch then builds again, ~3 minutes, in
    silence) counted as built. Now the op's build.ninja must name this torch's and this
    Python's headers and this DeepSpeed's sources. Stand-in node; the check runs in this
    Python, on a cache in tmp_path."""
    import sysconfig
    from importlib.util import find_spec

    from torch.utils.cpp_extension import include_paths

    spec = find_spec("deepspeed")
    if spec is None or spec.origin is None:
        pytest.skip("DeepSpeed is not installed")
    source = Path(spec.origin)  # (a file of this DeepSpeed: the sources' folder is what counts)
    arms = f'*torch_extensions*) exec {sys.executable} "$@";;'
    cache = tmp_path / "cache"
    env = stand_in_node(tmp_path, arms, gpus=0) | {"TORCH_EXTENSIONS_DIR": str(cache)}
    op = cache / "deepspeed_shm_comm"
    op.mkdir(parents=True)
    ours = [include_paths()[0], sysconfig.get_paths()["include"]]

    def cached(headers: list[str], src: Path) -> str:
        flags = " ".join(f"-isystem {h}" for h in headers)
        (op / "build.ninja").write_text(
            f"cflags = -I{src.parent}/includes {flags}\n"
            f"rule compile\n  command = $cxx $cflags -c $in -o $out\n"
            f"build shm.o: compile {src}\nbuild deepspeed_shm_comm.so: link shm.o\n"
        )
        (op / "deepspeed_shm_comm.so").write_bytes(b"")  # (newer than the sources)
        return launch("deepspeed.sh", env).stderr

    notice = "DeepSpeed builds its C++ op(s) deepspeed_shm_comm on first use, into"
    assert notice not in cached(ours, source)
    other = ["/other/venv/lib/python3.11/site-packages/torch/include", ours[1]]
    assert notice in cached(other, source)  # another venv's torch
    assert notice in cached(ours, Path("/other/checkout/deepspeed/ops/csrc/shm.cpp"))
    (op / "build.ninja").unlink()  # a .so alone
    assert f"{notice} {cache}: about 3 minutes" in launch("deepspeed.sh", env).stderr


def _stop_signals_as_a_terminal_has_them() -> None:
    """A suite started in the background or under nohup ignores SIGINT / SIGHUP, and a signal
    ignored at exec stays ignored: the launcher under test could not trap it."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def signal_launcher(script: str, env: dict[str, str], ready: Path, sig: signal.Signals, *args):
    """Start `script` (tiny.yaml, `args`), send `sig` once `ready` exists; (exit code, stdout)."""
    cmd = ["bash", str(REPO / "launch" / script), "tiny.yaml", *args]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, start_new_session=True, text=True,
        preexec_fn=_stop_signals_as_a_terminal_has_them,
    )  # fmt: skip
    try:
        for _ in range(600):  # up to 30 s on a loaded machine
            if ready.exists():
                break
            time.sleep(0.05)
        assert ready.exists()
        proc.send_signal(sig)
        out = proc.communicate(timeout=60)[0]
        return proc.returncode, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_to_deepspeed_sh_reaches_the_workers(tmp_path, sig):
    """deepspeed.sh exec'd DeepSpeed's runner, which passes signals on only in multi-node runs:
    a SIGTERM ended the runner and the workers trained on. Now every process of the run gets
    SIGTERM (a SIGINT would end the runner with a traceback), the script waits for the workers
    to stop, then ends as every launcher does: the stop line, 128 + the signal's number.
    Stand-in: a runner that exits 7 on SIGTERM, with a worker (which it does not signal) that
    takes a moment to stop."""
    worker = 'trap "sleep 0.3; echo stopped > \\"$0\\"; exit 0" TERM; '
    worker += 'touch "$0.ready"; sleep 60 & wait'
    runner = f"deepspeed.launcher.runner) trap 'exit 7' TERM; sh -c '{worker}' \"$MARK\" & wait;;"
    mark = tmp_path / "stopped"
    env = stand_in_node(tmp_path, runner) | {"MARK": str(mark)}
    code, out = signal_launcher("deepspeed.sh", env, mark.with_name("stopped.ready"), sig)
    assert code == 128 + sig and mark.read_text() == "stopped\n"
    # (the stand-in Python names no checkpoint: the line without it)
    assert out.splitlines()[-1] == (
        f"stopped by {sig.name}; continue with: bash {REPO}/launch/deepspeed.sh tiny.yaml"
    )


# torchrun stand-in: starts a worker in a session of its own (as torchrun does), notes any signal
# it gets itself in MARK.agent, and exits with the worker's code; the worker notes the signal it
# gets in MARK and exits 0, as a rank that saved its checkpoint does.
STAND_IN_AGENT = """import signal, subprocess, sys
mark = sys.argv[1]
got = []
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, lambda n, f: got.append(signal.Signals(n).name))
worker = subprocess.Popen([sys.executable, "-c", sys.argv[2], mark], start_new_session=True)
code = worker.wait()
open(mark + ".agent", "w").write(" ".join(got))
sys.exit(code)
"""
STAND_IN_WORKER = """import pathlib, signal, sys, time
mark = pathlib.Path(sys.argv[1])
def stop(n, f):
    mark.write_text(signal.Signals(n).name)
    sys.exit(0)
for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, stop)
mark.with_suffix(".ready").touch()
time.sleep(60)
"""


@pytest.mark.parametrize(
    ("script", "sig", "worker_got"),
    [
        ("torchrun.sh", signal.SIGTERM, "SIGTERM"),
        ("torchrun.sh", signal.SIGINT, "SIGINT"),
        ("2xh100.sh", signal.SIGHUP, "SIGTERM"),  # (the trainer stops on SIGTERM and SIGINT)
    ],
)
def test_a_stop_signal_to_the_torchrun_launchers_ends_with_the_checkpoint(
    tmp_path, script, sig, worker_got
):
    """torchrun.sh and 2xh100.sh exec'd torchrun: on SIGTERM its agent stopped the workers, then
    printed ~25 lines of SignalException traceback and exited 1. Now the launcher passes the
    signal to the workers (torchrun sees them checkpoint and exit 0), prints where the checkpoint
    is and how to continue (the real stop line, for a run dir holding step 3), and exits 128 +
    the signal's number. Stand-ins for torchrun and a worker; the stop line is computed by
    this Python."""
    agent, worker = tmp_path / "agent.py", tmp_path / "worker.py"
    agent.write_text(STAND_IN_AGENT)
    worker.write_text(STAND_IN_WORKER)
    arms = f"""*torch.distributed.run*) exec {sys.executable} {agent} "$MARK" "$(cat {worker})";;
*stop_line*) exec {sys.executable} "$@";;"""
    mark = tmp_path / "stopped"
    env = stand_in_node(tmp_path, arms, gpus=0) | {"MARK": str(mark)}
    checkpoint = tmp_path / "runs" / "r" / "checkpoints" / "step_00000003"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer.pt").write_bytes(b"")
    args = ["--set", f"run.dir={tmp_path / 'runs'}", "--set", "run.name=r"]
    code, out = signal_launcher(script, env, mark.with_suffix(".ready"), sig, *args)
    assert code == 128 + sig, out
    assert mark.read_text() == worker_got and (tmp_path / "stopped.agent").read_text() == ""
    assert out.splitlines()[-1] == (
        f"stopped by {sig.name}: checkpoint {checkpoint} (step 3 of 150); continue with: "
        f"bash {REPO}/launch/{script} tiny.yaml --set run.dir={tmp_path}/runs --set run.name=r"
    )


def test_torchrun_sh_needs_each_nodes_rank(tmp_path):
    """NODE_RANK defaulted to 0, so a node started without it was a second node 0."""
    env = stand_in_node(tmp_path, PRINT_LAUNCH) | {"MASTER_ADDR": "node0"}
    proc = launch("torchrun.sh", env | {"NNODES": "2"})
    assert proc.returncode == 2 and not proc.stdout
    assert "NODE_RANK is not set" in proc.stderr and "set NODE_RANK" in proc.stderr
    proc = launch("torchrun.sh", env | {"NODE_RANK": "1"})  # and NNODES left at 1
    assert proc.returncode == 2 and "set NNODES" in proc.stderr and not proc.stdout
    proc = launch("torchrun.sh", env | {"NNODES": "2", "NODE_RANK": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "--nnodes 2 --node_rank 1 " in proc.stdout


def test_launchers_refuse_a_missing_master_addr_or_a_bad_port_before_any_work(tmp_path):
    """torchrun.sh on node 0 of 2 without MASTER_ADDR prepared the data, then bash's `:?` said so
    (exit 1); a MASTER_PORT that is no port reached torchrun / DeepSpeed (a traceback)."""
    env = stand_in_node(tmp_path, PRINT_LAUNCH + '\nscale_llm) echo "ran $*";;')
    proc = launch("torchrun.sh", env | {"NNODES": "2", "NODE_RANK": "0"})
    assert proc.returncode == 2 and not proc.stdout, proc.stdout
    assert "MASTER_ADDR is not set; set MASTER_ADDR on every node" in proc.stderr
    multi = {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "node0"}
    for script, more in (("torchrun.sh", multi), ("torchrun.sh", {}), ("deepspeed.sh", {})):
        for port in ("99999", "abc", "0", "-1", "080"):
            proc = launch(script, env | more | {"MASTER_PORT": port})
            assert proc.returncode == 2 and not proc.stdout, (script, port, proc.stdout)
            assert f"{script}: MASTER_PORT='{port}' is not a TCP port" in proc.stderr
    proc = launch("torchrun.sh", env | multi | {"MASTER_PORT": "65535"})
    assert proc.returncode == 0 and "--master_port 65535 " in proc.stdout, proc.stderr


def test_slurm_sbatch_gives_each_job_its_own_port_and_its_cores(tmp_path):
    """Two jobs on one node both took MASTER_PORT 29500; srun (Slurm 22.05+) does not pass on the
    job's --cpus-per-task by itself."""
    env = stand_in_node(tmp_path, PRINT_LAUNCH)
    slurm = {"scontrol": "echo node7; echo node8", "srun": 'echo "$MASTER_PORT $*"'}
    for name, body in slurm.items():
        (tmp_path / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / "bin" / name).chmod(0o755)
    env |= {"SLURM_JOB_ID": "123456", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[7-8]"}
    env |= {"SLURM_CPUS_PER_TASK": "64", "SLURM_SUBMIT_DIR": str(REPO)}
    proc = launch("slurm.sbatch", env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("13456 --kill-on-bad-exit=1 --cpus-per-task=64 bash -c ")
    # a SLURM_JOB_ID left in a shell outside a job: `SLURM_NNODES: unbound variable`, exit 1
    bare = {k: v for k, v in env.items() if k != "SLURM_NNODES"}
    proc = launch("slurm.sbatch", bare)
    assert proc.returncode == 2 and not proc.stdout, proc.stderr
    assert "SLURM_JOB_ID is set, but SLURM_NNODES is missing here" in proc.stderr
    (tmp_path / "bin" / "srun").unlink()  # (srun: command not found, exit 127)
    proc = launch("slurm.sbatch", env)
    assert proc.returncode == 2 and "but srun is missing here" in proc.stderr
    (tmp_path / "bin" / "srun").write_text(f"#!/bin/sh\n{slurm['srun']}\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    proc = launch("slurm.sbatch", env | {"MASTER_PORT": "29999"})
    assert proc.stdout.startswith("29999 "), proc.stderr
    proc = launch("slurm.sbatch", env | {"MASTER_PORT": "2e4"})
    assert proc.returncode == 2 and not proc.stdout
    assert "slurm.sbatch: MASTER_PORT='2e4' is not a TCP port" in proc.stderr
    # bash's arithmetic evaluated the job id as an expression: a command in it ran
    planted = f"HOME[$(touch {tmp_path / 'ran'})0]"
    proc = launch("slurm.sbatch", env | {"SLURM_JOB_ID": planted})
    assert proc.returncode == 2 and not proc.stdout and not (tmp_path / "ran").exists()
    assert "slurm.sbatch: SLURM_JOB_ID='HOME[$(touch " in proc.stderr
    proc = launch("slurm.sbatch", env | {"SLURM_JOB_ID": "0099"})  # (not octal)
    assert proc.stdout.startswith("10099 "), proc.stderr
    # submitted from elsewhere: Slurm runs a spool copy, so the checkout is not found beside it
    proc = launch("slurm.sbatch", env | {"SLURM_SUBMIT_DIR": str(tmp_path)})
    assert proc.returncode == 2 and "is not a scale_llm checkout" in proc.stderr
    assert "SCALE_LLM_ROOT" in proc.stderr and not proc.stdout
    proc = launch(
        "slurm.sbatch", env | {"SLURM_SUBMIT_DIR": str(tmp_path), "SCALE_LLM_ROOT": str(REPO)}
    )
    assert proc.returncode == 0 and proc.stdout.startswith("13456 "), proc.stderr
    # a launch/ planted in a shared working folder ran as the user who submitted from there
    shared, ran = tmp_path / "shared", tmp_path / "ran"
    (shared / "launch").mkdir(parents=True)
    for name in ("_env.sh", "torchrun.sh"):
        (shared / "launch" / name).write_text(f"touch {ran}\n")
    shared.chmod(0o777)
    proc = launch("slurm.sbatch", env | {"SLURM_SUBMIT_DIR": str(shared)})
    assert proc.returncode == 2 and not proc.stdout and not ran.exists()
    assert f"slurm.sbatch: {shared} can be written into by other users, and the job" in proc.stderr
    assert "from your own checkout's root" in proc.stderr
    shared.chmod(0o755)
    (shared / "launch" / "torchrun.sh").chmod(0o757)
    proc = launch("slurm.sbatch", env | {"SLURM_SUBMIT_DIR": str(shared)})
    assert f"{shared}/launch/torchrun.sh can be written into" in proc.stderr and not ran.exists()
    if os.getuid() == 0:  # (only root can give a file away) another user's checkout
        (shared / "launch" / "torchrun.sh").chmod(0o755)
        os.chown(shared / "launch" / "_env.sh", 65534, 65534)
        proc = launch("slurm.sbatch", env | {"SLURM_SUBMIT_DIR": str(shared)})
        assert "_env.sh belongs to another user (uid 65534)" in proc.stderr and not ran.exists()


def test_shipped_configs_are_found_by_name_from_any_directory(tmp_path, monkeypatch):
    from scale_llm.cli import main
    from scale_llm.config import load_config
    from scale_llm.errors import UserError

    monkeypatch.chdir(tmp_path)  # no yaml/ here
    assert load_config("tiny").run.name == "tiny"
    fsdp = load_config("400m-fsdp.yaml")  # `base: 400m.yaml` resolves beside it
    assert fsdp.parallel.backend == "fsdp" and fsdp.model.d_model == 1024
    (tmp_path / "tiny").mkdir()  # a directory of that name is not a config: the shipped one is
    assert load_config("tiny").model.d_model == 192
    with pytest.raises(UserError, match=r"Shipped configs \(by name\): 125m, 1b, 400m"):
        load_config("tinyy")
    assert main(["config", "7b", "--set", "train.max_steps=3"]) == 0


def test_a_wheel_installs_with_its_configs_and_runs_from_anywhere(tmp_path):
    """A wheel install carries the configs and launchers. Build the wheel, install it into
    a fresh venv (its dependencies borrowed from this one through a .pth file, no download),
    and run `scale-llm prepare tiny && scale-llm train tiny --train_steps 2` elsewhere."""
    import site
    import sysconfig

    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(wheels), str(REPO)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("scale_llm-*.whl")
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(fresh), "platbase": str(fresh)}))
    (purelib / "deps.pth").write_text(
        "\n".join(p for p in site.getsitepackages() if "site-packages" in p) + "\n"
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(fresh / "bin" / "python"), "install"]
        + ["--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    small = ["--set", "data.max_documents=150", "--set", "data.tokenizer_sample_bytes=400000"]

    def run(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [str(fresh / "bin" / "scale-llm"), *args],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    where = run("config", "--paths").stdout
    assert f"configs: {purelib / 'scale_llm' / 'configs'}" in where
    assert f"launchers: {purelib / 'scale_llm' / 'launch'}" in where
    assert str(REPO) not in where  # not the checkout
    # the check's and the roofline's configs (gpu-check.sh's too: it reads check's) are the wheel's
    code = "from scale_llm.analysis import check, roofline; print(check.YAML, roofline.YAML)"
    python = fresh / "bin" / "python"
    proc = subprocess.run([python, "-c", code], cwd=work, env=env, capture_output=True, text=True)
    assert proc.stdout.split() == [str(purelib / "scale_llm" / "configs")] * 2, proc.stderr
    run("prepare", "tiny", *small)
    proc = run("train", "tiny", *small, "--train_steps", "2", "--set", "eval.every=0")
    assert "done: 2 steps" in proc.stderr + proc.stdout
    assert (work / "runs" / "tiny" / "checkpoints" / "step_00000002").is_dir()


def test_the_long_description_gets_absolute_links():
    env = {**os.environ, "SCALE_LLM_SOURCE_URL": "https://example.invalid/src/main/"}
    proc = subprocess.run(
        [sys.executable, "setup.py", "--long-description"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    links = [line for line in proc.stdout.splitlines() if "](" in line]
    assert any("](https://example.invalid/src/main/docs/config.md)" in x for x in links)
    assert not any("](docs/" in x or "](yaml/" in x for x in links)


def stand_in_checkout(root: Path) -> Path:
    """A checkout at `root` with the real quickstart.sh, whose setup.sh makes a .venv of stand-ins:
    its python is this Python, its scale-llm prints its arguments. Returns quickstart.sh."""
    (root / "launch").mkdir(parents=True)
    (root / "yaml").symlink_to(REPO / "yaml")
    quickstart = root / "launch" / "quickstart.sh"
    quickstart.write_text((REPO / "launch" / "quickstart.sh").read_text())
    (root / "launch" / "setup.sh").write_text(
        f'v="${{SCALE_LLM_VENV:-.venv}}/bin"\nmkdir -p "$v"\n'
        f'printf \'#!/bin/sh\\nexec {sys.executable} "$@"\\n\' > "$v/python"\n'
        'printf \'#!/bin/sh\\necho scale-llm "$*"\\n\' > "$v/scale-llm"\n'
        "chmod +x \"$v\"/*\necho 'setup.sh: ready'\n"
    )
    return quickstart


def test_the_quickstart_says_each_phase_and_ends_with_the_next_commands(tmp_path):
    """A first quickstart sat silent through the venv's install (pip -q, minutes) and ended with
    the sample. Now a line opens each phase and the last lines give the commands that look at
    the run, with its paths. A checkout whose setup.sh and scale-llm are stand-ins (the config
    is read by this Python), started from another directory."""
    root = tmp_path / "checkout"
    quickstart = stand_in_checkout(root)
    (tmp_path / "elsewhere").mkdir()
    proc = subprocess.run(
        ["bash", str(quickstart)], cwd=tmp_path / "elsewhere", capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == [
        "quickstart.sh: [1/4] setting up .venv (first time: a few minutes; PyTorch and the "
        "other dependencies are downloaded, with pip's progress below)",
        "setup.sh: ready",
    ]
    phases = [line for line in lines if line.startswith("quickstart.sh: [")]
    assert phases[1:] == [  # (full paths: the config's relative ones are the checkout's)
        f"quickstart.sh: [2/4] preparing data in {root}/data/builtin-v2048 (first time only: a "
        "tokenizer, then token shards)",
        f"quickstart.sh: [3/4] training {root}/runs/tiny for 150 steps (a step line every "
        "logging.every steps)",
        f"quickstart.sh: [4/4] generating text from {root}/runs/tiny",
    ]
    assert lines.index(phases[1]) + 1 == lines.index("scale-llm prepare --as-train yaml/tiny.yaml")
    assert [line.split("   #")[0] for line in lines[-4:]] == [
        f"Next (from {root}: cd {root}):",
        f"  .venv/bin/tensorboard --logdir {root}/runs",
        f"  .venv/bin/scale-llm runs {root}/runs",
        f"  .venv/bin/scale-llm export {root}/runs/tiny --out exports/tiny",
    ]
    # setup.sh's SCALE_LLM_VENV: the venv the quickstart runs and names (it ran .venv/bin/python)
    venv = {**os.environ, "SCALE_LLM_VENV": str(tmp_path / "my venv")}
    proc = subprocess.run(
        ["bash", str(quickstart)], cwd=root, env=venv, capture_output=True, text=True
    )
    assert proc.returncode == 0 and "\nscale-llm train " in proc.stdout, proc.stderr
    assert proc.stdout.splitlines()[-3].startswith(f"  {tmp_path}/my\\ venv/bin/tensorboard ")


def test_setup_sh_refuses_an_argument_it_does_not_take(tmp_path):
    """`setup.sh --devv` set up the runtime alone, exit 0, without a word."""
    for args in (["--devv"], ["--dev", "extra"]):
        proc = subprocess.run(
            ["bash", str(REPO / "launch" / "setup.sh"), *args], cwd=tmp_path,
            env={**os.environ, "SCALE_LLM_VENV": str(tmp_path / "v")},
            capture_output=True, text=True,
        )  # fmt: skip
        assert proc.returncode == 2 and "use: bash launch/setup.sh [--dev]" in proc.stderr
        assert list(tmp_path.iterdir()) == []


def test_the_quickstart_reads_a_config_from_where_it_started_and_says_a_bad_one(tmp_path):
    """quickstart.sh looked for CONFIG in the checkout, not in the folder it was started from,
    and a bad config or argument was a UserError traceback (exit 1)."""
    root = tmp_path / "checkout"
    quickstart = stand_in_checkout(root)
    here = tmp_path / "elsewhere"
    here.mkdir()
    (here / "mine.yaml").write_text(f"base: {REPO / 'yaml/tiny.yaml'}\ntrain: {{max_steps: 7}}\n")
    run = lambda *args: subprocess.run(
        ["bash", str(quickstart), *args], cwd=here, capture_output=True, text=True
    )
    proc = run("mine.yaml")
    assert proc.returncode == 0, proc.stderr
    assert f"quickstart.sh: [3/4] training {root}/runs/tiny for 7 steps" in proc.stdout
    assert f"scale-llm train {here / 'mine.yaml'}" in proc.stdout
    for args, said in (
        (["nothere.yaml"], "config file nothere.yaml does not exist"),
        (["yaml/tiny.yaml", "--set", "train.lrr=1"], "train.lrr"),
    ):
        proc = run(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith("error: ") and said in proc.stderr, proc.stderr
        assert "[2/4]" not in proc.stdout


def test_torchrun_ends_with_2_when_every_worker_refused_its_input(tmp_path):
    """A refusal found on the ranks (a bad SCALE_LLM_PG_TIMEOUT_MIN, a layout the world does
    not divide): each rank says why in one paragraph and exits 2, and torchrun added its
    ChildFailedError traceback and ended with 1. A worker's crash keeps torchrun's report."""
    (tmp_path / "refuse.py").write_text(
        "import sys\nprint('error: refused', file=sys.stderr)\nsys.exit(int(sys.argv[1]))\n"
    )
    script = f'source {REPO}/launch/_env.sh; "${{TORCHRUN[@]}}" --standalone --nproc_per_node 2 '
    script += 'refuse.py "$1"'
    for code, ends in ((2, 2), (3, 1)):
        proc = subprocess.run(
            ["bash", "-c", script, "bash", str(code)],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == ends, proc.stderr[-2000:]
        assert proc.stderr.count("error: refused") == 2
        assert ("Traceback" in proc.stderr) == (code != 2), proc.stderr[-2000:]


def test_runs_says_a_lock_of_another_host_is_not_checked(four_steps, tmp_path, capsys):
    """A job killed on another node leaves its lock: runs said `running` for ever and hid that
    the run was complete; a row of a negative step was listed as the run's last."""
    from scale_llm.cli import main

    run = shutil.copytree(four_steps, tmp_path / "runs" / "r", symlinks=True)
    (run / ".lock").write_text('{"pid": 1, "host": "gpu-node-17"}')
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": -7, "loss": 2.0}\n')
    assert main(["runs", str(tmp_path / "runs")]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert row.split()[:2] == ["r", "4/4"] and "2.0000" not in row
    assert "complete (locked by pid 1 on gpu-node-17: not checked from here)" in row


def test_the_yaml_and_json_commands_print_warnings_apart_from_what_they_print(
    tmp_path, capsys, four_steps
):
    """A config's warning (a moved key) went to stdout among `config`'s YAML and `estimate
    --json`'s JSON: neither could be read back; generate's warnings (a prompt past the model's
    context) went into the generated text, and runs' into its table."""
    import yaml

    from scale_llm.cli import main

    (tmp_path / "moved.yaml").write_text("model:\n  activation_checkpointing: full\n")
    config = str(tmp_path / "moved.yaml")
    assert main(["config", config]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["activation_checkpointing"]["mode"] == "full"
    assert "model.activation_checkpointing is deprecated" in err
    assert main(["estimate", config, "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) and "is deprecated" in err
    prompt = "def f(x):\n    return x + 1\n" * 40
    assert main(["generate", str(four_steps), "--prompt", prompt, "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert "only its last" in err and "only its last" not in out
    shutil.copytree(four_steps, tmp_path / "runs" / "moved", symlinks=True)
    moved = (tmp_path / "moved.yaml").read_text() + "train:\n  max_steps: 4\n"  # (a run's)
    (tmp_path / "runs" / "moved" / "config.yaml").write_text(moved)
    assert main(["runs", str(tmp_path / "runs")]) == 0
    out, err = capsys.readouterr()
    assert out.split()[:1] == ["run"] and "is deprecated" in err, (out, err)


def test_a_ctrl_c_a_checkpoint_save_wrapped_is_an_interrupt(tmp_path, capsys, monkeypatch):
    """DCP's save catches what interrupts it and raises its CheckpointException (a
    BaseException) with it: a Ctrl-C during a save (bench --checkpoint-io, a second Ctrl-C at
    train's last save) ended in that traceback, exit 1."""
    from torch.distributed.checkpoint.api import CheckpointException

    from scale_llm import cli
    from scale_llm.errors import Stopped

    def saving(args):
        raise CheckpointException("a save", {0: (KeyboardInterrupt(), None)})

    monkeypatch.setitem(cli.COMMANDS, "runs", saving)
    assert cli.main(["runs", str(tmp_path)]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"

    def stopped(args):
        raise CheckpointException("a save", {0: (Stopped(15), None)})

    monkeypatch.setitem(cli.COMMANDS, "runs", stopped)
    assert cli.main(["runs", str(tmp_path)]) == 143
    assert capsys.readouterr().err.strip() == "stopped by SIGTERM"

    def failed(args):
        raise CheckpointException("a save", {0: (OSError(28, "No space left"), None)})

    monkeypatch.setitem(cli.COMMANDS, "runs", failed)
    with pytest.raises(CheckpointException):  # (an internal error keeps its traceback)
        cli.main(["runs", str(tmp_path)])


def test_torchrun_waits_long_enough_for_a_stopped_run_to_checkpoint(tmp_path):
    """After forwarding SIGTERM torchrun kills its workers 30 s later by default: less than a
    large model's last steps and checkpoint. The launchers give it 5 minutes (a user's own
    setting wins), and the Slurm script asks for SIGTERM 5 minutes before the time limit."""
    shown = '*torch.distributed.run*) echo "T=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT";;'
    env = stand_in_node(tmp_path, shown)
    for script in ("torchrun.sh", "2xh100.sh"):
        assert launch(script, env).stdout.strip() == "T=300", script
    assert (
        launch("torchrun.sh", env | {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "900"}).stdout == "T=900\n"
    )
    header = (REPO / "launch" / "slurm.sbatch").read_text()
    assert "\n#SBATCH --signal=TERM@300\n" in header


def test_warnings_carry_their_level_and_info_lines_do_not(capsys):
    import logging

    from scale_llm.log import setup_logging

    setup_logging(0)
    log = logging.getLogger("scale_llm.test")
    log.info("step 1 | loss 7.0")
    log.warning("the LR schedule changed")
    log.error("something broke")
    out = capsys.readouterr().out.splitlines()
    assert [line[9:] for line in out] == [
        "step 1 | loss 7.0",
        "WARNING: the LR schedule changed",
        "ERROR: something broke",
    ]
    assert all(line[2] == line[5] == ":" for line in out)  # HH:MM:SS first


def test_every_option_of_every_command_has_help_and_shows_its_default(monkeypatch):
    """Each command's `--help`: every option says what it does and, where it has a default,
    what that is; only the command's own flags; a command that reads a config says where its
    keys are listed and how --set is written."""
    import argparse

    from scale_llm.cli import COMMANDS, build_parser

    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: excerpts are not wrapped
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == sorted(COMMANDS)
    for name, command in sub.choices.items():
        text = command.format_help()
        for action in command._actions:
            where = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help == argparse.SUPPRESS or (action.help or "").strip(), where
            default = action.default
            silent = default is None or default is False or default in ("", [])
            if action.help != argparse.SUPPRESS and default != argparse.SUPPRESS and not silent:
                assert f"(default: {default})" in text, where
        if any(action.dest == "config" for action in command._actions):
            assert "scale-llm config --keys" in text, name
            assert "e.g. --set train.lr=3e-4" in text, name
        assert ("--report-memory" in text) == (name == "train"), name
    assert "(default: 5GB)" in sub.choices["export"].format_help()  # one that is not None


def test_config_of_a_mixture_shows_no_keys_of_one_source(tmp_path, capsys):
    """`scale-llm config` of a mixture prints its entries, not data.source, text_field, ...
    (which only a one-source config reads), and what it prints loads as the same config."""
    from scale_llm.cli import main
    from scale_llm.config import load_config
    from scale_llm.config.data import PER_SOURCE_KEYS

    path = tmp_path / "mix.yaml"
    path.write_text("data:\n  sources:\n    - {name: web, source: docs}\n    - {name: code}\n")
    capsys.readouterr()
    assert main(["config", str(path)]) == 0
    shown = capsys.readouterr().out
    data = yaml.safe_load(shown)["data"]
    assert not set(PER_SOURCE_KEYS) & set(data), data.keys()
    assert [s["name"] for s in data["sources"]] == ["web", "code"]
    (tmp_path / "shown.yaml").write_text(shown)
    assert load_config(tmp_path / "shown.yaml") == load_config(path)
    assert main(["config"]) == 0  # one source: its keys are shown
    assert set(PER_SOURCE_KEYS) <= set(yaml.safe_load(capsys.readouterr().out)["data"])


@pytest.mark.parametrize(("config", "world"), [("70b", 64), ("7b", 8)])
def test_estimate_of_a_config_for_many_gpus_predicts_for_its_layout(
    config, world, capsys, monkeypatch
):
    """`scale-llm estimate yaml/70b.yaml` exited 2 ("... (none above 1: launch more)"), and
    yaml/7b.yaml was predicted for FSDP2 on one GPU (134 GiB), not the 8 its header sizes it
    for. Now both predict for their parallel.world_size, say so in their first line, and print
    what `--world-size N` prints; $WORLD_SIZE (a launcher's) and --world-size still win."""
    from scale_llm.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(REPO)
    assert main(["estimate", f"yaml/{config}.yaml"]) == 0
    first, *report = capsys.readouterr().out.splitlines()
    assert first == (
        f"world size {world}: the layout yaml/{config}.yaml is written for "
        f"(parallel.world_size); --world-size N for N GPUs"
    )
    assert main(["estimate", f"yaml/{config}.yaml", "--world-size", str(world)]) == 0
    assert capsys.readouterr().out.splitlines() == report
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert main(["estimate", f"yaml/{config}.yaml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["world"] == 16


def test_estimate_of_a_layout_that_needs_more_gpus_gives_the_command_that_works(
    tmp_path, capsys, monkeypatch
):
    """A config with tensor parallelism 2 that states no parallel.world_size: one line, exit 2,
    with the smallest world it resolves on in a command that runs."""
    from scale_llm.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = tmp_path / "mine.yaml"
    config.write_text(f"base: {REPO / 'yaml' / '70b.yaml'}\nparallel: {{world_size: null}}\n")
    assert main(["estimate", str(config)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {config} is laid out for more than one GPU (the smallest world it resolves on "
        f"is 2); give the GPUs the run will use: scale-llm estimate {config} --world-size 2\n"
    )
    assert main(["estimate", str(config), "--world-size", "2"]) == 0
    capsys.readouterr()
    assert main(["estimate", str(REPO / "yaml" / "400m-fsdp.yaml")]) == 0  # (FSDP2, no world)
    assert capsys.readouterr().out.startswith(
        "world size 1 (the default), though parallel.backend=fsdp shards over the GPUs; "
    )


def test_config_preflight_says_what_train_would_find_and_writes_nothing(data_dir, tmp_path, capsys):
    """`scale-llm config CONFIG --preflight` runs train's preflight: one line when the run would
    start, every problem in one report (exit 2) when it would not; no run dir is made."""
    from scale_llm.cli import main
    from tests.helpers import TINY_MODEL, prepared_source

    runs = tmp_path / "runs"
    args = [f"--set={s}" for s in (*TINY_MODEL, *prepared_source(data_dir))]
    args += [f"--set=data.dir={data_dir}"]
    assert main(["config", *args, f"--set=run.dir={runs}", "--preflight"]) == 0
    assert capsys.readouterr().out == f"preflight: ok: a fresh run; run dir {runs}/defaults\n"
    assert not runs.exists()
    (tmp_path / "afile").write_text("mine")
    bad = [*args, f"--set=data.dir={tmp_path / 'nope'}", f"--set=run.dir={tmp_path / 'afile'}"]
    assert main(["config", *bad, "--preflight"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 2 problems stop this launch before any work:\n  - data.dir=")
    assert "holds no prepared shards" in err and "is a file, not a directory" in err
    assert (tmp_path / "afile").read_text() == "mine"
    # as rank 0 of a launch of N processes (it judged a world of one whatever the launch)
    batch = [*args, f"--set=run.dir={runs}", "--set=train.global_batch_size=64"]
    assert main(["config", *batch, "--preflight", "--world-size", "4"]) == 0
    capsys.readouterr()
    assert main(["config", *batch, "--preflight", "--world-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "(launched with 3 processes)" in err and "x world size 3 = " in err
    assert main(["config", *batch, "--world-size", "3"]) == 2
    assert "--world-size: only with --preflight" in capsys.readouterr().err
    # without --world-size: the world the config is laid out for (it judged a world of one)
    assert main(["config", *batch, "--set=parallel.world_size=3", "--preflight"]) == 2
    assert "(launched with 3 processes)" in capsys.readouterr().err
    assert not runs.exists()


def test_values_the_analysis_commands_took_to_a_traceback_or_a_run_that_cannot_pass(
    tmp_path, capsys, monkeypatch
):
    """--bench-mb 1e303 (an OverflowError), check --steps 1 (a full run whose curves cannot
    fall; 0 was blamed on train.max_steps) or --set train.max_steps (it overrode --steps),
    LOCAL_WORLD_SIZE=abc (a ValueError), and bench --roofline of a document-masked model
    (autocast asked about the meta device)."""
    from scale_llm.analysis.memory.host import startup_problem
    from scale_llm.cli import main
    from scale_llm.config import load_config
    from scale_llm.errors import UserError
    from tests.helpers import plan_for

    for argv, said in [
        (["prepare", "--bench", "--bench-mb", "1e303"], "--bench-mb 1e+303: use a number"),
        (["check", str(tmp_path / "c"), "--steps", "1"], "--steps 1: the check's runs take 1"),
        (["check", str(tmp_path / "c"), "--steps", "0"], "--steps 0: the check's runs take 1"),
        (["check", str(tmp_path / "c"), "--set", "train.max_steps=3"], "take --steps N"),
    ]:
        assert main(argv) == 2, argv
        assert said in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "abc")
    cfg = load_config(None, [])
    with pytest.raises(UserError, match="LOCAL_WORLD_SIZE='abc' is not a number of processes"):
        startup_problem(cfg, plan_for(cfg), 1 << 40)
    tiny = str(REPO / "yaml" / "tiny.yaml")
    argv = ["bench", tiny, "--roofline", "H100-SXM", "--set", "model.attention_mask=document"]
    assert main(argv) == 0
