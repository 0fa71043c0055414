"""Metric rows to RUN_DIR/metrics.jsonl, and the same scalars to TensorBoard (with the config
as hparams and YAML text, and the samples as text) and optionally Weights & Biases; main rank."""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from pathlib import Path
from typing import Any

from scale_llm.config import Config, dump_yaml, to_dict
from scale_llm.errors import UserError
from scale_llm.files import JSONProblem, atomic_write_text, parse_json, require_kind, stamped_name
from scale_llm.train.preflight import METRICS_FILE, RUN_DIR_FILES, WANDB_ID_FILE, wandb_id
from scale_llm.train.resume import flat

log = logging.getLogger(__name__)

TEXT_TAGS = {"samples_text": "samples/text"}  # metrics.jsonl key -> TensorBoard / W&B tag


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
        past = _start_rows(self.path, kept)
        trackers = cfg.logging.tensorboard or cfg.logging.wandb.project
        tracked = flat(to_dict(cfg), tracker=True) if trackers else {}  # as the trackers show it
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams

            # Hide every earlier event from this launch's first step on (after a resume or a fresh
            # restart in the same run dir), so no step appears twice.
            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=kept + 1)
            # the run dir holds the hparams session: the HPARAMS tab lists it with its scalars
            metrics = {"loss/val_loss": math.nan, "loss/loss": math.nan}
            for summary in hparams(tracked, metrics):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config/yaml", _code_block(dump_yaml(cfg)), resume_step)
        if cfg.logging.wandb.project:
            self.wandb = _start_wandb(cfg, run_dir, kept, past, tracked)

    def log(self, step: int, values: dict[str, Any]) -> None:
        """One row per step: numbers become scalars, `samples_text` a text entry."""
        if not self.enabled:
            return
        row = {"step": step, **{k: _clean(v) for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {  # (NaN and inf too: the charts mark a diverged step, not a line over it)
            _tb_tag(k): v
            for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        texts = {TEXT_TAGS[k]: v for k, v in row.items() if k in TEXT_TAGS}
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
            for tag, text in texts.items():
                self.writer.add_text(tag, _code_block(text), step)
        if self.wandb is not None:
            self.wandb.log({**scalars, **texts}, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _start_wandb(cfg: Config, run_dir: Path, kept: int, past: int, tracked: dict[str, Any]):
    """The W&B run of the run dir's id file, continued where the history up to `kept` goes on;
    a new one for a fresh history, or where `past` rows are rewritten (W&B drops a run's steps
    that do not increase)."""
    import wandb  # (the preflight found it, and the credentials an online run needs)

    w = cfg.logging.wandb
    earlier = wandb_id(run_dir) if kept else None  # (checked by the preflight)
    run_id = None if past else earlier
    if run_id is None:
        run_id = uuid.uuid4().hex[:16]
        atomic_write_text(run_dir / WANDB_ID_FILE, run_id + "\n")
    if earlier and past:
        log.warning(
            f"wandb: this launch rewrites the {past} step(s) after {kept} that W&B run {earlier} "
            f"holds, which W&B would drop (its steps only increase): logging to a new W&B run "
            f"{run_id}, from step {kept + 1}"
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


def _start_rows(path: Path, step: int) -> int:
    """metrics.jsonl as a launch starts: checked again for its kind (it is appended to), then on a
    resume the rows past `step` (the resumed run rewrites them) and on a fresh start an earlier
    attempt's rows moved aside to metrics-<UTC time>.jsonl, as abandoned checkpoints are kept. A
    line that is not a JSON row (cut short by a kill, or an edit) moves there too, with a
    warning. Returns the count of rows past `step` on a resume."""
    require_kind(path, "a regular file", RUN_DIR_FILES[METRICS_FILE])
    if not path.exists():
        return 0
    if step > 0:
        keep, moved, damaged = [], [], 0
        for line in path.read_bytes().split(b"\n"):  # (in file order; a lone CR stays in its line)
            if not line.strip():
                continue
            row = metric_row(line)
            (keep if row is not None and row["step"] <= step else moved).append(line + b"\n")
            damaged += row is None
        past = len(moved) - damaged
        if moved:  # on disk before the file is cut: a kill between leaves them twice
            with open(aside := stamped_name(path.parent, "metrics", ".jsonl"), "xb") as f:
                f.writelines(moved)
                f.flush()
                os.fsync(f.fileno())
            if damaged:
                log.warning(
                    f"metrics: {damaged} line(s) of {path} are not metric rows; moved to {aside}"
                )
            if past:
                log.info(
                    f"metrics: resuming at step {step}; the {past} row(s) past it moved to {aside}"
                )
        atomic_write_text(path, b"".join(keep).decode("utf-8"))  # all rows or the old file
        return past
    elif path.stat().st_size:  # (an empty file holds nothing to keep)
        path.rename(aside := stamped_name(path.parent, "metrics", ".jsonl"))
        log.warning(
            f"metrics: a fresh start (or another run's checkpoint); the rows of the earlier "
            f"attempt moved to {aside}"
        )
    return 0


def metric_row(line: bytes) -> dict[str, Any] | None:
    """A metrics.jsonl line as its row (a JSON object with a step >= 0), or None (also for
    a line nested too deep: `parse_json` is bounded)."""
    try:
        row = parse_json(line.decode("utf-8"))
    except (UnicodeDecodeError, JSONProblem):
        return None
    ok = isinstance(row, dict) and isinstance(row.get("step"), int)
    return row if ok and not isinstance(row["step"], bool) and row["step"] >= 0 else None
