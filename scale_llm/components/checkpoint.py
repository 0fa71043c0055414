"""Checkpoint directories: the file layout, atomic writes, keep_last pruning, and choosing what to
resume from.

A checkpoint is a directory `checkpoints/step_00000100/`. It is written under a temporary name
(`.tmp-step_00000100`), every file is flushed to disk, and only then renamed into place, so a
process killed mid-save leaves the previous checkpoint as the newest complete one. Loading uses
the allow-lists of scale_llm.components.serialization: never arbitrary objects.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scale_llm.components import digests
from scale_llm.components.distributed import barrier, is_distributed, rank_and_world
from scale_llm.components.serialization import dcp_load, load_file
from scale_llm.errors import UserError

log = logging.getLogger(__name__)
TRAINER_STATE = "trainer.pt"  # the trainer's state_dict (step, data, RNG, config, plan, backend)
MODEL_WEIGHTS = "model.pt"  # consolidated fp32 weights (DeepSpeed checkpoints, `convert`)
DCP_DIR = "dcp"  # torch.distributed.checkpoint: model + optimizer, keyed by parameter name
SCALER_STATE = "scaler.pt"  # GradScaler state of checkpoints written before the backend state
INTEGRITY = "integrity.json"  # size + xxh3-64 of every other file: written last
_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _out_of_space(e: BaseException) -> OSError | None:
    """The ENOSPC / EDQUOT error behind `e`, if any: raised directly, chained, or wrapped per
    rank in torch.distributed.checkpoint's CheckpointException (what a DCP save raises)."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return x
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [x.__cause__, x.__context__]
    return None


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

    def latest_good(self) -> Path | None:
        """The newest complete checkpoint whose files match its integrity record; a damaged
        newer one is skipped with a warning that names it and what is wrong."""
        for _, path in reversed(self.complete()):
            problem = damage(path)
            if problem is None:
                return path
            log.warning("checkpoint: skipping %s: %s; falling back to an older one", path, problem)
        return None

    def abandon_after(self, step: int) -> Path | None:
        """Move every checkpoint newer than `step` (a resume from an older one starts a new
        branch) into checkpoints/abandoned-<UTC time>/, out of reach of `auto` and of pruning;
        nothing is deleted. Main rank only; returns the folder, or None if nothing was newer."""
        newer = sorted(  # complete or not, damaged or not
            p
            for p in self.dir.glob("step_*")
            if p.is_dir() and (m := _NAME.match(p.name)) and int(m.group(1)) > step
        )
        if not newer or not self.is_main:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        target = self.dir / f"abandoned-{stamp}"
        n = 1
        while target.exists():
            n += 1
            target = self.dir / f"abandoned-{stamp}-{n}"
        target.mkdir()
        for path in newer:
            path.rename(target / path.name)
        _fsync_dir(self.dir)
        log.warning(
            "checkpoint: resuming from step %d starts a new branch: moved the newer %s to %s "
            "(auto will not return to them; delete the folder when you no longer need it)",
            step,
            ", ".join(p.name for p in newer),
            target,
        )
        return target

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
            with digests.recording() as written:  # DCP's files are hashed as they are written
                write(tmp)
        except BaseException as e:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            full = _out_of_space(e)
            if full is not None:
                previous = self.latest()
                raise UserError(
                    f"out of disk space while writing checkpoint {final} ({full.strerror}); the "
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
        record = finish_record(tmp, written, self.is_main)
        if self.is_main:
            write_integrity(tmp, record)
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
        return checkpointer.latest_good()
    path = Path(resume)
    if not (path / TRAINER_STATE).is_file():
        raise UserError(
            f"checkpoint.resume={resume}: not a complete checkpoint directory "
            f"(no {TRAINER_STATE} inside); give a path like "
            f"{checkpointer.dir}/{checkpoint_name(100)}, or use auto / never"
        )
    problem = damage(path)
    if problem is not None:
        raise UserError(
            f"checkpoint.resume={resume}: the checkpoint is damaged: {problem}; resume from "
            f"another one (checkpoint.resume=auto picks the newest good one)"
        )
    return path


def integrity_record(
    ckpt_dir: Path, rank: int = 0, world: int = 1, skip: Collection[str] = ()
) -> dict[str, dict[str, Any]]:
    """Size and xxh3-64 of the checkpoint's files (all but the record itself and the names in
    `skip`, relative to ckpt_dir), or of this rank's share of them when `world` ranks split the
    work (largest files first, each to the least loaded rank: every rank computes the same
    split). Files are hashed in parallel threads (xxhash releases the GIL), each read through
    mmap (no copy out of the page cache)."""
    files = sorted(
        (
            p
            for p in ckpt_dir.rglob("*")
            if p.is_file() and p.name != INTEGRITY and str(p.relative_to(ckpt_dir)) not in skip
        ),
        key=lambda p: (-p.stat().st_size, str(p)),
    )
    load, mine = [0] * world, []
    for path in files:
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += path.stat().st_size
        if owner == rank:
            mine.append(path)
    workers = max(1, min(4, os.cpu_count() or 1, len(mine)))
    with ThreadPoolExecutor(workers) as pool:
        hashes = dict(zip(mine, pool.map(digests.file_digest, mine)))
    return {
        str(p.relative_to(ckpt_dir)): {"size": p.stat().st_size, "xxh3_64": hashes[p]}
        for p in sorted(mine)
    }


def written_entries(
    ckpt_dir: Path, written: dict[Path, tuple[int, str]]
) -> dict[str, dict[str, Any]]:
    """Record entries for the files in ckpt_dir that this process hashed while writing them
    (`digests.recording()`), where the file on disk still has the size that was written."""
    root = ckpt_dir.absolute()
    out = {}
    for path, (size, digest) in written.items():
        if path.is_relative_to(root) and path.is_file() and path.stat().st_size == size:
            out[str(path.relative_to(root))] = {"size": size, "xxh3_64": digest}
    return out


def finish_record(
    ckpt_dir: Path, written: dict[Path, tuple[int, str]], is_main: bool
) -> dict[str, dict[str, Any]]:
    """The whole integrity record of a checkpoint every rank has just written (all ranks call
    it): the digests taken during the writes, then the other files, each rank hashing its share
    by size while the main rank fsyncs the tree (I/O-bound: both release the GIL)."""
    known = gather_records(written_entries(ckpt_dir, written))
    with ThreadPoolExecutor(1) as pool:
        share = pool.submit(integrity_record, ckpt_dir, *rank_and_world(), skip=known)
        if is_main:
            fsync_tree(ckpt_dir)
        return {**known, **gather_records(share.result())}


def gather_records(share: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rank's share of the integrity record, merged (all ranks get it)."""
    if not is_distributed():
        return share
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, share)
    return dict(sorted(item for part in parts for item in part.items()))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory as given (refused when damaged), or a run directory's newest
    complete, undamaged checkpoint (for convert, export and eval)."""
    path = Path(path)
    if (path / TRAINER_STATE).is_file():
        problem = damage(path)
        if problem is not None:
            raise UserError(f"{path} is damaged: {problem}; pick another checkpoint")
        return path
    latest = Checkpointer(path, 1).latest_good() if path.is_dir() else None
    if latest is None:
        raise UserError(
            f"{path} is neither a checkpoint directory nor a run directory with a complete "
            f"checkpoint; pass e.g. runs/tiny or runs/tiny/checkpoints/step_00000150"
        )
    return latest


def write_integrity(ckpt_dir: Path, record: dict[str, dict[str, Any]] | None = None) -> None:
    """Write the integrity record (the last file of a checkpoint), computing it unless given."""
    record = integrity_record(ckpt_dir) if record is None else record
    path = ckpt_dir / INTEGRITY
    with open(path, "w") as f:
        f.write(json.dumps({"files": record}, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())


def damage(ckpt_dir: Path) -> str | None:
    """What is wrong with a checkpoint's files, or None. Checkpoints written before integrity
    records existed (no integrity.json) are taken as they are."""
    path = ckpt_dir / INTEGRITY
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path} is unreadable"
    for name, want in files.items():
        f = ckpt_dir / name
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f} has {size} bytes, {want['size']} were written (truncated or replaced)"
        if digests.file_digest(f, mapped=False) != want["xxh3_64"]:
            return f"{f} does not match its checksum (its bytes changed after the save)"
    return None


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


def fsync_tree(root: Path) -> None:
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
