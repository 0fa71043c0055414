"""Metric rows to RUN_DIR/metrics.jsonl, and the same scalars to TensorBoard (with the config
as hparams and YAML text, and the samples as text) and optionally Weights & Biases; main rank."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scale_llm.config import Config, dump_yaml, to_dict
from scale_llm.errors import UserError
from scale_llm.evaluate import EVENTS_MARK
from scale_llm.files import atomic_write_text, json_values, require_kind, stamped_name
from scale_llm.train.preflight import METRICS_FILE, RUN_DIR_FILES, WANDB_ID_FILE, wandb_id
from scale_llm.train.resume import flat

log = logging.getLogger(__name__)

TEXT_TAGS = {"samples_text": "samples/text"}  # metrics.jsonl key -> TensorBoard / W&B tag
TRAIN_EVENTS = ".scale-llm-train"  # ends the names of the event files the training writes


class MetricsLogger:
    """Appends one JSON object per logged step; mirrors numeric values to the trackers."""

    def __init__(
        self, run_dir: Path, enabled: bool, cfg: Config, resume_step: int, kept: int | None = None
    ):
        """`kept`: the rows (and events) up to this step are this run's history (default
        resume_step; 0 after another run's checkpoint), the later ones are set aside."""
        self.enabled, self.path = enabled, run_dir / METRICS_FILE
        self.writer = self.wandb = None
        if not enabled:
            return
        kept = resume_step if kept is None else kept
        rows, replaced = _rows(self.path, kept), None
        events = run_dir / "tensorboard"
        stale = _stale_events(events, kept) if rows.past else []  # (before this launch's file)
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # (purge_step: TensorBoard's Python reader also hides any later event it finds)
            self.writer = SummaryWriter(
                str(events), purge_step=kept + 1, filename_suffix=TRAIN_EVENTS
            )
        if rows.past:  # a history rewritten past `kept` (a rewind, a kill, a fresh start):
            if old_id := _new_wandb_id(run_dir):  # the trackers' copies of it go first (a crash
                replaced = (old_id, rows.past)  # in between finds the rows again)
            try:
                _rebuild_events(events, rows.kept_rows, kept, stale, self.writer)
            except OSError as e:  # (logging.tensorboard off, its folder not writable: said)
                log.warning(f"metrics: TensorBoard's events past step {kept} stay ({e})")
        _start_rows(self.path, kept, rows)
        trackers = cfg.logging.tensorboard or cfg.logging.wandb.project
        tracked = flat(to_dict(cfg), tracker=True) if trackers else {}  # as the trackers show it
        if self.writer is not None:
            from torch.utils.tensorboard.summary import hparams

            # the run dir holds the hparams session: the HPARAMS tab lists it with its scalars
            metrics = {"loss/val_loss": math.nan, "loss/loss": math.nan}
            for summary in hparams(tracked, metrics):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config/yaml", _code_block(dump_yaml(cfg)), resume_step)
        if cfg.logging.wandb.project:
            try:
                self.wandb = _start_wandb(cfg, run_dir, kept, replaced, tracked)
            except BaseException:
                self.close()  # (the TensorBoard file written, its thread ended)
                raise

    def log(self, step: int, values: dict[str, Any]) -> None:
        """One row per step: numbers become scalars, `samples_text` a text entry."""
        if not self.enabled:
            return
        row = {"step": step, **{k: _clean(v) for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        scalars, texts = tracked_values(values)
        if self.writer is not None:
            write_events(self.writer, step, scalars, texts)
        if self.wandb is not None:
            self._to_wandb(lambda run: run.log({**scalars, **texts}, step=step))

    def _to_wandb(self, call: Any) -> None:
        """A call into W&B; its failure (its service gone) ends W&B for this launch, not the run."""
        try:
            call(self.wandb)
        except Exception as e:  # (W&B raises its own types, and OSError's)
            log.warning(
                f"wandb: {type(e).__name__}: {str(e).strip()[:200]}; W&B stops logging for this "
                f"launch (metrics.jsonl and TensorBoard go on; `wandb sync` the run dir's wandb/ "
                f"folder for what it holds)"
            )
            self.wandb = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self._to_wandb(lambda run: run.finish())
            self.wandb = None


def tracked_values(values: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """A row's values as the trackers show them: ({tag: number}, {tag: text})."""
    scalars = {  # (NaN and inf too: the charts mark a diverged step, not a line over it)
        _tb_tag(k): v
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return scalars, {TEXT_TAGS[k]: v for k, v in values.items() if k in TEXT_TAGS}


def write_events(writer: Any, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, step)
    for tag, text in texts.items():
        writer.add_text(tag, _code_block(text), step)


def _stale_events(folder: Path, kept: int) -> list[Path]:
    """The event files a history rewritten past `kept` replaces: the training's (named by
    TRAIN_EVENTS), and eval's of checkpoints past `kept` (their records stay in RUN_DIR/eval)."""
    if not folder.is_dir():
        return []
    evals = [f for f in folder.glob(f"*.{EVENTS_MARK}-step_*") if _checkpoint_step(f.name) > kept]
    return sorted(folder.glob(f"events.out.tfevents.*{TRAIN_EVENTS}")) + evals


def _rebuild_events(
    folder: Path, rows: list[dict[str, Any]], kept: int, stale: list[Path], writer: Any
) -> None:
    """TensorBoard's fast reader (its default) ignores purge_step: a rewritten history's earlier
    points stayed beside the new ones. The `stale` files go; the rows kept (metrics.jsonl's, up
    to `kept`) are written again first, into this launch's own event file (`writer`; a file of
    their own where TensorBoard is off): a file of their own beside it was read after it where
    its name sorted first (torch numbers a process's files 9, 10, ... in one second)."""
    if not stale:
        return
    from torch.utils.tensorboard import SummaryWriter

    with contextlib.ExitStack() as own:
        if writer is None:
            writer = own.enter_context(SummaryWriter(str(folder), filename_suffix=TRAIN_EVENTS))
        for row in rows:
            values = {k: _unclean(v) for k, v in row.items() if k != "step"}
            write_events(writer, row["step"], *tracked_values(values))
        writer.flush()  # (on disk before the stale files go)
    for old in stale:
        old.unlink(missing_ok=True)
    log.info(
        f"metrics: TensorBoard's events past step {kept} removed ({len(rows)} row(s) kept, "
        f"written again from metrics.jsonl)"
    )


def _checkpoint_step(name: str) -> int:
    tail = name.rsplit("-step_", 1)[-1]
    return int(tail) if tail.isascii() and tail.isdigit() else -1


def _unclean(value: Any) -> Any:
    """A row's value as logged: "nan" / "inf" (written as text, JSON has neither) a float."""
    return float(value) if value in ("nan", "inf", "-inf") else value


def _start_wandb(
    cfg: Config, run_dir: Path, kept: int, replaced: tuple[str, int] | None, tracked: dict[str, Any]
):
    """The W&B run of the run dir's id file, continued where the history up to `kept` goes on;
    a new one for a fresh history. `replaced`: (the W&B run, the rows past `kept`) this launch
    rewrites, whose id `_new_wandb_id` replaced."""
    import wandb  # (the preflight found it, and the credentials an online run needs)

    w = cfg.logging.wandb
    run_id = wandb_id(run_dir) if kept else None  # (checked by the preflight)
    if run_id is None:
        run_id = uuid.uuid4().hex[:16]
        atomic_write_text(run_dir / WANDB_ID_FILE, run_id + "\n")
    if replaced and kept:
        log.warning(
            f"wandb: this launch rewrites the {replaced[1]} step(s) after {kept} that W&B run "
            f"{replaced[0]} holds, which W&B would drop (its steps only increase): logging to a "
            f"new W&B run {run_id}, from step {kept + 1}"
        )
    # W&B's service logs under its cache folder (~/.cache/wandb by default): the run dir's
    # while it starts, unless the user named one
    named = "WANDB_CACHE_DIR" in os.environ
    os.environ.setdefault("WANDB_CACHE_DIR", str(run_dir / "wandb" / "cache"))
    try:
        run = wandb.init(
            project=w.project,
            name=w.name or cfg.run.name,
            mode=w.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=tracked,
            # no git state: W&B runs git in the run dir, and git runs the commands a .git/config
            # there names (core.fsmonitor, diff.external), as a handed run dir could carry
            settings=wandb.Settings(disable_git=True),
        )
    except wandb.errors.Error as e:  # no API key on this node, the service unreachable, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"logging.wandb.project={w.project}: W&B did not start ({first}); "
            + (
                "check logging.wandb.* and RUN_DIR/wandb-id.txt, or set logging.wandb.project=null"
                if w.mode == "offline"
                else "log this node in (`wandb login`, or set WANDB_API_KEY), or set "
                "logging.wandb.mode=offline to log into the run directory and `wandb sync` it "
                "later, or logging.wandb.project=null"
            )
        ) from None
    finally:
        if not named:
            os.environ.pop("WANDB_CACHE_DIR", None)
    log.info(f"wandb: logging to project {w.project}, run {run.id} ({w.mode})")
    return run


def _code_block(text: str) -> str:
    """TensorBoard renders text as markdown: indent it so that code keeps its whitespace."""
    return "\n".join("    " + line for line in text.splitlines()) or "    (empty)"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN / inf; keep them visible as strings
    return value  # full precision: parity checks compare these rows


def _tb_tag(key: str) -> str:
    if "/" in key:  # its own group: tokens/<source>, val_loss/<source>, eval/<task>/<metric>
        return key
    if key in ("loss", "val_loss", "val_perplexity"):
        return f"loss/{key}"
    return f"memory/{key}" if key.startswith("peak_") else f"train/{key}"


@dataclass
class Rows:
    """metrics.jsonl read as a launch starts: the lines it keeps and those it moves aside."""

    keep: list[bytes]
    moved: list[bytes]
    kept_rows: list[dict[str, Any]]  # the rows of `keep`
    damaged: int  # lines that are not metric rows (cut short by a kill, or an edit)
    past: int  # rows past the step the launch starts at (a fresh start: any row)


def _rows(path: Path, step: int) -> Rows:
    """metrics.jsonl, checked again for its kind (it is appended to), split at `step` (read only;
    a fresh start, step 0, keeps nothing)."""
    require_kind(path, "a regular file", RUN_DIR_FILES[METRICS_FILE])
    rows = Rows([], [], [], 0, 0)
    if not path.exists():
        return rows
    # (in file order; a lone CR stays in its line)
    lines = [line for line in path.read_bytes().split(b"\n") if line.strip()]
    for line, value in zip(lines, json_values(lines)):
        row = _row_of(value)
        kept = row is not None and 0 < row["step"] <= step  # (a fresh start, step 0: none)
        (rows.keep if kept else rows.moved).append(line + b"\n")
        rows.kept_rows += [row] if kept else []
        rows.damaged += row is None
    rows.past = len(rows.moved) - rows.damaged
    return rows


def _start_rows(path: Path, step: int, rows: Rows) -> None:
    """metrics.jsonl as a launch starts: on a resume the rows past `step` (the resumed run
    rewrites them) and on a fresh start an earlier attempt's rows moved aside to
    metrics-<UTC time>.jsonl, as abandoned checkpoints are kept. A line that is not a JSON row
    moves there too, with a warning."""
    if not rows.moved:
        return
    with open(aside := stamped_name(path.parent, "metrics", ".jsonl"), "xb") as f:
        f.writelines(rows.moved)  # on disk before the file is cut: a kill between leaves them twice
        f.flush()
        os.fsync(f.fileno())
    if rows.damaged:
        log.warning(
            f"metrics: {rows.damaged} line(s) of {path} are not metric rows; moved to {aside}"
        )
    if step == 0:
        log.warning(
            f"metrics: a fresh start (or another run's checkpoint); the rows of the earlier "
            f"attempt moved to {aside}"
        )
    elif rows.past:
        log.info(
            f"metrics: resuming at step {step}; the {rows.past} row(s) past it moved to {aside}"
        )
    atomic_write_text(path, b"".join(rows.keep).decode("utf-8"))  # all rows or the old file


def _new_wandb_id(run_dir: Path) -> str | None:
    """A rewritten history gets a new W&B run (W&B drops a run's steps that do not increase):
    its id is written before the rows are cut, and whether W&B is on or not, so no later launch
    continues the old run over steps it holds. The old id, if there was one."""
    path, old = run_dir / WANDB_ID_FILE, None
    if path.is_symlink() or not path.is_file():
        return None
    with contextlib.suppress(UserError):  # (not an id: replaced all the same)
        old = wandb_id(run_dir)
    atomic_write_text(path, uuid.uuid4().hex[:16] + "\n")
    return old


def metric_row(line: bytes) -> dict[str, Any] | None:
    """A metrics.jsonl line as its row (a JSON object with a step >= 0), or None (also for
    a line nested too deep: `parse_json` is bounded)."""
    return _row_of(json_values([line])[0])


def _row_of(value: Any) -> dict[str, Any] | None:
    ok = isinstance(value, dict) and isinstance(value.get("step"), int)
    return value if ok and not isinstance(value["step"], bool) and value["step"] >= 0 else None
