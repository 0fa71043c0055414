"""`scale-llm eval`: lm-eval tasks (on an export in RUN_DIR/export/) and held-out perplexity of a
run's newest good checkpoint, into RUN_DIR/eval/step_N.json and TensorBoard. A resume may train a
step again, so exports and records are reused only with this checkpoint's `checkpoint_digest`."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from scale_llm.components.checkpoint import Checkpointer, checkpoint_digest, read_trainer_state
from scale_llm.components.hf_files import require
from scale_llm.components.loss import cross_entropy, perplexity
from scale_llm.components.precision import Precision
from scale_llm.config import Config
from scale_llm.config.data import SOURCE_NAME, mixture_weights
from scale_llm.config.load import MAX_CONFIG_BYTES
from scale_llm.config.plan import RunPlan
from scale_llm.data.loader import TokenWindows
from scale_llm.data.mixture import MIXTURE
from scale_llm.data.pretrained_tokenizer import named_class_problem
from scale_llm.data.shards import MANIFEST, open_split, read_manifest
from scale_llm.data.tokenizer import EOS_ID, file_sha256, run_tokenizer_path
from scale_llm.errors import UserError, short
from scale_llm.export import (
    DTYPES,
    EXPORT_INFO,
    OLDER,
    export,
    not_an_export,
    publish,
    unwritten_config_keys,
)
from scale_llm.files import (
    OwnerLock,
    atomic_write_json,
    atomic_write_text,
    custom_code_problem,
    describe_kind,
    json_object_or_none,
    read_json,
    stamped_name,
    temporary_folder,
    temporary_sibling,
    unwritable_dir,
)
from scale_llm.generate import load_run, read_run_config, refuse_other_model

log = logging.getLogger(__name__)
LOCK = ".eval.lock"  # in RUN_DIR/eval: held while an eval reads, merges and writes its record
EVENTS_MARK = "scale-llm-eval"  # in the names of the TensorBoard event files eval writes
MADE_BY = "scale-llm eval"  # export info's "made_by" in the exports eval makes (and may replace)


def eval_run(
    run_dir: str | Path,
    plan: RunPlan,
    tasks: list[str] | None = None,
    limit: int | None = None,
    include_path: str | Path | None = None,
    perplexity: str | Path | None = None,
    batch_size: int = 8,
    num_fewshot: int | None = None,
) -> tuple[Path, dict[str, Any]]:
    """(the eval json written, this call's results; "kept" names earlier results it holds)."""
    if not tasks and perplexity is None:
        raise UserError("scale-llm eval needs --tasks T1,T2 and/or --perplexity DATA_DIR")
    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    check_outputs(run_dir, bool(tasks), cfg.logging.tensorboard)  # before any work
    # one eval of a run at a time: each merges its results into the record another would
    # overwrite, and both would export to the same folder
    lock = OwnerLock(run_dir / "eval" / LOCK, f"{run_dir}'s eval", "evaluate a copy of the run")
    made = not (run_dir / "eval").exists()
    lock.acquire(wait=True, on_wait="eval: another eval of this run (%s) is running; waiting")
    try:
        return _eval_locked(
            run_dir, cfg, plan, tasks, limit, include_path, perplexity, batch_size, num_fewshot
        )
    finally:
        lock.release()
        if made:  # (a refused eval leaves no empty folder behind)
            with contextlib.suppress(OSError):
                (run_dir / "eval").rmdir()


def _eval_locked(
    run_dir: Path,
    cfg: Config,
    plan: RunPlan,
    tasks: list[str] | None,
    limit: int | None,
    include_path: str | Path | None,
    perplexity: str | Path | None,
    batch_size: int,
    num_fewshot: int | None,
) -> tuple[Path, dict[str, Any]]:
    if (ckpt := Checkpointer(run_dir, 1).latest_good()) is None:
        raise UserError(f"{run_dir} has no complete checkpoint to evaluate; train it first")
    step, digest = read_trainer_state(ckpt)["step"], checkpoint_digest(ckpt)
    path = run_dir / "eval" / f"{ckpt.name}.json"
    earlier, other = earlier_record(path, digest)
    written = None  # when the results kept were written (UTC)
    if earlier:
        written = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))
    export_dir = run_dir / "export" / ckpt.name
    reuse = bool(tasks) and reusable_export(export_dir, digest)
    manager = None  # (first: the tasks are checked before any export)
    if tasks:
        manager = task_manager(tasks, include_path, shots=num_fewshot, seq_len=cfg.model.seq_len)
    held_out = None  # --perplexity's windows, read and checked before the tasks run
    if perplexity is not None:
        held_out = held_out_sets(run_dir, cfg, ckpt, Path(perplexity), limit)
    new: dict[str, Any] = {"step": step, "checkpoint": str(ckpt), "checkpoint_digest": digest}
    if tasks:
        if not reuse:
            make_eval_export(ckpt, export_dir)
        scores = run_tasks(export_dir, tasks, manager, limit, batch_size, plan.device, num_fewshot)
        version = importlib.metadata.version("lm_eval")
        lm_eval = {"version": version, "limit": limit, "num_fewshot": num_fewshot}
        new.update(tasks=scores, export=str(export_dir), lm_eval=lm_eval)
    if held_out is not None:
        new["perplexity"] = held_out_perplexity(run_dir, cfg, plan, ckpt, held_out, batch_size)
    if other:
        set_aside(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = json_safe(merged(earlier or {}, new))
    if cfg.logging.tensorboard:
        record["tensorboard_file"] = write_scalars(run_dir / "tensorboard", record)
    atomic_write_text(path, json.dumps(record, indent=2, allow_nan=False) + "\n")
    if (replaced := earlier or other) and (
        old := own_events(run_dir / "tensorboard", replaced, ckpt.name)
    ):  # (the record's scalars are all in the new file; other weights' only in theirs, set aside)
        old.unlink(missing_ok=True)
    return path, {**new, "kept": kept(earlier or {}, new), "file": str(path), "written": written}


def write_scalars(folder: Path, record: dict[str, Any]) -> str:
    """Every scalar of an eval record at its step, in a TensorBoard event file of its own (named
    after its checkpoint); the file's name."""
    from torch.utils.tensorboard import SummaryWriter

    scalars = task_scalars(record.get("tasks") or {})
    scalars.update(perplexity_scalars(record["perplexity"]) if "perplexity" in record else {})
    number = lambda v: isinstance(v, int | float) and not isinstance(v, bool)  # noqa: E731
    scalars = {  # (an earlier record's too: numbers, "nan" and "inf" as written)
        tag: float(v) for tag, v in scalars.items() if number(v) or v in NON_FINITE
    }
    suffix = f".{os.urandom(4).hex()}.{EVENTS_MARK}-{Path(record['checkpoint']).name}"
    with SummaryWriter(log_dir=str(folder), filename_suffix=suffix) as writer:
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, record["step"])
    (file,) = folder.glob(f"*{suffix}")
    return file.name


def own_events(folder: Path, earlier: dict[str, Any], name: str) -> Path | None:
    """The event file an earlier eval of checkpoint `name` wrote (its record names it, and its
    name carries eval's mark): replaced by a new one, so TensorBoard shows each step once (and
    not the scores of other weights at that step)."""
    file = earlier.get("tensorboard_file")
    if not isinstance(file, str) or not file.endswith(f".{EVENTS_MARK}-{name}") or "/" in file:
        return None
    return folder / file if (folder / file).is_file() else None


def check_outputs(run_dir: Path, tasks: bool, tensorboard: bool) -> None:
    """Before any work: eval can write its record, its export and TensorBoard's scalars."""
    targets = [(run_dir / "eval", "its results (eval/step_N.json)")]
    if tasks:
        targets.append((run_dir / "export", "the export lm-eval reads"))
    if tensorboard:
        targets.append((run_dir / "tensorboard", "TensorBoard's scalars"))
    for target, what in targets:
        if target.is_symlink() and target.name != "tensorboard":  # (train's is followed too)
            raise UserError(
                f"{target} is a link to {os.path.realpath(target)}; eval writes {what} into "
                f"the run's own folder and would write (and set aside records) where the link "
                f"points, another run's perhaps: replace the link by a folder and run eval again"
            )
        existing, why = unwritable_dir(target) or (None, None)
        if why == "file":
            raise UserError(
                f"{existing} is {describe_kind(existing)}, not a directory; eval writes {what} "
                f"to {target}: move it away and run eval again"
            )
        if why == "read-only":
            raise UserError(
                f"{existing} is not writable by this user, and eval writes {what} to {target}; "
                f"make it writable, or copy the run directory somewhere you can write and "
                f"evaluate the copy"
            )


def earlier_record(path: Path, digest: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(these bytes' earlier record or None; a record of other weights, to set aside, or None)."""
    if not (path.exists() or path.is_symlink()):
        return None, None
    if path.is_symlink() or not path.is_file():
        raise UserError(
            f"{path} is {describe_kind(path)}, not eval's record file; eval writes its results "
            f"there: move it away and run eval again"
        )
    fix = "move it away and run eval again (eval merges only a record it can read)"
    record = read_json(path, "eval's record of earlier results", fix)
    if not (isinstance(record.get("checkpoint"), str) and "step" in record):
        raise UserError(  # (not eval's: kept where it is, never set aside)
            f"{path} is not a record eval wrote (it names no checkpoint and step); eval "
            f"writes its results there: move it away and run eval again"
        )
    if record.get("checkpoint_digest") != digest:
        return None, record
    tasks, ppl = record.get("tasks", {}), record.get("perplexity", {})
    if not (isinstance(tasks, dict) and all(isinstance(m, dict) for m in tasks.values())):
        raise UserError(f"{path}: its tasks are not {{task: {{metric: value}}}}; {fix}")
    if not isinstance(ppl, dict):
        raise UserError(f"{path}: its perplexity is not an object; {fix}")
    settings = record.get("lm_eval", {})
    by_task = settings.get("by_task", {}) if isinstance(settings, dict) else None
    if not (isinstance(by_task, dict) and all(isinstance(s, dict) for s in by_task.values())):
        raise UserError(
            f"{path}: its lm_eval is not {{version, limit, num_fewshot, by_task: {{task: "
            f"{{setting: value}}}}}}; {fix}"
        )
    return record, None


def set_aside(path: Path) -> None:
    """Keep an eval record of other weights at this step under a new name."""
    path.rename(target := stamped_name(path.parent, f"{path.stem}.other-weights", ".json"))
    log.warning(
        f"eval: {path} held results of other weights at this step (not these checkpoint bytes: "
        f"an abandoned branch, or an older record); kept as {target}"
    )


def merged(earlier: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The record of a checkpoint: this call's results over the earlier ones of the same bytes."""
    record = {**earlier, **{k: v for k, v in new.items() if k != "tasks"}}
    if "tasks" in new:  # (lm_eval: this call's settings, and by_task those each task ran with)
        record["tasks"] = {**(earlier.get("tasks") or {}), **new["tasks"]}
        by_task = (earlier.get("lm_eval") or {}).get("by_task") or {}
        by_task = {**by_task, **dict.fromkeys(new["tasks"], new["lm_eval"])}
        record["lm_eval"] = {**new["lm_eval"], "by_task": by_task}
    return record


NON_FINITE = ("nan", "inf", "-inf")  # how records (and metrics.jsonl) write what JSON cannot


def json_safe(value: Any) -> Any:
    """`value` with each NaN or infinite float as the text "nan", "inf" or "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return [json_safe(v) for v in value] if isinstance(value, list) else value


def kept(earlier: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The earlier results this call did not redo (they stay in the record)."""
    names = [t for t in earlier.get("tasks") or {} if t not in new.get("tasks", {})]
    if "perplexity" in earlier and "perplexity" not in new:
        names.append("perplexity")
    return names


def export_for_eval(ckpt: Path, run_dir: Path) -> Path:
    """RUN_DIR/export/step_N: eval's export of exactly these checkpoint bytes, made if needed."""
    out = run_dir / "export" / ckpt.name
    if not reusable_export(out, checkpoint_digest(ckpt)):
        make_eval_export(ckpt, out)
    return out


def reusable_export(out: Path, digest: str) -> bool:
    """Whether `out` is eval's export of these checkpoint bytes; refuses one eval did not make,
    and one to replace that holds files its info does not list."""
    if not (out.exists() or out.is_symlink()):
        return False
    own = out.is_dir() and not out.is_symlink()
    info = (json_object_or_none(out / EXPORT_INFO) if own else None) or {}
    if info.get("made_by") != MADE_BY:
        raise UserError(
            f"{out} exists, but eval did not make it (it is {describe_kind(out)} whose "
            f"{EXPORT_INFO} does not say made_by {MADE_BY!r}); eval exports the checkpoint "
            f"there and replaces only its own exports: move it away and run eval again"
        )
    if reuse := info.get("checkpoint_digest") == digest:
        refuse_custom_code(out)  # (before the tasks are looked up: a planted config.json)
    which, problem = "these" if reuse else "other", not_an_export(out)
    if reuse and not problem and (gone := [f for f in info["files"] if not (out / f).is_file()]):
        problem = (
            f"its {EXPORT_INFO} lists {', '.join(gone)}, which {'are' if gone[1:] else 'is'} gone"
        )
    if problem in OLDER:
        raise UserError(
            f"{out} is eval's export of {which} checkpoint bytes, made before {OLDER[problem]} "
            f"({problem}), so eval cannot prove its files unchanged: move the folder away and "
            f"run eval again"
        )
    if reuse and not problem and info.get("dtype") not in DTYPES:  # (an edit its stats miss)
        problem = f"its {EXPORT_INFO} names dtype {short(info.get('dtype'), 40)}, no export's"
    if reuse and problem:  # scored as it is: only as eval wrote it
        raise UserError(
            f"{out} is eval's export of these checkpoint bytes, but {problem}, so eval cannot "
            f"prove it scores the checkpoint, nor that transformers runs no code from it: move "
            f"the folder away and run eval again (eval then exports the checkpoint afresh)"
        )
    if problem and not reuse:  # replaced below: only the files its info lists
        raise UserError(
            f"{out} is eval's export of other checkpoint bytes, to be replaced by these, but "
            f"{problem}; eval replaces only the files its export wrote: move the others away "
            f"(or the folder) and run eval again"
        )
    return reuse


def refuse_custom_code(export_dir: Path) -> None:
    """An export whose configs name code (eval's own name none) is refused before lm-eval."""
    problem = custom_code_problem(export_dir, "eval's export")
    problem = problem or named_class_problem(export_dir, "eval's export")
    if problem := problem or unwritten_config_keys(export_dir):
        raise UserError(
            f"{problem}. eval did not write this: remove {export_dir} and run eval again"
        )


def make_eval_export(ckpt: Path, out: Path) -> None:
    """Export `ckpt` to `out` marked as eval's: made under a fresh name, renamed into place."""
    staging = temporary_sibling(out, "eval")
    try:
        export(ckpt, staging)
        info = read_json(staging / EXPORT_INFO, "export info", "export it again")
        atomic_write_json(staging / EXPORT_INFO, {**info, "made_by": MADE_BY})
        reusable_export(out, "")  # proved again: `out` may have changed while this one was made
        publish(staging, out)  # over eval's own export (reusable_export refused anything else)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def task_manager(
    tasks: list[str],
    include_path: str | Path | None,
    keys: tuple[str, str, str] = ("scale-llm eval", "--tasks", "--include-path"),
    shots: int | None = None,
    seq_len: int | None = None,
) -> Any:
    """lm-eval's task manager that knows every one of `tasks` (refused before any export), each
    with at least `shots` few-shot examples and, generating, fewer new tokens than `seq_len`.
    `keys`: what messages call the command, the task list and the folder."""
    command, tasks_key, include_key = keys
    require(command, "lm_eval", "transformers", "accelerate")
    import lm_eval.utils
    from jinja2.sandbox import SandboxedEnvironment
    from lm_eval.tasks import TaskManager

    if not isinstance(env := lm_eval.utils.env, SandboxedEnvironment):  # its prompt templates
        # render in Jinja's sandbox: in a plain environment one reaches Python's internals
        # ({{ cycler.__init__.__globals__.os }}); the sandbox refuses _ attributes, unsafe calls
        sandbox = SandboxedEnvironment(loader=env.loader, undefined=env.undefined)
        sandbox.keep_trailing_newline, sandbox.filters = env.keep_trailing_newline, env.filters
        lm_eval.utils.env = sandbox

    if include_path is not None and not Path(include_path).is_dir():
        what = describe_kind(Path(include_path))  # (missing, a file, ...)
        raise UserError(f"{include_key} {include_path} is {what}; give a folder of task YAMLs")
    read_from = include_path  # lm-eval reads the checked copy: a later change runs nothing
    if include_path is not None and os.environ.get(TRUST_TASK_CODE) != "1":
        read_from, problems = checked_task_copy(Path(include_path))
        if problems:
            raise UserError(
                f"{include_key} {include_path}: lm-eval would run Python it names, or a file "
                f"cannot be checked for that: {'; '.join(problems[:3])}"
                f"{'; ...' * (len(problems) > 3)}. If you trust that code, run with "
                f"{TRUST_TASK_CODE}=1 in the environment; otherwise remove those entries"
            )
    local = None
    if read_from is not None:
        local = TaskManager(include_path=str(read_from), include_defaults=False)
    unknown = [t for t in tasks if not (local and t in local.all_tasks) and not _mentioned(t)]
    manager = None
    if not unknown:
        if local is not None and all(t in local.all_tasks for t in tasks):
            manager = local  # (the registry is not indexed)
        else:
            manager = TaskManager(include_path=str(read_from) if read_from else None)
        unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(
            f"{tasks_key}: {', '.join(unknown)} not found in lm-eval's registry"
            + (f" or in {include_path}" if include_path else "")
            + f"; `lm-eval ls tasks` lists them, {include_key} DIR adds a folder of task YAMLs"
        )
    for task in tasks:
        build_task(manager, task, tasks_key, shots, seq_len)
    return manager


TRUST_TASK_CODE = "SCALE_LLM_TRUST_TASK_CODE"  # =1: run the Python a task folder names


def checked_task_copy(folder: Path) -> tuple[Path, list[str]]:
    """A private copy of `folder`'s task YAMLs (those lm-eval indexes, each read once), and what
    in it would make lm-eval run Python; the copy is removed when this process exits."""
    into = temporary_folder("scale-llm-tasks-")
    problems = [p for path in sorted(folder.rglob("*.yaml")) if (p := _copy_in(path, folder, into))]
    found = task_code_problems(into, source=folder)
    return into, problems + [p.replace(str(into), str(folder)) for p in found]


def _copy_in(path: Path, folder: Path, into: Path) -> str | None:
    """Copy `path` of `folder` to the same place in `into`, read once (a named pipe is never
    opened blocking); why it cannot be, or None."""
    if (copy := into / path.relative_to(folder)).exists():
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError("not a regular file")
            if len(data := f.read(MAX_CONFIG_BYTES + 1)) > MAX_CONFIG_BYTES:
                raise OSError("over 1 MB")
    except (OSError, ValueError) as e:  # (ValueError: a NUL in the name)
        return f"{path} cannot be checked ({' '.join(str(e).split())[:160]})"
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_bytes(data)
    return None


def task_code_problems(folder: Path, source: Path | None = None) -> list[str]:
    """What in `folder`'s task YAMLs, or in the files they include, makes lm-eval run Python: a
    tag such as !function (a module beside the YAML), or a metric lm-eval does not register
    (its fallback, evaluate.load, runs a metric script: a local file or one downloaded). With
    `source`, `folder` is its private copy: an include is copied in from `source` as it is
    found, and one outside the folder is refused (lm-eval would read it unchecked, later)."""
    import lm_eval.api.metrics  # noqa: F401  (fills the metric registry)
    from lm_eval.api.registry import metric_registry

    tags: list[str] = []

    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # a tag recorded, not built
        pass

    Loader.add_multi_constructor(
        "!",
        lambda _, tag, node: tags.append(
            f"!{tag} {node.value if isinstance(node.value, str) else '...'} (line "
            f"{node.start_mark.line + 1})"
        ),
    )
    problems, todo, seen = [], sorted(folder.rglob("*.yaml")), set()
    while todo:
        tags.clear()
        try:
            if (path := Path(os.path.realpath(todo.pop()))) in seen:  # (a link loop: no error)
                continue
            seen.add(path)
            if not path.exists():
                raise OSError("no such file")
            if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
                raise OSError("not a regular file, or over 1 MB")
            task = yaml.load(path.read_bytes(), Loader)  # noqa: S506 (a safe loader)
        except (OSError, ValueError, RecursionError, yaml.YAMLError) as e:  # (ValueError: a NUL)
            problems.append(f"{path} cannot be checked ({' '.join(str(e).split())[:160]})")
            continue
        problems += [f"{path}: {tag}" for tag in tags]
        for part in _dicts(task):  # (a group's inline tasks too)
            included = [path.parent / i for i in _listed(part.get("include")) if isinstance(i, str)]
            if source is not None:  # (the copy holds no links: its paths resolve as written)
                inside = [Path(os.path.normpath(i)) for i in included]
                inside = [i for i in inside if i.is_relative_to(folder)]
                outside = [i for i in included if Path(os.path.normpath(i)) not in inside]
                problems += [
                    f"{path}: include {i}, not in the folder (lm-eval would read it unchecked): "
                    f"copy it in and name it relative to this file"
                    for i in outside
                ]
                missing = [_copy_in(source / i.relative_to(folder), source, folder) for i in inside]
                problems += [m for m in missing if m]
                included = [i for i, m in zip(inside, missing) if not m]
            todo += included
            for m in _listed(part.get("metric_list")):
                name = m.get("metric") if isinstance(m, dict) else None
                if isinstance(name, str) and (name not in metric_registry or m.get("hf_evaluate")):
                    problems.append(f"{path}: metric {name}, not one of lm-eval's")
            prompt = part.get("use_prompt")  # (`FILE.yaml:name`: read by yaml.full_load)
            if isinstance(prompt, str) and ".yaml" in prompt.split(":", 1)[0]:
                problems.append(f"{path}: use_prompt {prompt[:99]}, a file lm-eval reads unchecked")
    return problems


def _dicts(value: Any) -> Iterator[dict]:
    """Every mapping in a parsed YAML document, each once (anchors can make a cycle)."""
    todo, seen = [value], set()
    while todo:
        if id(value := todo.pop()) in seen or not isinstance(value, (dict, list)):
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            yield value
        todo += value.values() if isinstance(value, dict) else value


def _listed(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def build_task(
    manager: Any, task: str, tasks_key: str, shots: int | None = None, seq_len: int | None = None
) -> None:
    """Build `task` as lm-eval will: missing data, fewer few-shot examples than `shots`, or a
    generation of `seq_len` tokens or more (lm-eval asserts it leaves room for a prompt),
    refused before the export, not a traceback. Quiet: a refusal is its message alone
    (datasets' progress bars are off while the tasks are built)."""
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        if hasattr(manager, "load"):  # lm-eval >= 0.4.10
            built = manager.load([task])["tasks"]
        else:
            from lm_eval.tasks import get_task_dict

            built = get_task_dict([task], manager)
        # (lm-eval's sampler draws `shots` of them, one more from the split it scores:
        # random.sample's ValueError when fewer)
        pools = {name: pool for name, t in built.items() if (pool := _shot_pool(t, shots))}
        generates = {name: n for name, t in built.items() if (n := _new_tokens(t)) is not None}
    except UserError:
        raise
    except Exception as e:  # lm-eval and datasets raise many types (OSError, ValueError, ...)
        raise UserError(task_data_problem(task, e, tasks_key)) from None
    finally:
        if shown:
            datasets.enable_progress_bars()
    for name, (n, key) in generates.items():
        if seq_len is not None and n >= seq_len:
            raise UserError(
                f"{tasks_key} {name}: it generates up to {n} tokens ({key}), but the "
                f"model reads at most model.seq_len={seq_len} tokens, and lm-eval needs the "
                f"prompt and the generation to fit in them; score it on a model with a longer "
                f"model.seq_len, or copy the task's YAML into an {keys_folder(tasks_key)} "
                f"folder with generation_kwargs: {{max_gen_toks: N}}, N below {seq_len}"
            )
    for name, (have, extra) in pools.items():
        if have < shots + extra:
            scored = " (one of them is the example scored: the task draws from its test split)"
            raise UserError(
                f"--num-fewshot {shots}: task {name} has {have} examples to draw its few-shot "
                f"context from{scored * extra}; give --num-fewshot {max(have - extra, 0)} or "
                f"fewer"
            )


def _shot_pool(task: Any, shots: int | None) -> tuple[int, int] | None:
    """(the examples a task draws `shots` few-shot examples from, 1 when it draws one more
    because they include the example scored); None: no shots, a task whose own config fixes
    num_fewshot: 0 (lm-eval keeps it), or examples not counted before they are drawn."""
    if not shots or not hasattr(task, "fewshot_docs"):
        return None
    config = getattr(task, "config", None)
    if getattr(config, "num_fewshot", None) == 0:
        return None
    try:
        have = len(task.fewshot_docs())
    except TypeError:  # (an iterator, or None)
        return None
    split = getattr(getattr(task, "fewshot_cfg", None), "split", None)
    return have, int(split == getattr(config, "test_split", None))  # (as lm-eval compares)


GENERATED = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # lm-eval's
DEFAULT_NEW_TOKENS = 256  # lm-eval's HF model: a generating task's tokens when it names none


def _new_tokens(task: Any) -> tuple[int, str] | None:
    """The new tokens a generating (generate_until) task asks lm-eval for, and the key that
    says so; None: not one."""
    config = getattr(task, "config", None)
    if getattr(config, "output_type", None) != "generate_until":
        return None
    kwargs = getattr(config, "generation_kwargs", None) or {}
    named = [(kwargs[k], k) for k in GENERATED if isinstance(kwargs.get(k), int)]
    return named[0] if named else (DEFAULT_NEW_TOKENS, "lm-eval's default max_gen_toks")


def keys_folder(tasks_key: str) -> str:
    """The option naming a folder of task YAMLs beside `tasks_key`."""
    return "eval.tasks_include_path" if tasks_key.startswith("eval.") else "--include-path"


def task_data_problem(task: str, error: BaseException, tasks_key: str) -> str:
    """What a task whose data cannot be read needs, by the kind of failure."""
    kind = type(error).__name__
    said = " ".join(str(error).split())[:300] or kind
    head = f"{tasks_key} {task}: lm-eval could not read the task's data ({kind}: {said})"
    on = lambda v: os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
    offline = [v for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE") if on(v)]
    if isinstance(error, FileNotFoundError):
        return (
            f"{head}. A task YAML's data_files are read relative to the working directory "
            f"(here {Path.cwd()}): run eval from the folder they are relative to (for the "
            f"project's test task, the repository root), or write absolute paths in the YAML"
        )
    if isinstance(error, ConnectionError) and offline:
        return (
            f"{head}. Its dataset is not in the local Hugging Face cache (HF_HOME), and "
            f"{' and '.join(f'{v}=1' for v in offline)} forbid{'s' * (len(offline) == 1)} "
            f"downloading it: run the eval once where the network is reachable, without that "
            f"setting (the dataset is cached for later offline runs), or copy that cache here"
        )
    if isinstance(error, ConnectionError):
        return (
            f"{head}. Its dataset is not in the local Hugging Face cache (HF_HOME) and the Hub "
            f"could not be reached: connect this machine, or copy the cache from one that has "
            f"the dataset. Without network, HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 make such "
            f"a task fail at once instead of after the Hub client's retries"
        )
    return (
        f"{head}. Check the task's YAML (dataset_path, dataset_name, dataset_kwargs, the "
        f"split names) or try another task"
    )


def run_tasks(
    export_dir: Path,
    tasks: list[str],
    manager: Any,
    limit: int | None,
    batch_size: int,
    device: torch.device,
    num_fewshot: int | None = None,
) -> dict[str, dict[str, float]]:
    """task -> {metric: value} from `lm_eval.simple_evaluate` on the exported folder."""
    refuse_custom_code(export_dir)
    import lm_eval

    dtype = (json_object_or_none(export_dir / EXPORT_INFO) or {}).get("dtype", "fp32")
    eos = (json_object_or_none(export_dir / "config.json") or {}).get("eos_token_id", EOS_ID)
    model_args = {
        "pretrained": str(export_dir),
        "dtype": str(DTYPES[dtype]).removeprefix("torch."),
        "device": str(device),
        # before a text scored from its start: EOS, as in training's `... [EOS] [BOS] doc`
        # (lm-eval's default BOS scores a BOS after a BOS, which training never shows)
        "prefix_token_id": eos,
        "trust_remote_code": False,  # never a folder's Python, nor a prompt asking for it
        # nor Hub kernels (transformers' default): code fetched while scoring, other numerics
        "use_kernels": False,
    }
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=model_args,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=batch_size,
        task_manager=manager,
        log_samples=False,
    )
    return {task: _metrics(values) for task, values in out["results"].items()}


def task_scalars(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    """eval/<task>/<metric> of each score (standard errors and sample lengths left out)."""
    return {
        f"eval/{task}/{name}": value
        for task, metrics in scores.items()
        for name, value in metrics.items()
        if _shown(name)
    }


def _shown(metric: str) -> bool:
    return "stderr" not in metric and metric != "sample_len"


def _mentioned(task: str) -> bool:
    """Whether lm-eval's task files hold the text `task`: ~1 s, not ~15 s of indexing, to refuse."""
    spec = importlib.util.find_spec("lm_eval.tasks")
    roots = spec.submodule_search_locations if spec else None
    if not roots:
        return True  # (no folder to read: let the task manager say)
    for path in Path(roots[0]).rglob("*"):
        if path.suffix in (".yaml", ".yml", ".py") and path.is_file():
            try:
                if task in path.read_text(errors="replace"):
                    return True
            except OSError:
                return True
    return False


def _metrics(values: dict[str, Any]) -> dict[str, float]:
    """lm-eval's "acc,none" keys as "acc" (other filters as "acc_filter"); only numbers."""
    out = {}
    for key, value in values.items():
        metric, _, filt = key.partition(",")
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[metric if filt in ("", "none") else f"{metric}_{filt}"] = float(value)
    return out


HeldOut = tuple[Path, dict[str, tuple[TokenWindows, int]], dict[str, float] | None, str | None]


def held_out_sets(
    run_dir: Path, cfg: Config, ckpt: Path, data_dir: Path, limit: int | None
) -> HeldOut:
    """--perplexity's validation windows, checked: (data_dir, {source: (windows, how many)} (""
    for a folder alone), a mixture's weights (None: by windows) and what they follow)."""
    state = read_trainer_state(ckpt)
    refuse_other_model(run_dir, ckpt, state, cfg)  # (before the tasks: load_run says it too)
    trained_with = state["tokenizer_sha256"]
    if not (data_dir / MIXTURE).exists() or (data_dir / MANIFEST).exists():
        alone = held_out_windows(run_dir, cfg, data_dir, limit, trained_with)
        return data_dir, {"": alone}, None, None
    names, weights, weighting = mixture_sources(cfg, data_dir)
    found = {}
    for name in names:
        try:
            found[name] = held_out_windows(
                run_dir, cfg, data_dir / name, limit, trained_with, alone=False
            )
        except UserError as e:
            raise UserError(
                f"--perplexity {data_dir} is a mixture; its source {name} ({data_dir / name}): {e}"
            ) from None
    return data_dir, found, weights, weighting


@torch.no_grad()
def held_out_perplexity(
    run_dir: Path, cfg: Config, plan: RunPlan, ckpt: Path, held_out: HeldOut, batch_size: int
) -> dict[str, Any]:
    """Mean next-token loss and its exp over `held_out`'s validation windows, as val_loss; a
    mixture's per source, weighted as training's val_loss is."""
    data_dir, found, weights, weighting = held_out
    head = {"data_dir": str(data_dir), "split": "val"}
    model, _ = load_run(run_dir, cfg, plan, ckpt)
    if list(found) == [""]:
        return {**head, **window_scores(model, *found[""], plan, batch_size)}
    names = list(found)
    sources = {name: window_scores(model, w, n, plan, batch_size) for name, (w, n) in found.items()}
    if weights is None:  # by windows: the mean over every window scored, as one folder's is
        total = sum(found[name][1] for name in names)
        weights = {name: found[name][1] / total for name in names}
    loss = sum(weights[name] * sources[name]["loss"] for name in names)
    for name in names:
        sources[name]["weight"] = weights[name]
    n, tokens = (sum(s[k] for s in sources.values()) for k in ("windows", "tokens"))
    return {**head, **_scores(n, loss, tokens), "weighted_by": weighting, "sources": sources}


def _scores(windows: int, loss: float, tokens: int) -> dict[str, Any]:
    return {"windows": windows, "tokens": tokens, "loss": loss, "ppl": perplexity_of(loss)}


def perplexity_of(loss: float) -> float | str:
    """exp(loss); "inf" past float64 (exp(709.8)) and "nan" for a NaN: JSON has neither."""
    ppl = perplexity(loss)
    return ppl if math.isfinite(ppl) else str(ppl)


def held_out_windows(
    run_dir: Path,
    cfg: Config,
    data_dir: Path,
    limit: int | None,
    trained_with: str,
    alone: bool = True,
) -> tuple[TokenWindows, int]:
    """The validation windows of `data_dir` (encoded with the run's tokenizer, `trained_with`:
    its SHA-256 in the checkpoint); how many. `alone`: --perplexity's folder (not a source of
    a mixture)."""
    try:
        manifest = read_manifest(data_dir)
    except UserError as e:  # (it calls the folder data.dir; a mixture's source: named above)
        said = str(e).replace(f"data.dir={data_dir}", str(data_dir))
        raise UserError(f"--perplexity {data_dir}: {said}" if alone else said) from None
    want = manifest["tokenizer"]["sha256"]
    tok_path = run_tokenizer_path(run_dir, want)
    if not tok_path.is_file():
        raise UserError(
            f"{tok_path} is missing: --perplexity needs the run's tokenizer; copy the data dir's "
            f"{tok_path.name} (the one the run trained with) there"
        )
    if want != trained_with:
        raise UserError(
            f"--perplexity {data_dir}: its tokenizer is not the one {run_dir} trained with; "
            f"give a data dir prepared with the run's tokenizer"
        )
    if file_sha256(tok_path) != trained_with:
        raise UserError(
            f"{tok_path} is not the tokenizer {run_dir} trained with (its checkpoint records "
            f"another SHA-256): it was replaced or damaged; copy {data_dir / tok_path.name}, "
            f"the one the run trained with, back there"
        )
    files = [str(data_dir / x["file"]) for x in manifest["splits"]["val"]["shards"]]
    maps, vocab = open_split(data_dir, manifest, "val"), cfg.model.vocab_size
    windows = TokenWindows(maps, cfg.model.seq_len, vocab, files)  # (ids past the vocabulary)
    n = len(windows) if limit is None else min(limit, len(windows))
    if n == 0:
        raise UserError(f"--perplexity {data_dir}: no validation window of seq_len tokens")
    for start in range(0, n, 4096):  # every id checked before any work
        windows.get(np.arange(start, min(n, start + 4096)))
    return windows, n


def window_scores(
    model: torch.nn.Module, windows: TokenWindows, n: int, plan: RunPlan, batch_size: int
) -> dict[str, Any]:
    """Windows 0..n-1 scored: their mean next-token loss, its exp, the tokens and windows."""
    autocast = Precision(plan.precision, plan.device.type).autocast()
    total, tokens = 0.0, 0
    for start in range(0, n, batch_size):
        batch = windows.get(np.arange(start, min(n, start + batch_size))).to(plan.device)
        with autocast:
            loss = cross_entropy(model(batch[:, :-1]), batch[:, 1:])
        total += loss.item() * batch[:, 1:].numel()
        tokens += batch[:, 1:].numel()
    return _scores(n, total / tokens, tokens)


def mixture_sources(cfg: Config, data_dir: Path) -> tuple[list[str], dict[str, float] | None, str]:
    """(sources, weights, what weighs): the run's data.sources, else mixture.json's by windows."""
    path = data_dir / MIXTURE
    fix = "give the data dir `scale-llm prepare` made for a mixture, or prepare it again"
    record = read_json(path, "a mixture's record", fix)
    names = record.get("sources")
    if not isinstance(names, dict) or not names:
        raise UserError(f"{path} names no prepared source; {fix}")
    if bad := [n for n in names if not SOURCE_NAME.fullmatch(n)]:
        raise UserError(f"{path} names a source {str(bad[0])[:60]!r} that is no folder name; {fix}")
    trained = [s.name for s in cfg.data.sources]
    if trained and set(trained) <= set(names):
        return trained, mixture_weights(cfg.data), "the run's data.sources weights"
    return list(names), None, "validation windows"


def perplexity_scalars(ppl: dict[str, Any]) -> dict[str, float]:
    """eval/perplexity/{loss,ppl}, and a mixture's eval/perplexity/<source>/{loss,ppl}."""
    sources = ppl.get("sources") if isinstance(ppl.get("sources"), dict) else {}
    named = [("", ppl), *((f"{name}/", one) for name, one in sources.items())]
    out = {}
    for n, one in named:
        for k in ("loss", "ppl"):  # (an earlier record's, read back: numbers, "inf", "nan")
            with contextlib.suppress(KeyError, TypeError, ValueError):
                out[f"eval/perplexity/{n}{k}"] = float(one[k])
    return out


def format_record(record: dict[str, Any]) -> str:
    """This call's results (eval_run's second value), and where the earlier ones are."""
    lines = [f"step {record['step']} ({record['checkpoint']})"]
    for task, metrics in record.get("tasks", {}).items():
        shown = ", ".join(f"{k} {float(v):.4f}" for k, v in metrics.items() if _shown(k))
        lines.append(f"  {task}: {shown}")
    if "perplexity" in record:
        p = record["perplexity"]
        lines.append(
            f"  perplexity on {p['data_dir']} ({p['windows']} windows, {p['tokens']} tokens): "
            f"loss {float(p['loss']):.4f}, ppl {float(p['ppl']):.2f}"
            + (f" (sources weighted by {p['weighted_by']})" if "sources" in p else "")
        )
        for name, one in p.get("sources", {}).items():
            lines.append(
                f"    {name}: loss {float(one['loss']):.4f}, ppl {float(one['ppl']):.2f} "
                f"({one['windows']} windows, weight {one['weight']:.3f})"
            )
    if record.get("kept"):
        lines.append(
            f"  (earlier results of these checkpoint bytes, not run again, are kept in "
            f"{record['file']}: {', '.join(record['kept'])}; written {record['written']})"
        )
    return "\n".join(lines)
