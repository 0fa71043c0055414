"""The trainer's checks of what is already on disk, run before any work: pure functions that
read the file system and raise a UserError naming the path and the fix, so that a run dir the
loop could not write into stops at launch, not at the first save after hours of training."""

from __future__ import annotations

from pathlib import Path

from scale_llm.errors import UserError
from scale_llm.files import describe_kind

METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step
WANDB_ID_FILE = "wandb-id.txt"  # the W&B run id, so that a resumed run logs to the same run

# What the trainer creates inside RUN_DIR, by the kind it must be: a name that exists as
# another kind (a file where a folder belongs, a folder or named pipe where a file belongs)
# would fail at its first write, or block on the pipe.
RUN_DIR_FOLDERS = {
    "checkpoints": "its checkpoints",
    "tensorboard": "its TensorBoard event files",
    "wandb": "its offline Weights & Biases logs",
}
RUN_DIR_FILES = {
    "config.yaml": "its config",
    "plan.json": "its resolved plan",
    "tokenizer.model": "its copy of the tokenizer",
    "ds_config.json": "its DeepSpeed config",
    METRICS_FILE: "its metric rows",
    WANDB_ID_FILE: "its Weights & Biases run id",
}


def check_run_dir(run_dir: Path) -> None:
    """Every name the trainer writes in `run_dir` is missing or of the kind it writes there
    (symlinks are followed: a link to a folder where a folder belongs is fine)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return  # a new run dir (require_writable_dir checks that it can be made)
    for name, what in RUN_DIR_FOLDERS.items():
        _check_kind(run_dir / name, "a folder", what)
    for name, what in RUN_DIR_FILES.items():
        _check_kind(run_dir / name, "a regular file", what)


def check_metrics_file(path: Path) -> None:
    """RUN_DIR/metrics.jsonl is missing or a regular file: a folder cannot be appended to, and
    opening a named pipe blocks until something reads it."""
    _check_kind(path, "a regular file", RUN_DIR_FILES[METRICS_FILE])


def _check_kind(path: Path, kind: str, what: str) -> None:
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_dir() if kind == "a folder" else path.is_file():
        return
    found = describe_kind(path)
    if path.is_symlink():
        target = describe_kind(path.resolve())
        found = f"a symlink to {'nothing' if target == 'missing' else target}"
    raise UserError(
        f"{path} is {found}, but the run keeps {what} there, as {kind}; move it away (or pick "
        f"another run.name) and launch again"
    )
