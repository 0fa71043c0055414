"""`scale-llm runs [DIR]`: one line per run directory under DIR (run.dir's default, `runs`),
read-only (a live run is told by its lock's owner record). A stopped run is shown as a relaunch
finds it: its newest checkpoint whose files match their record by size, and the rows up to it."""

from __future__ import annotations

import math
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scale_llm.components.checkpoint import TRAINER_STATE, damage, step_of
from scale_llm.config import RunConfig, load_config
from scale_llm.config.load import read_yaml
from scale_llm.config.profile import SCRATCH_PREFIX
from scale_llm.errors import UserError
from scale_llm.files import describe_kind, entries_below, lock_holder
from scale_llm.train.metrics import metric_row
from scale_llm.train.preflight import LOCK, METRICS_FILE

CONFIG_FILE = "config.yaml"
DIVERGED = "diverged"  # a metrics row {"step": N, "stopped": "diverged"}: the trainer's last


@dataclass
class RunSummary:
    name: str
    step: int | None  # the last logged step
    max_steps: int | None
    loss: float | None
    val_loss: float | None
    status: str
    checkpoint: str | None  # the folder name of the checkpoint a relaunch resumes from
    size: int  # bytes on disk


def list_runs(root: str | Path) -> list[RunSummary]:
    """Every run directory in `root` (a run.dir), or `root` itself when it is one."""
    root = Path(root)
    try:  # (stat, not is_dir: a name too long or a folder this user may not enter is said)
        folder = stat.S_ISDIR(root.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        folder = False
    if not folder:
        found = describe_kind(root)
        what = "no such folder" if found == "missing" else f"{found}, not a folder"
        raise UserError(
            f"scale-llm runs {root}: {what}; give the run.dir your runs were written to "
            f"(default: {RunConfig().dir}), or one run directory"
        )
    if (root / CONFIG_FILE).is_file():
        return [summarize(root)]
    return [_listed(p) for p in sorted(root.iterdir()) if _may_be_run(p)]


def _may_be_run(path: Path) -> bool:
    """A folder with a config.yaml, or one this user may not look into (listed as unreadable)."""
    try:
        return stat.S_ISDIR(path.stat().st_mode) and stat.S_ISREG(
            (path / CONFIG_FILE).stat().st_mode
        )
    except PermissionError:
        return True
    except OSError:
        return False


def _listed(run_dir: Path) -> RunSummary:
    """Its summary; another user's private run in a shared run.dir does not hide the others."""
    try:
        return summarize(run_dir)
    except OSError as e:
        return RunSummary(
            run_dir.name, None, None, None, None, f"unreadable ({e.strerror})", None, 0
        )


def summarize(run_dir: Path) -> RunSummary:
    """What one run directory says about its run, read-only (its metrics read once, row by row)."""
    path, max_steps = run_dir / CONFIG_FILE, None
    try:  # (no train section, an empty file: no run's, whose defaults would stand in)
        if "train" in read_yaml(path):
            max_steps = load_config(path).train.max_steps
    except UserError:  # an edited or damaged config.yaml: the rest can still be listed
        pass
    holder = lock_holder(run_dir / LOCK)
    running = holder is not None and " on " not in holder  # (another host's: not checked)
    if holder is not None:  # (its files may change meanwhile: the newest complete one is shown)
        found = complete_checkpoints(run_dir / "checkpoints")
        (ckpt_step, ckpt), damaged = found[-1] if found else (None, None), []
    else:
        (ckpt_step, ckpt), damaged = resumed_checkpoint(run_dir / "checkpoints")
    done = ckpt_step is not None and max_steps is not None and ckpt_step >= max_steps
    status = f"running ({holder})" if running else "complete" if done else "stopped"
    # the last row, loss and val_loss: of every row, and of those up to the checkpoint a
    # relaunch resumes (the rows after it are dropped then)
    seen: dict[str, dict[str, Any]] = {"all": {}, "upto": {}}
    for row in metric_rows(run_dir / METRICS_FILE):
        for part in (
            ("all", "upto") if ckpt_step is not None and row["step"] <= ckpt_step else ("all",)
        ):
            seen[part].update({"row": row}, **{k: row[k] for k in ("loss", "val_loss") if k in row})
    if not running and seen["all"].get("row", {}).get("stopped") == DIVERGED:
        status = DIVERGED  # (its rows: to the step it stopped at)
    if damaged:
        status += f" ({', '.join(damaged)} damaged)"
    kept = seen["upto" if not running and ckpt_step is not None and status != DIVERGED else "all"]
    if status == DIVERGED:  # (the stop's row: its loss, or none where a save stopped it)
        kept = {**kept, "loss": kept["row"].get("loss")}
    step = kept["row"]["step"] if "row" in kept else ckpt_step
    loss, val = _number(kept.get("loss")), _number(kept.get("val_loss"))
    if holder is not None and not running:  # (a job killed there leaves its lock behind)
        status += f" (locked by {holder}: not checked from here)"
    return RunSummary(run_dir.name, step, max_steps, loss, val, status, ckpt, disk_usage(run_dir))


MAX_ROW_BYTES = 1 << 20  # a metrics row is a few hundred bytes: a longer line is skipped unread


def metric_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of metrics.jsonl that are JSON objects with an integer step (others skipped),
    one at a time."""
    if not path.is_file() or path.is_symlink():
        return
    with open(path, "rb") as f:
        while line := f.readline(MAX_ROW_BYTES + 1):
            if len(line) > MAX_ROW_BYTES:  # (the rest of it passed over in bounded reads)
                while line and not line.endswith(b"\n"):
                    line = f.readline(MAX_ROW_BYTES)
                continue
            if (row := metric_row(line)) is not None:
                yield row


def complete_checkpoints(folder: Path) -> list[tuple[int, str]]:
    """(step, name) of every complete checkpoint (a symlinked one is not ours), oldest first."""
    if not folder.is_dir():
        return []
    return sorted(  # (by a resume's rule for their names: step_9 is none)
        (step, p.name)
        for p in folder.iterdir()
        if (step := step_of(p)) >= 0 and not p.is_symlink() and (p / TRAINER_STATE).is_file()
    )


def resumed_checkpoint(folder: Path) -> tuple[tuple[int | None, str | None], list[str]]:
    """((step, name) of the checkpoint `checkpoint.resume=auto` takes, or (None, None); the
    damaged newer ones). Sizes are compared, not checksums: the launch itself reads every byte."""
    damaged = []
    for step, name in reversed(complete_checkpoints(folder)):
        try:
            if damage(folder / name, checksums=False) is None:
                return (step, name), damaged
        except UserError:  # another format: auto stops at it, naming it (row 4.16)
            return (step, name), damaged
        damaged.insert(0, name)
    return (None, None), damaged


def disk_usage(folder: Path) -> int:
    """Bytes the files under `folder` take on disk (symlinks not followed), but for eval.tasks'
    scratch exports: a launch removes them (the one that made them, or the next)."""
    total = 0
    for top in folder.iterdir():
        if top.name.startswith(SCRATCH_PREFIX) and top.is_dir():
            continue
        for path in [top, *(entries_below(top) if top.is_dir() and not top.is_symlink() else ())]:
            try:
                st = path.lstat()
            except OSError:  # removed meanwhile (a live run prunes and renames)
                continue
            total += st.st_blocks * 512 if not stat.S_ISDIR(st.st_mode) else 0
    return total


def _printable(text: str) -> str:
    """`text` with what a terminal would act on (CR, escape sequences) written as escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def format_runs(runs: list[RunSummary], root: str | Path) -> str:
    """The table `scale-llm runs` prints."""
    if not runs:
        return f"no runs in {root} (a run directory holds the config.yaml `train` writes)"
    rows = [("run", "step", "loss", "val_loss", "status", "checkpoint", "size")]
    for r in runs:
        step = f"{'-' if r.step is None else r.step}/{'?' if r.max_steps is None else r.max_steps}"
        cells = (r.name, step, _shown(r.loss), _shown(r.val_loss), r.status)
        rows.append((*cells, r.checkpoint or "-", _size(r.size)))
    rows = [tuple(map(_printable, row)) for row in rows]  # (names and a lock's host: anyone's)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows
    )


def _number(value: Any) -> float | None:
    """A logged value as a float (non-finite ones are logged as strings: "nan", "inf")."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return float(value)
    except (ValueError, OverflowError):  # (an integer of hundreds of digits: written by hand)
        return None


def _shown(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if math.isfinite(value) else str(value)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
