"""Metric rows to RUN_DIR/metrics.jsonl and the same scalars to TensorBoard (main rank only)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class MetricsLogger:
    """Appends one JSON object per logged step; mirrors numeric values to TensorBoard."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, resume_step: int):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if not enabled:
            return
        _truncate_after(self.path, resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Hide every earlier event from the first step this launch writes on: after a resume
            # (steps past the checkpoint were lost) and after a fresh restart in the same run
            # directory (checkpoints deleted), so no step appears twice.
            self.writer = SummaryWriter(
                log_dir=str(run_dir / "tensorboard"), purge_step=resume_step + 1
            )

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _clean(v) for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self.writer.add_scalar(_tb_tag(key), value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN / inf; keep them visible as strings
    return value  # full precision: parity checks compare these rows


def _tb_tag(key: str) -> str:
    if key in ("loss", "val_loss"):
        return f"loss/{key}"
    if key.startswith("peak_"):
        return f"memory/{key}"
    return f"train/{key}"


def _truncate_after(path: Path, step: int) -> None:
    """Drop rows past `step` (a resumed run rewrites them) and everything on a fresh start."""
    if not path.exists():
        return
    if step == 0:
        path.unlink()
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= step
    ]
    path.write_text("".join(line + "\n" for line in keep))
