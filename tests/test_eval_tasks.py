"""eval.tasks: lm-eval tasks while training, on the project's offline task (tests/data/eval_task),
with lm-eval itself: scores in metrics.jsonl at eval.tasks_every and the last step, the loss
curve unchanged, a FSDP world's gathered model scored as its checkpoint is by `scale-llm eval`,
and a task that cannot be read refused before any work."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scale_llm.errors import UserError
from scale_llm.train.metrics import _tb_tag
from tests.helpers import (
    REPO,
    common,
    env,
    make_config,
    plan_for,
    rows_of,
    run,
    sets,
    torchrun,
    trainer_for,
)

pytest.importorskip("lm_eval")
TASKS = REPO / "tests" / "data" / "eval_task"  # its data file is relative to the repository root


def test_tasks_run_at_their_steps_and_leave_the_loss_curve_alone(data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    plain = make_config(data_dir, tmp_path, "run.name=plain", "train.max_steps=3")
    cfg = make_config(
        data_dir,
        tmp_path,
        "train.max_steps=3",
        "eval.tasks=scale_llm_tiny_mc",
        f"eval.tasks_include_path={TASKS}",
        "eval.tasks_every=2",
        "eval.tasks_limit=4",
    )
    import transformers

    kernels, real = [], transformers.PreTrainedModel.set_use_kernels
    monkeypatch.setattr(  # (from_pretrained says there whether it fetches Hub kernels)
        transformers.PreTrainedModel,
        "set_use_kernels",
        lambda model, use, *a, **kw: kernels.append(use) or real(model, use, *a, **kw),
    )
    expected = trainer_for(plain).fit().losses
    assert trainer_for(cfg).fit().losses == expected
    assert kernels == [False, False]  # scored twice, never with kernels fetched from the Hub
    rows = rows_of(cfg.run_dir)
    scored = [s for s, row in rows.items() if "eval/scale_llm_tiny_mc/acc" in row]
    assert scored == [2, 3]  # every 2 steps, and the last
    assert all(0 <= rows[s]["eval/scale_llm_tiny_mc/acc_norm"] <= 1 for s in scored)
    assert not list(cfg.run_dir.glob(".eval-tasks-*"))  # the scratch export is gone
    assert _tb_tag("eval/scale_llm_tiny_mc/acc") == "eval/scale_llm_tiny_mc/acc"


def test_a_task_whose_data_is_missing_is_refused_before_any_work(data_dir, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    yaml = (TASKS / "tiny_mc.yaml").read_text().replace("scale_llm_tiny_mc", "gone_mc")
    (tasks / "gone.yaml").write_text(yaml.replace("tests/data/eval_task", str(tmp_path / "no")))
    cfg = make_config(data_dir, tmp_path, "eval.tasks=gone_mc", f"eval.tasks_include_path={tasks}")
    with pytest.raises(UserError, match=r"^eval.tasks gone_mc: lm-eval could not read"):
        trainer_for(cfg)
    assert not cfg.run_dir.exists()


GENERATING = f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {TASKS / "tiny_mc.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: question
doc_to_target: "{{{{choices[answer]}}}}"
metric_list:
  - metric: exact_match
"""


def test_a_generating_task_longer_than_the_window_is_refused_before_any_work(data_dir, tmp_path):
    """lm-eval asserts a generation leaves room for a prompt in the model's window: a task
    generating lm-eval's default 256 tokens on a 32-token model is refused at start, not a
    warning at every evaluation."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "gen.yaml").write_text(GENERATING)
    cfg = make_config(data_dir, tmp_path, "eval.tasks=tiny_gen", f"eval.tasks_include_path={tasks}")
    with pytest.raises(UserError, match=r"^eval.tasks tiny_gen: it generates up to 256 tokens"):
        trainer_for(cfg)
    assert not cfg.run_dir.exists()
    (tasks / "gen.yaml").write_text(GENERATING + "generation_kwargs:\n  max_gen_toks: 32\n")
    with pytest.raises(UserError, match=r"up to 32 tokens .* model.seq_len=32 .*N below 32"):
        trainer_for(cfg)
    (tasks / "gen.yaml").write_text(GENERATING + "generation_kwargs:\n  max_gen_toks: 8\n")
    assert trainer_for(cfg).step == 0  # (the tasks checked, and built)


def test_fsdp_world_scores_the_whole_model_as_scale_llm_eval_does(data_dir, tmp_path, monkeypatch):
    """Rank 0 scores the weights every rank gathered; `scale-llm eval` of the step-4
    checkpoint (the same weights, read from the files) gives the same perplexity."""
    from scale_llm.evaluate import eval_run

    task = "scale_llm_tiny_rolling"  # continuous metrics: equal only for equal weights
    args = [
        *common(data_dir, tmp_path, "fsdp"),
        *sets("parallel.backend=fsdp", f"eval.tasks={task}", f"eval.tasks_include_path={TASKS}"),
        *sets("eval.tasks_limit=4", "checkpoint.every=0"),
    ]
    monkeypatch.chdir(REPO)
    run(torchrun(2, *args), cwd=REPO)
    during = rows_of(tmp_path / "fsdp")[4]
    cfg = make_config(data_dir, tmp_path, "run.name=fsdp")
    after = eval_run(tmp_path / "fsdp", plan_for(cfg), [task], 4, TASKS)[1]["tasks"][task]
    assert math.isclose(
        during[f"eval/{task}/word_perplexity"], after["word_perplexity"], rel_tol=1e-4
    )
    assert math.isclose(during[f"eval/{task}/bits_per_byte"], after["bits_per_byte"], rel_tol=1e-4)


def test_an_unknown_task_stops_every_rank_with_the_message(data_dir, tmp_path):
    """Rank 0 looks the tasks up; the other ranks stop with it, before the model is sharded
    (they would otherwise wait in FSDP's broadcast for a rank that left)."""
    import subprocess

    from tests.helpers import env

    args = [
        *common(data_dir, tmp_path, "fsdp"),
        *sets(
            "parallel.backend=fsdp", "eval.tasks=no_such_task", f"eval.tasks_include_path={TASKS}"
        ),
    ]
    proc = subprocess.run(
        torchrun(2, *args), cwd=REPO, env=env(), capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: eval.tasks: no_such_task not found" in out
    assert "error: eval.tasks: rank 0 could not use the tasks" in out
    assert "[rank1]: Traceback" not in out and "[rank0]: Traceback" not in out
    assert not (tmp_path / "fsdp").exists()


def test_a_name_no_built_in_task_file_holds_is_refused_without_indexing_the_registry(
    monkeypatch,
):
    """lm-eval's task manager indexes its ~14k task files (~15 s) when built with its
    registry: a name that none of those files holds is refused before that."""
    import lm_eval.tasks

    from scale_llm.evaluate import task_manager

    def no_registry(*args, include_defaults=True, **kwargs):
        assert not include_defaults, "the registry was indexed"
        return real(*args, include_defaults=include_defaults, **kwargs)

    real = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", no_registry)
    with pytest.raises(UserError, match="hellaswg_typo not found in lm-eval's registry"):
        task_manager(["hellaswg_typo"], None)
    with pytest.raises(UserError, match="nope_task not found in lm-eval's registry or in"):
        task_manager(["scale_llm_tiny_mc", "nope_task"], TASKS)


def test_a_killed_launchs_scratch_export_is_removed_by_the_next_and_never_counted(
    data_dir, tmp_path, monkeypatch
):
    """A launch killed while lm-eval ran left RUN_DIR/.eval-tasks-XXXX (a whole export) behind:
    `runs` counted it as the run's size and no launch removed it. Now the next launch that owns
    the run dir removes it (only a folder its marker proves eval.tasks'), and `runs` leaves it
    out meanwhile."""
    import scale_llm.evaluate as evaluate
    import scale_llm.train.eval_tasks as eval_tasks
    from scale_llm.train.runs import disk_usage

    monkeypatch.setattr(evaluate, "task_manager", lambda *args, **kw: None)
    monkeypatch.setattr(evaluate, "run_tasks", lambda *args, **kw: {"t": {"acc": 0.5}})
    with monkeypatch.context() as killed:  # the folder stays, as after a SIGKILL
        killed.setattr(eval_tasks.shutil, "rmtree", lambda *args, **kw: None)
        cfg = make_config(data_dir, tmp_path, "train.max_steps=2", "eval.tasks=t")
        trainer_for(cfg).fit()
    (left,) = cfg.run_dir.glob(".eval-tasks-*")
    mine = cfg.run_dir / ".eval-tasks-mine"  # the same prefix, without eval.tasks' marker
    (mine / "export").mkdir(parents=True)
    (mine / "export" / "notes.txt").write_text("keep")

    def blocks(folder):
        return sum(p.lstat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())

    assert blocks(left / "export") > 100_000  # the model's weights, the tokenizer
    assert disk_usage(cfg.run_dir) == blocks(cfg.run_dir) - blocks(left) - blocks(mine)
    again = make_config(data_dir, tmp_path, "train.max_steps=3", "eval.tasks=t")
    trainer_for(again).fit()
    assert not left.exists() and (mine / "export" / "notes.txt").read_text() == "keep"


def test_lm_eval_reads_the_task_folder_as_it_was_checked(tmp_path, monkeypatch):
    """The folder was checked once, then lm-eval read it again at each evaluation: a !function
    planted after the check ran (in train, at the next eval.tasks step). lm-eval now reads a
    private copy of what was checked; an include outside the folder is refused."""
    import shutil

    from scale_llm import evaluate

    monkeypatch.chdir(REPO)
    tasks, ran = tmp_path / "tasks", tmp_path / "ran"
    shutil.copytree(TASKS, tasks)
    manager = evaluate.task_manager(["scale_llm_tiny_mc"], tasks)
    (tasks / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(ran)!r}).touch()\ndef text(doc):\n    return 'q'\n"
    )
    task = tasks / "tiny_mc.yaml"
    task.write_text(task.read_text().replace("question", "!function evil.text"))
    evaluate.build_task(manager, "scale_llm_tiny_mc", "--tasks")  # as each evaluation loads it
    assert not ran.exists()
    (tmp_path / "shared.yaml").write_text("output_type: multiple_choice\n")
    task.write_text((TASKS / "tiny_mc.yaml").read_text() + "include: ../shared.yaml\n")
    with pytest.raises(UserError, match=r"tiny_mc.yaml: include .*shared.yaml, not in the folder"):
        evaluate.task_manager(["scale_llm_tiny_mc"], tasks)
    (tasks / "sub").mkdir()  # an include inside it, named as lm-eval's own templates are
    (tasks / "sub" / "_template_yaml").write_text("output_type: multiple_choice\n")
    task.write_text((TASKS / "tiny_mc.yaml").read_text() + "include: sub/../sub/_template_yaml\n")
    evaluate.task_manager(["scale_llm_tiny_mc"], tasks)  # copied in too
    (tasks / "sub" / "_template_yaml").write_text("doc_to_text: !function evil.text\n")
    with pytest.raises(UserError, match=r"sub/_template_yaml: !function evil.text"):
        evaluate.task_manager(["scale_llm_tiny_mc"], tasks)


def test_a_task_folder_that_would_run_python_is_refused(tmp_path, monkeypatch):
    """A task folder's `!function utils.f` imports utils.py beside the YAML, and a metric that is
    a path runs a script through evaluate.load: a handed folder (or a config naming one in
    eval.tasks_include_path) ran its code. Refused unless SCALE_LLM_TRUST_TASK_CODE=1."""
    from scale_llm import evaluate

    monkeypatch.chdir(REPO)
    assert evaluate.task_code_problems(TASKS) == []  # the offline tasks stay usable
    ran = tmp_path / "ran"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "utils.py").write_text(
        f"import pathlib\npathlib.Path({str(ran)!r}).touch()\ndef text(doc):\n    return 'q'\n"
    )
    yaml = (TASKS / "tiny_mc.yaml").read_text().replace("scale_llm_tiny_mc", "coded")
    (tasks / "coded.yaml").write_text(
        yaml.replace("doc_to_text: question", "doc_to_text: !function utils.text")
    )
    metric = tmp_path / "metric"
    metric.mkdir()
    (metric / "m.yaml").write_text(yaml.replace("metric: acc_norm", f"metric: {tasks / 'x.py'}"))
    prompt = tmp_path / "prompt"  # (lm-eval reads the file with yaml.full_load, from anywhere)
    prompt.mkdir()
    used = yaml.replace("metric_list:", "use_prompt: p.yaml:q\nmetric_list:")
    (prompt / "p.yaml").write_text(used)
    for folder, said in (
        (tasks, "!function utils.text"),
        (metric, "x.py, not one of lm-eval's"),
        (prompt, "use_prompt p.yaml:q, a file lm-eval reads unchecked"),
    ):
        with pytest.raises(UserError, match="would run Python") as e:
            evaluate.task_manager(
                ["coded"], folder, ("train", "eval.tasks", "eval.tasks_include_path")
            )
        assert said in str(e.value) and "SCALE_LLM_TRUST_TASK_CODE=1" in str(e.value)
    assert not ran.exists()
    odd = tmp_path / "odd"  # what cannot be checked is named, never a traceback or a hang
    odd.mkdir()
    (odd / "deep.yaml").write_text("x: " + "[" * 5000 + "]" * 5000)
    (odd / "loop.yaml").symlink_to(odd / "loop.yaml")
    os.mkfifo(odd / "pipe.yaml")
    (odd / "inc.yaml").write_text(yaml.replace("metric_list:", "include: /dev/zero\nmetric_list:"))
    problems = evaluate.task_code_problems(odd)
    assert len(problems) == 4 and all("cannot be checked" in p for p in problems), problems
    import lm_eval.utils  # task_manager put lm-eval's templates in Jinja's sandbox

    payload = "{{ cycler.__init__.__globals__.os.popen('touch " + str(ran) + "').read() }}"
    with pytest.raises(Exception, match="unsafe|access to attribute"):
        lm_eval.utils.apply_template(payload, {})
    assert not ran.exists() and lm_eval.utils.apply_template("Q: {{q}}", {"q": 1}) == "Q: 1"
    monkeypatch.setenv("SCALE_LLM_TRUST_TASK_CODE", "1")
    evaluate.task_manager(["coded"], tasks)
    assert ran.exists()  # the code the refusal kept from running


def test_a_task_folders_private_copy_goes_with_a_process_that_skips_its_teardown(tmp_path):
    """The checked copy of an include folder lives in the temporary folder until its process
    ends. A gloo world's processes end with os._exit (`exit_without_teardown`), which skipped
    its removal at exit: every rank of every such launch left a scale-llm-tasks-* folder."""
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "t.yaml").write_text("task: t\n")
    (tmp_path / "tmp").mkdir()
    code = (
        "import sys, pathlib\n"
        "from scale_llm.evaluate import checked_task_copy\n"
        "from scale_llm.components.distributed import exit_without_teardown\n"
        "into, problems = checked_task_copy(pathlib.Path(sys.argv[1]))\n"
        "print(into, sorted(p.name for p in into.iterdir()), problems, flush=True)\n"
        "exit_without_teardown(0) if sys.argv[2] == 'world' else sys.exit(0)\n"
    )
    for how in ("world", "plain"):
        proc = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "tasks"), how],
            env=env() | {"TMPDIR": str(tmp_path / "tmp")},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        into, listed = proc.stdout.split(" ", 1)
        assert Path(into).parent == tmp_path / "tmp" and listed.strip() == "['t.yaml'] []"
        assert list((tmp_path / "tmp").iterdir()) == [], how
