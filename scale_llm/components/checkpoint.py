"""Checkpoint directories: the file layout, atomic writes, keep_last pruning, and choosing what to
resume from.

A checkpoint is a directory `checkpoints/step_00000100/`. It is written under a temporary name
(`.tmp-step_00000100`), every file is flushed to disk, and only then renamed into place, so a
process killed mid-save leaves the previous checkpoint as the newest complete one. Loading uses
the allow-lists of scale_llm.components.serialization: never arbitrary objects.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from scale_llm.components.distributed import barrier, is_distributed
from scale_llm.components.serialization import dcp_load, load_file
from scale_llm.errors import UserError

log = logging.getLogger(__name__)
TRAINER_STATE = "trainer.pt"  # step, data position, RNG, config, format: written by rank 0
MODEL_WEIGHTS = "model.pt"  # consolidated fp32 weights (DeepSpeed checkpoints, `convert`)
DCP_DIR = "dcp"  # torch.distributed.checkpoint: model + optimizer, keyed by parameter name
SCALER_STATE = "scaler.pt"  # GradScaler state of checkpoints written before the backend state
_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


class Checkpointer:
    def __init__(self, run_dir: Path, keep_last: int, is_main: bool = True):
        self.dir = run_dir / "checkpoints"
        self.keep_last = keep_last
        self.is_main = is_main  # the main rank creates, publishes and prunes directories

    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint, oldest first."""
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir() and (p / TRAINER_STATE).is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Every rank calls `write(tmp_dir)` to fill a new checkpoint; then the main rank
        publishes it atomically. Ranks meet at barriers so no rank reads a half-written one."""
        final = self.dir / checkpoint_name(step)
        tmp = self.dir / f".tmp-{final.name}"
        if self.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier()
        try:
            write(tmp)
        except BaseException as e:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                previous = self.latest()
                raise UserError(
                    f"out of disk space while writing checkpoint {final} ({e.strerror}); the "
                    f"partial files were removed and "
                    + (
                        f"the previous checkpoint {previous} is intact"
                        if previous
                        else "no earlier checkpoint exists"
                    )
                    + "; free space, lower checkpoint.keep_last, or move run.dir to a larger disk"
                ) from None
            raise
        barrier()
        if self.is_main:
            _fsync_tree(tmp)
            if final.exists():  # saving the same step again (e.g. the last step after a resume)
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync_dir(self.dir)
            self.prune()
        barrier()
        return final

    def prune(self) -> None:
        done = self.complete()
        for _, path in done[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
        for stale in self.dir.glob(".tmp-*"):  # left by a process killed mid-save
            shutil.rmtree(stale, ignore_errors=True)


def resolve_resume(resume: str, checkpointer: Checkpointer) -> Path | None:
    """The checkpoint to resume from for `checkpoint.resume` = auto | never | PATH."""
    if resume == "never":
        if checkpointer.complete():
            raise UserError(
                f"checkpoint.resume=never but {checkpointer.dir} already holds "
                f"checkpoints; pick a new run.name, delete that directory, or set "
                f"checkpoint.resume=auto to continue the run"
            )
        return None
    if resume == "auto":
        return checkpointer.latest()
    path = Path(resume)
    if not (path / TRAINER_STATE).is_file():
        raise UserError(
            f"checkpoint.resume={resume}: not a complete checkpoint directory "
            f"(no {TRAINER_STATE} inside); give a path like "
            f"{checkpointer.dir}/{checkpoint_name(100)}, or use auto / never"
        )
    return path


def load_model_weights(
    ckpt_dir: Path, template: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict of any checkpoint, on the CPU, in one process.

    DCP checkpoints (single, DDP, FSDP) are read shard by shard into `template` (a full state
    dict of the checkpoint's shape on the CPU, e.g. `model.empty_state_dict(cfg)`), whatever
    world size wrote them; DeepSpeed checkpoints carry a consolidated `model.pt`.
    """
    if (ckpt_dir / DCP_DIR).is_dir():
        dcp_load({"model": template}, ckpt_dir / DCP_DIR, no_dist=not is_distributed())
        return template
    if (ckpt_dir / MODEL_WEIGHTS).is_file():
        return load_file(ckpt_dir / MODEL_WEIGHTS)
    raise UserError(
        f"{ckpt_dir} holds no model weights ({DCP_DIR}/ or {MODEL_WEIGHTS}); "
        f"point at a complete checkpoint directory"
    )


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
