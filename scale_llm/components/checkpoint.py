"""Checkpoint directories: layout, atomic publication, keep_last pruning, what to resume from.

checkpoints/step_N/ is written as .tmp-step_N, flushed, then renamed (under checkpoint.async_mode
after the background write), so a killed save leaves the previous checkpoint the newest complete
one. Nothing read is believed unchecked: `damage` holds every file against the integrity record, a
symlink is not the run's own, `read_trainer_state` checks trainer.pt's format and fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed as dist

from scale_llm.components import digests
from scale_llm.components.distributed import first_failed_rank, is_distributed, rank_and_world
from scale_llm.components.serialization import damaged, dcp_load, dcp_metadata, load_file
from scale_llm.components.zero_weights import MODEL_STATES, ZeroWeights
from scale_llm.config import Config, ModelConfig, build_section, short, validate
from scale_llm.errors import UserError
from scale_llm.files import (
    MAX_JSON_DEPTH,
    JSONProblem,
    atomic_write_json,
    atomic_write_text,
    describe_kind,
    entries_below,
    fsync_dir,
    fsync_tree,
    json_object_or_none,
    nested_deeper,
    parse_json,
    stamped_name,
    temporary_sibling,
)

log = logging.getLogger(__name__)
TRAINER_STATE = "trainer.pt"  # the trainer's state_dict (step, data, RNG, config, plan, backend)
TRAINER_FORMAT = 3  # trainer.pt's: 3 groups attention.wqkv's rows by kv head; 1 and 2 stacked
FORMAT_SINCE = "1c59fbf of 2026-12-03"  # the scale_llm that first wrote TRAINER_FORMAT
DCP_DIR = "dcp"  # torch.distributed.checkpoint: model + optimizer, keyed by parameter name
DEEPSPEED_DIR = "deepspeed"  # DeepSpeed's own files (its engine's tag): each rank's partitions
INTEGRITY = "integrity.json"  # size + xxh3-64 of every other file: written last
RECORDED = "integrity"  # in trainer.pt: saved with a record (every checkpoint is)
MAX_RECORD_BYTES = 64 << 20  # a record lists a few entries per rank (~100 bytes each)
# one of them names the model's weights (DeepSpeed's: rank 0's model states, ZeRO 0-2 or 3)
WEIGHT_FILES = (f"{DCP_DIR}/.metadata", *(f"{DEEPSPEED_DIR}/{name}" for name in MODEL_STATES))
_NAME = re.compile(r"^step_(\d{8})$")
Record = dict[str, dict[str, Any]]  # integrity.json's files: {name: {"size", "xxh3_64"}}


# in a checkpoints folder: {"run": the run dir that last used it, "id": the folder's own}; every
# save records the id, and pruning removes only checkpoints carrying it (never one copied in)
CLAIM = ".scale-llm-run.json"
_ID = re.compile(r"[0-9a-f]{32}")


def folder_id(ckpts: Path) -> str | None:
    """The id a checkpoints folder's claim holds, or None."""
    claim = json_object_or_none(ckpts / CLAIM, MAX_RECORD_BYTES) or {}
    return got if isinstance(got := claim.get("id"), str) and _ID.fullmatch(got) else None


def claim_folder(ckpts: Path, run: str | None = None) -> str:
    """Write the folder's claim, naming `run` (when given) and keeping its id; the id. One made
    for this run's own folder (its claim names it, or it has none and is RUN_DIR/checkpoints
    itself) is given to the checkpoints there that name no folder (saved before ids were
    recorded), the claim marked `adopting` until each has it, so a launch killed meanwhile is
    finished by the next."""
    claim = json_object_or_none(ckpts / CLAIM, MAX_RECORD_BYTES) or {}
    ident = folder_id(ckpts)
    own = bool(run) and (
        claim.get("run") == run
        or (not claim and not ckpts.is_symlink() and os.path.realpath(ckpts.parent) == run)
    )
    adopting = own and (ident is None or claim.get("adopting") is True)
    ident = ident or os.urandom(16).hex()
    named = {"run": run if run else claim.get("run"), "id": ident}
    if adopting:
        atomic_write_json(ckpts / CLAIM, {**named, "adopting": True})
        for step in ckpts.iterdir():
            if step_of(step) >= 0 and step.is_dir() and not step.is_symlink():
                _record_folder(step, ident)
    atomic_write_json(ckpts / CLAIM, named)
    return ident


def _record_folder(ckpt_dir: Path, ident: str) -> None:
    """Add the folder id to a checkpoint's integrity record that names none (written beside the
    checkpoint, then renamed in: nothing else appears inside it)."""
    path = ckpt_dir / INTEGRITY
    record = None if path.is_symlink() else json_object_or_none(path, MAX_RECORD_BYTES)
    if record is None or not isinstance(record.get("files"), dict) or "folder" in record:
        return
    tmp = temporary_sibling(ckpt_dir, "integrity")  # (in checkpoints/: not a step or .tmp-step)
    tmp.write_text(json.dumps({**record, "folder": ident}, indent=1) + "\n")
    os.replace(tmp, path)


def saved_into(ckpt_dir: Path) -> str | None:
    """The id of the checkpoints folder a checkpoint was saved into (its record's), or None."""
    record = json_object_or_none(ckpt_dir / INTEGRITY, MAX_RECORD_BYTES) or {}
    return got if isinstance(got := record.get("folder"), str) else None


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int:
    """The step a step_N folder's name says; -1 for another name."""
    return int(m.group(1)) if (m := _NAME.match(path.name)) else -1


OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
DISK_FAILED = (errno.EIO, errno.EROFS, errno.EFBIG)  # (torch.save's own error has it as context)
NOT_ALLOWED = (errno.EACCES, errno.EPERM)  # (raised or caused: a library may handle one)


def _os_error(e: BaseException, errnos: tuple[int, ...] = OUT_OF_SPACE) -> OSError | None:
    """The ENOSPC / EDQUOT error (or one of `errnos`) behind `e`: raised, chained, or in a DCP
    CheckpointException (another error's context too, except for NOT_ALLOWED)."""
    seen, todo = set(), [e]
    while todo:
        if (x := todo.pop()) is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in errnos:
            return x
        if isinstance(failures := getattr(x, "failures", None), dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [x.__cause__, None if errnos == NOT_ALLOWED else x.__context__]
    return None


class Checkpointer:
    def __init__(self, run_dir: Path, keep_last: int, is_main: bool = True, group: Any = None):
        self.dir, self.keep_last = run_dir / "checkpoints", keep_last
        self.is_main = is_main  # the main rank creates, publishes and prunes directories
        self.group = group  # the process group of background publishing (`side_group`)
        self._warned: set[Path] = set()  # step dirs warned about (a symlink, one left unpruned)
        self._published: Path | None = None  # the newest checkpoint this process renamed in
        self._pending: tuple[Path, Future] | None = None  # the save in flight: (step_N, done)
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="scale-llm-checkpoint")

    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint, oldest first; a symlinked step directory
        is not this run's: skipped with a warning (never resumed, counted or pruned)."""
        found = []
        for p in self.dir.iterdir() if self.dir.is_dir() else ():
            if (step := step_of(p)) >= 0 and p.is_symlink():
                self._warn_link(p)
            elif step >= 0 and p.is_dir() and (p / TRAINER_STATE).is_file():
                found.append((step, p))
        return sorted(found)

    def _warn_link(self, path: Path) -> None:
        if path in self._warned:
            return
        self._warned.add(path)
        log.warning(
            "checkpoint: skipping %s: it is a symlink (to %s), not a checkpoint this run wrote; "
            "it is never resumed, counted or pruned (to resume from it on purpose, name it: "
            "checkpoint.resume=PATH)",
            path,
            os.readlink(path),
        )

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def latest_good(self) -> Path | None:
        """The newest complete checkpoint matching its integrity record (damaged ones warned).
        Ranks take rank 0's listing (a file system may show one node an older one)."""
        done = [path for _, path in self.complete()]
        if is_distributed():
            names = [[path.name for path in done]]
            dist.broadcast_object_list(names, src=0)
            done = [self.dir / name for name in names[0]]
        for path in reversed(done):
            if (problem := agreed_damage(path)) is None:
                return path
            log.warning("checkpoint: skipping %s: %s; falling back to an older one", path, problem)
        return None

    def abandon_after(self, step: int, resumed: Path) -> Path | None:
        """Move every checkpoint newer than `step` (a resume starts a new branch), or every one
        where `resumed` lies outside this folder (another history: pruning would delete them),
        into checkpoints/abandoned-<UTC time>/, deleting nothing (main rank); the folder or None."""
        own = self.holds(resumed)
        newer = sorted(  # complete or not, damaged or not
            p
            for p in self.dir.glob("step_*")
            if (step_of(p) > step or (not own and step_of(p) >= 0))
            and (p.is_symlink() or p.is_dir())
        )
        if not newer or not self.is_main:
            return None
        target = self._move_aside(newer)
        log.warning(
            "checkpoint: resuming from %s starts a new branch: moved %s %s to %s (auto will not "
            "return to them; delete the folder when you no longer need it)",
            f"step {step}" if own else resumed,
            "the newer" if own else "this run's",
            ", ".join(p.name for p in newer),
            target,
        )
        return target

    def holds(self, ckpt: Path) -> bool:
        """Whether checkpoint `ckpt` lies in this folder (this run's history, not another's)."""
        try:
            return os.path.samefile(ckpt.parent, self.dir)
        except OSError:  # (no folder yet)
            return False

    def _move_aside(self, paths: list[Path]) -> Path:
        """Rename `paths` (entries of self.dir) into a new checkpoints/abandoned-<UTC time>/."""
        target = stamped_name(self.dir, "abandoned")
        target.mkdir()
        for path in paths:
            path.rename(target / path.name)  # a symlink is renamed itself, never followed
        fsync_dir(self.dir)
        return target

    def save(
        self,
        step: int,
        write: Callable[[Path], None],
        start: Callable[[Path], Future] | None = None,
    ) -> Path:
        """Every rank calls `write(tmp_dir)`; once all have written, the main rank publishes it
        (record, rename, pruning), or, given `start`, each rank starts its background write
        (DCP's async_save) and this Checkpointer's thread publishes it on `group` once written;
        one save is in flight at most. Each phase ends with the ranks agreeing: a failure on one
        rank stops every rank there (the others with a RankFailed naming it); a background write
        one rank fails to start is the exception, the others' writes then wait."""
        self.wait()
        final = self.dir / checkpoint_name(step)
        tmp = self.dir / f".tmp-{final.name}"
        self._published = None
        hashing = contextlib.ExitStack()
        try:
            with together():  # (a file system gone read-only fails here first)
                if self.is_main:
                    self.dir.mkdir(parents=True, exist_ok=True)
                    _remove_stale(tmp)
                    tmp.mkdir()
            written = hashing.enter_context(digests.recording())  # hashed as they are written
            with together():
                write(tmp)
            if start is None:
                hashing.close()
                self._publish(tmp, final, written)
                return final
            running = start(tmp)  # (a rank failing to start it: the others' writes wait)
        except BaseException as e:
            hashing.close()
            self._failed(e, tmp, final)
            raise

        def publish_when_written() -> Path:  # (in this Checkpointer's thread)
            try:
                with hashing, together(self.group):  # closed: every digest taken
                    running.result()
                self._publish(tmp, final, written, self.group)
            except BaseException as e:
                self._failed(e, tmp, final)
                raise
            log.info("checkpoint: saved %s", final)
            return final

        self._pending = (final, self._publisher.submit(publish_when_written))
        return final

    def wait(self, failing: bool = False) -> Path | None:
        """Block until the save in flight is published; its path. Its error is raised, or only
        logged when `failing` (an error exit has its own error to report)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        final, future = pending
        if not future.done():
            log.info("checkpoint: waiting for %s to be written", final.name)
        try:
            return future.result()
        except BaseException as e:
            if not failing:
                raise
            if isinstance(e, KeyboardInterrupt):  # (this thread's, not the save's: drain waits)
                log.warning(
                    "checkpoint: stopped waiting for %s (Ctrl-C); it is still written", final
                )
            else:
                log.warning("checkpoint: %s was not saved: %s", final, e)
            return None

    def drain(self) -> None:
        """Return once this Checkpointer's thread is idle (a save in flight published, or failed
        and cleaned up): the run's locks must outlive its writes. A Ctrl-C meanwhile is raised
        (the caller then keeps its locks until the process exits)."""
        idle = self._publisher.submit(lambda: None)  # (one thread: runs after the save)
        try:
            return idle.result(timeout=0.1)
        except TimeoutError:
            log.warning(
                "checkpoint: finishing the save in flight before the run's locks are released "
                "(Ctrl-C again stops waiting; the locks then stay held until the process exits)"
            )
        return idle.result()

    def _publish(self, tmp: Path, final: Path, written: digests.Recorded, group: Any = None):
        """Once every rank has written: the integrity record, the rename, pruning (main rank)."""
        record = finish_record(tmp, written, self.is_main, group)
        with together(group):
            if self.is_main:
                write_integrity(tmp, record, folder_id(self.dir) or claim_folder(self.dir))
                if final.is_symlink() or final.exists():  # not a checkpoint: moved aside, kept
                    target = self._move_aside([final])
                    log.warning("checkpoint: %s was in the way; moved it to %s", final, target)
                tmp.rename(final)
                self._published = final
                fsync_dir(self.dir)
                self.prune()

    def _failed(self, e: BaseException, tmp: Path, final: Path) -> None:
        """Remove a failed save's files; out of disk space, or a disk or file system that
        failed (EIO, read-only, ...), is raised as a UserError."""
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # made by `save` for this save
        saved = f"; {final} was published before it" if self._published == final else ""
        if isinstance(e, RankFailed):
            raise UserError(
                f"checkpoint {final} failed on rank {e.rank} (its message says why, and what "
                f"was kept){saved}; fix that, then launch again: the run continues from its last "
                f"complete checkpoint"
            ) from None
        full = _os_error(e)
        failed = _os_error(e, DISK_FAILED) or _os_error(e, NOT_ALLOWED)
        if full is None and failed is None:
            return
        try:
            done = [d for d in self.complete() if d[1] != final]
        except OSError:  # (the failing disk: which are intact is not known)
            done = None
        intact = f"the previous checkpoint {done[-1][1]} is intact" if done else None
        if done is None:
            intact = f"the checkpoints in {self.dir} could not be listed"
        left = self.is_main and _there(tmp)  # (the main rank removes them)
        removed = f"are in {tmp} (removed by the next save)" if left else "were removed"
        if full is None:
            where = f" on {failed.filename}" if failed.filename else ""
            raise UserError(
                f"could not write checkpoint {final} ({failed.strerror}{where}){saved}; the "
                f"partial files {removed} and {intact or 'no earlier checkpoint exists'}; check "
                f"the disk, file system and permissions under run.dir (dmesg, df, mount, ls -l), "
                f"then launch again: the run continues from its last complete checkpoint"
            ) from None
        lower = ""  # (pruning follows a save: a lower keep_last helps from 2 earlier ones on disk)
        if self.keep_last > 1 and done and len(done) > 1:
            lower = (
                f"lower checkpoint.keep_last (now {self.keep_last}: {len(done)} earlier "
                f"checkpoints stay on disk while the next is written), "
            )
        raise UserError(
            f"out of disk space while writing checkpoint {final} ({full.strerror}); the partial "
            f"files {removed} and {intact or 'no earlier checkpoint exists'}; free space, "
            f"{lower}or move run.dir to a larger disk"
        ) from None

    def prune(self) -> None:
        done = self.complete()  # (symlinks are not among them)
        mine = folder_id(self.dir)
        for _, path in done[: -self.keep_last]:  # complete step_N folders, each proven a save's
            try:
                problem = damage(path, checksums=False)
            except (UserError, OSError) as e:  # (a record that cannot be read: left, said)
                problem = str(e)
            if problem is None and (mine is None or saved_into(path) != mine):
                problem = (
                    "its integrity record names another checkpoints folder"
                    if saved_into(path)
                    else "its integrity record names no checkpoints folder"
                )
            if problem is None:  # renamed first: one cut short is a .tmp- folder, removed below
                doomed = path.with_name(f".tmp-{path.name}")
                try:
                    _remove_stale(doomed)
                    path.rename(doomed)
                    fsync_dir(self.dir)
                except OSError as e:  # (the checkpoint just saved is published: a warning)
                    log.warning("checkpoint: could not prune %s (%s)", path, e.strerror or e)
                    continue
                shutil.rmtree(doomed, ignore_errors=True)
            elif path not in self._warned:  # (warned once)
                self._warned.add(path)
                log.warning(
                    "checkpoint: not pruning %s: %s, so it may hold files a save did not write; "
                    "it is left as it is (delete it yourself if it is not needed)",
                    path,
                    problem,
                )
        for stale in self.dir.glob(".tmp-step_*"):  # left by a process killed mid-save
            if _NAME.match(stale.name.removeprefix(".tmp-")):
                _remove_stale(stale)


def _there(path: Path) -> bool:
    """Whether `path` exists; on a disk that fails to say, taken as there."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        pass
    return True


def _remove_stale(tmp: Path) -> None:
    """Remove a `.tmp-` folder of an interrupted save; a symlink or another kind of file there
    is unlinked, never followed or opened (opening a named pipe blocks)."""
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)
    elif tmp.is_symlink() or tmp.exists():
        tmp.unlink()


def resolve_resume(resume: str, checkpointer: Checkpointer) -> Path | None:
    """The checkpoint to resume from for `checkpoint.resume` = auto | never | PATH."""
    if resume == "never":
        if checkpointer.complete():
            raise UserError(
                f"checkpoint.resume=never but {checkpointer.dir} already holds checkpoints; pick "
                f"a new run.name, delete that directory, or set checkpoint.resume=auto to "
                f"continue the run"
            )
        return None
    if resume == "auto":
        if (good := checkpointer.latest_good()) is None and checkpointer.complete():
            raise UserError(
                f"checkpoint.resume=auto: every checkpoint in {checkpointer.dir} is damaged (the "
                f"warnings above name each problem) and a run from step 0 would replace them, so "
                f"it stops; move them out of {checkpointer.dir} to start over, or restore a copy"
            )
        return good
    path = followed(Path(resume), f"checkpoint.resume={resume}")
    if first_failed_rank(not (path / TRAINER_STATE).is_file()) is not None:  # (every rank)
        raise UserError(
            f"checkpoint.resume={resume}: not a complete checkpoint directory (no {TRAINER_STATE} "
            f"inside); give a path like {checkpointer.dir}/{checkpoint_name(100)}, or use auto / "
            f"never"
        )
    if (problem := agreed_damage(path)) is not None:
        raise UserError(
            f"checkpoint.resume={resume}: the checkpoint is damaged: {problem}; resume from "
            f"another one (checkpoint.resume=auto picks the newest good one)"
        )
    return path


def followed(path: Path, what: str) -> Path:
    """A checkpoint named explicitly, taken where it really is (a symlink resolved, and said)."""
    if not path.is_symlink():
        return path
    target = Path(os.path.realpath(path))  # (a link loop: no checkpoint there, said next)
    log.info("%s: %s is a symlink; reading the checkpoint it points to, %s", what, path, target)
    return target


def integrity_record(
    ckpt_dir: Path, rank: int = 0, world: int = 1, skip: Collection[str] = ()
) -> Record:
    """Size and xxh3-64 of the checkpoint's files but the record and `skip`, or this rank's
    share when `world` ranks split them (largest first, each to the least loaded rank), hashed
    in threads (xxhash releases the GIL)."""
    files = [
        p
        for p in entries_below(ckpt_dir)
        if p.is_file() and p.name != INTEGRITY and str(p.relative_to(ckpt_dir)) not in skip
    ]
    load, mine = [0] * world, []
    for path in sorted(files, key=lambda p: (-p.stat().st_size, str(p))):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += path.stat().st_size
        if owner == rank:
            mine.append(path)
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1, len(mine)))) as pool:
        hashes = dict(zip(mine, pool.map(digests.file_digest, mine)))
    return {
        str(p.relative_to(ckpt_dir)): {"size": p.stat().st_size, "xxh3_64": hashes[p]}
        for p in sorted(mine)
    }


def written_entries(ckpt_dir: Path, written: dict[Path, tuple[int, str]]) -> Record:
    """Record entries of the files this process hashed while writing them, still that size."""
    root = ckpt_dir.absolute()
    return {
        str(path.relative_to(root)): {"size": size, "xxh3_64": digest}
        for path, (size, digest) in written.items()
        if path.is_relative_to(root) and path.is_file() and path.stat().st_size == size
    }


def finish_record(
    ckpt_dir: Path, written: dict[Path, tuple[int, str]], is_main: bool, group: Any = None
) -> Record:
    """The whole integrity record of a checkpoint all ranks of `group` just wrote: the digests
    taken while writing, then each rank hashes its share of the rest as the main rank fsyncs."""
    known = gather_records(_outcome(written_entries, ckpt_dir, written), group)

    def share() -> Record:
        with ThreadPoolExecutor(1) as pool:
            part = pool.submit(integrity_record, ckpt_dir, *rank_and_world(), skip=known)
            if is_main:
                fsync_tree(ckpt_dir)
            return part.result()

    return {**known, **gather_records(_outcome(share), group)}


def gather_records(share: Record | Exception, group: Any = None) -> Record:
    """Every rank's share of the integrity record, merged (all ranks of `group` get it). A rank
    whose share failed passes its error: it raises there, and a RankFailed on the others."""
    failed = isinstance(share, Exception)
    parts: list[Any] = [share]
    if is_distributed():
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, None if failed else share, group=group)
    if failed:
        raise share
    if None in parts:
        raise RankFailed(parts.index(None))
    return dict(sorted(item for part in parts for item in part.items()))


def _outcome(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or the Exception it raised."""
    try:
        return fn(*args)
    except Exception as e:
        return e


class RankFailed(Exception):
    """Another rank's part of a collective step failed (that rank reports why)."""

    def __init__(self, rank: int):
        super().__init__(f"rank {rank} failed")
        self.rank = rank


@contextlib.contextmanager
def together(group: Any = None) -> Iterator[None]:
    """The end of a step every rank of `group` takes: they meet there, and an Exception on any
    rank raises on every rank (its own there, a RankFailed naming the first one elsewhere)."""
    error = None
    try:
        yield
    except Exception as e:
        error = e
    if (first := first_failed_rank(error is not None, group)) is not None:
        raise error if error is not None else RankFailed(first)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory as given (refused when damaged), or a run directory's newest
    good checkpoint (for convert, export and eval)."""
    path = followed(Path(path), "checkpoint")
    if (path / TRAINER_STATE).is_file():
        if (problem := damage(path)) is not None:
            raise UserError(f"{path} is damaged: {problem}; pick another checkpoint")
        return path
    if (latest := Checkpointer(path, 1).latest_good() if path.is_dir() else None) is None:
        raise UserError(
            f"{path} is neither a checkpoint directory nor a run directory with a complete "
            f"checkpoint; pass e.g. runs/tiny or runs/tiny/checkpoints/step_00000150"
        )
    return latest


def write_integrity(ckpt_dir: Path, record: Record | None = None, folder: str | None = None):
    """Write the integrity record (the last file of a checkpoint), computing it unless given;
    `folder`: the id of the checkpoints folder it is saved into (kept from the record there
    when not given)."""
    record = integrity_record(ckpt_dir) if record is None else record
    folder = folder or saved_into(ckpt_dir)
    written = {"files": record, **({"folder": folder} if folder else {})}
    atomic_write_text(ckpt_dir / INTEGRITY, json.dumps(written, indent=1) + "\n")


class _Damage(Exception):
    """What is wrong with a checkpoint's files: one line naming the file."""


def damage(ckpt_dir: Path, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """What is wrong with a checkpoint's files (one line naming the file), or None: each file
    no symlink, listed in integrity.json with its size and checksum (skipped without
    `checksums`: `scale-llm runs`); a missing record is damage. `share` (i, n): the checksums
    of every n-th file from the i-th alone (the sizes of all)."""
    if not ckpt_dir.is_dir():  # (another node's listing named it; this one's does not show it)
        return f"{ckpt_dir} is missing"
    if links := sorted(p for p in entries_below(ckpt_dir) if p.is_symlink()):
        link = f"{links[0]} is a symlink (to {os.readlink(links[0])})"
        return f"{link}; a checkpoint holds only the files its run wrote"
    try:
        files = read_record(ckpt_dir)
    except _Damage as e:
        return str(e)
    record = ckpt_dir / INTEGRITY
    on_disk = (p for p in entries_below(ckpt_dir) if p.is_file() and p != record)
    if extra := sorted(n for p in on_disk if (n := str(p.relative_to(ckpt_dir))) not in files):
        return f"{ckpt_dir / extra[0]} is not in {record} (added or renamed after the save)"
    for index, (name, want) in enumerate(files.items()):
        if not (f := ckpt_dir / name).is_file():
            return f"{f} is missing"
        if (size := f.stat().st_size) != want["size"]:
            return f"{f} has {size} bytes, {want['size']} were written (truncated or replaced)"
        read = checksums and index % share[1] == share[0]
        try:
            digest = digests.file_digest(f, mapped=False) if read else None
        except FileNotFoundError:  # (pruned meanwhile)
            return f"{f} is missing"
        except OSError as e:  # (EIO: a failing disk; EACCES) not damage: no fall-back past it
            raise unreadable(f, e, ckpt_dir) from None
        if read and digest != want["xxh3_64"]:
            return f"{f} does not match its checksum (its bytes changed after the save)"
    return None


def agreed_damage(ckpt_dir: Path) -> str | None:
    """`damage` of a checkpoint every rank reads: each checksums its share of the files (a
    70B run's ~1 TB is read once over the ranks, not once a rank), and all take the first
    problem any found, so no two ranks resume different checkpoints."""
    rank, world = rank_and_world()
    if world == 1:
        return damage(ckpt_dir)
    if (behind := first_failed_rank(not ckpt_dir.is_dir())) is not None:  # (no damage: a view)
        raise UserError(
            f"{ckpt_dir} is listed on rank 0's node but missing on rank {behind}'s: the nodes' "
            f"file systems disagree (a shared file system not yet up to date there); launch "
            f"again once every node sees it, rather than resume an older checkpoint"
        )
    try:
        problem, error = damage(ckpt_dir, share=(rank, world)), None
    except UserError as e:  # (a file this rank cannot read: every rank stops)
        problem, error = None, e
    if (failed := first_failed_rank(error is not None)) is not None:
        raise error or UserError(
            f"rank {failed} could not read a file of {ckpt_dir} (its message names it and the "
            f"fix); fix that and launch again"
        )
    if (found := first_failed_rank(problem is not None)) is None:
        return None
    if problem is not None:
        log.warning("checkpoint: rank %d found %s", rank, problem)
    return problem or f"rank {found} found a file of it damaged (that rank's warning names it)"


def unreadable(path: Path, e: OSError, ckpt_dir: Path) -> UserError:
    """A checkpoint file this process cannot read: not damage (the disk may come back), so no
    command falls back past it."""
    return UserError(
        f"{path} cannot be read ({e.strerror or type(e).__name__}): the disk or file system under "
        f"it failed, or this user may not read it; fix that and run the command again (or move "
        f"{ckpt_dir} away to use an older checkpoint)"
    )


def read_record(ckpt_dir: Path) -> Record:
    """The checked `files` of a checkpoint's integrity record ({name: {size, xxh3_64}});
    _Damage for a missing one or one of any other shape."""
    path = ckpt_dir / INTEGRITY
    if not path.exists() and not path.is_symlink():  # (every trainer-state format 3 has one)
        if (ckpt_dir / TRAINER_STATE).is_file():  # an older format's own message (row 4.16)
            try:
                state = load_file(ckpt_dir / TRAINER_STATE)
            except UserError:  # (unreadable: damage, below)
                state = None
            refuse_other_format(state, ckpt_dir / TRAINER_STATE)
        raise _Damage(f"{path} is missing (every checkpoint is saved with one: removed after)")
    if path.is_symlink() or not path.is_file():
        raise _Damage(f"{path} is {describe_kind(path)}, not the record file")
    try:
        if (size := path.stat().st_size) > MAX_RECORD_BYTES:
            raise _Damage(f"{path} has {size:,} bytes, too many for a record")
        obj = parse_json(path.read_bytes())
    except FileNotFoundError:
        raise _Damage(f"{path} is missing") from None
    except OSError as e:
        raise unreadable(path, e, ckpt_dir) from None
    except JSONProblem as e:  # (bounded: a record nested 100,000 deep is damage, not a crash)
        raise _Damage(f"{path} is not readable JSON ({e})") from None
    files = obj.get("files") if isinstance(obj, dict) else None
    if not isinstance(files, dict):
        shape = '{"files": {name: {"size": ..., "xxh3_64": ...}}}'
        raise _Damage(f"{path} holds {short(obj, 60)}, not {shape}")
    for name, entry in files.items():
        _check_entry(path, name, entry)
    if (ckpt_dir / TRAINER_STATE).exists():  # (a bare record of backend files: bench)
        if TRAINER_STATE not in files:
            raise _Damage(f"{path} does not list {TRAINER_STATE}")
        if not any(w in files for w in WEIGHT_FILES):
            raise _Damage(f"{path} lists no model weights ({' or '.join(WEIGHT_FILES)})")
    if not files:
        raise _Damage(f"{path} lists no files")
    return files


def _check_entry(path: Path, name: Any, entry: Any) -> None:
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if (
        not parts
        or name.startswith("/")
        or str(PurePosixPath(name)) != name
        or any(p in (".", "..") for p in parts)
        or name == INTEGRITY
    ):
        raise _Damage(f"{path} names {short(name, 60)}, which is not a file inside the checkpoint")
    if not isinstance(entry, dict):
        raise _Damage(f"{path}: the entry of {name!r} is {short(entry, 60)}, not {{size, xxh3_64}}")
    size, digest = entry.get("size"), entry.get("xxh3_64")
    if not is_count(size):
        raise _Damage(f"{path}: the size of {name!r} is {short(size, 40)}, not a byte count")
    if not digests.is_digest(digest):
        raise _Damage(
            f"{path}: the xxh3_64 of {name!r} is {short(digest, 40)}, not 16 hexadecimal digits"
        )


def checkpoint_digest(ckpt_dir: Path) -> str:
    """One xxh3-64 over the checkpoint's integrity record: equal digests mean the same bytes."""
    try:
        files = read_record(ckpt_dir)
    except _Damage as e:
        raise UserError(f"{ckpt_dir} is damaged: {e}; pick another checkpoint") from None
    canonical = {k: {"size": v["size"], "xxh3_64": v["xxh3_64"]} for k, v in files.items()}
    return digests.text_digest(json.dumps(canonical, sort_keys=True, separators=(",", ":")))


def read_trainer_state(ckpt_dir: Path) -> dict[str, Any]:
    """A checkpoint's trainer.pt in the current format, each field its readers use (step,
    model section, tokenizer hash, plan) checked for type and range: a UserError names each."""
    path = ckpt_dir / TRAINER_STATE
    state = load_file(path)
    if nested_deeper(state, MAX_JSON_DEPTH):  # (every reader below recurses or repr()s it)
        problems = [f"it nests containers deeper than {MAX_JSON_DEPTH} levels (a state nests 6)"]
    else:
        refuse_other_format(state, path)
        problems = trainer_state_problems(state, ckpt_dir)
    if problems:
        raise UserError(
            f"{path} holds values no run could have saved (damaged, or not scale_llm's):\n  - "
            + "\n  - ".join(problems)
            + "\nResume, convert or export another checkpoint (a run directory picks its newest "
            "good one)."
        )
    return state


# Every key of a trainer state in the current format (and RECORDED).
TRAINER_KEYS = tuple(
    "format step data rng skipped_steps bad_streak config plan tokenizer_sha256 backend".split()
)


def refuse_other_format(state: Any, path: Path) -> None:
    """Refuse a trainer state of another format than TRAINER_FORMAT, naming the scale_llm that
    wrote it (a value that is no format is left for `trainer_state_problems`)."""
    # (the first format 1 states had no such key; later ones held their layout under it)
    version = state.get("format", 1) if isinstance(state, dict) else 0
    version = 1 if isinstance(version, str) else version
    if not is_count(version) or version in (0, TRAINER_FORMAT):
        return
    if version > TRAINER_FORMAT:
        raise UserError(
            f"{path} is in trainer-state format {version}, written by a newer scale_llm (this "
            f"one reads format {TRAINER_FORMAT} only); upgrade scale_llm to read it"
        )
    raise UserError(
        f"{path} was written by scale_llm before {FORMAT_SINCE} (trainer-state format "
        f"{version}, q/k/v stacked); this scale_llm reads format {TRAINER_FORMAT} only: retrain, "
        f"or export it with the scale_llm that wrote it (`scale-llm export`) and start from the "
        f"export (model.init_from)"
    )


def trainer_state_problems(state: Any, ckpt_dir: Path) -> list[str]:
    """One line per field of a trainer state that no run could have saved."""
    if not isinstance(state, dict):
        return [f"it holds a {type(state).__name__}, not the trainer state mapping"]
    version = state.get("format")
    if not (is_count(version) and version == TRAINER_FORMAT):  # (another format: refused)
        return [f"format: {short(version, 40)} is not a trainer-state format"]
    if missing := [key for key in TRAINER_KEYS if key not in state]:
        return [f"{key}: missing (every trainer state holds it)" for key in missing]
    out, step, named = [], state["step"], step_of(ckpt_dir)
    if not is_count(step):
        out.append(f"step: {short(step, 40)} is not a step count (an integer >= 0)")
    elif named >= 0 and step != named:
        out.append(f"step: {step}, but the directory {ckpt_dir.name} is step {named}")
    config = state["config"]
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        out.append(f"config.model: {short(model, 40)} is not the saved model section")
    else:
        cfg, problems = saved_section(ModelConfig, "model", model)
        out += [f"config.{p}" for p in problems] or _size_problems(cfg, ckpt_dir)
    sha = state["tokenizer_sha256"]
    if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
        out.append(f"tokenizer_sha256: {short(sha, 40)} is not a SHA-256 hex digest")
    return out + _plan_problems(state["plan"])


def _plan_problems(plan: Any) -> list[str]:
    """The saved run plan's fields its readers use (backend, world size, precision)."""
    if not isinstance(plan, dict):
        return [f"plan: {short(plan, 40)} is not the saved run plan"]
    if plan.get("precision") not in ("bf16", "fp16", "fp32"):
        return [f"plan.precision: {short(plan.get('precision'), 40)} is not bf16, fp16 or fp32"]
    if not isinstance(plan.get("backend"), str) or not is_count(plan.get("world_size")):
        return [
            f"plan: backend {short(plan.get('backend'), 40)} on "
            f"{short(plan.get('world_size'), 40)} ranks is not a backend on a rank count"
        ]
    return []


def is_count(value: Any) -> bool:
    """An int >= 0 (bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def saved_section(cls: type, name: str, saved: dict[str, Any]) -> tuple[Any, list[str]]:
    """Section `name` (dataclass `cls`) of a saved config, read by a user config's rules: (the
    section, one line per problem naming name.<key>); keys that have moved since are left out."""
    names = {f.name for f in dataclasses.fields(cls)}
    errors: list[str] = []
    section = build_section(cls, {k: v for k, v in saved.items() if k in names}, f"{name}.", errors)
    failed = [msg.split(":", 1)[0] for msg in errors]
    errors += [
        msg
        for msg in validate(Config(**{name: section}))
        if msg.startswith(f"{name}.") and not any(k in msg for k in failed)
    ]
    return section, errors


def saved_model_config(state: dict[str, Any]) -> ModelConfig:
    """The model a checkpoint's trainer state (from read_trainer_state) records."""
    cfg, problems = saved_section(ModelConfig, "model", state["config"]["model"])
    if problems:  # (read_trainer_state refused these already)
        raise UserError(f"{TRAINER_STATE}: config.{problems[0]}")
    return cfg


def _size_problems(cfg: ModelConfig, ckpt_dir: Path) -> list[str]:
    """The model must fit in the checkpoint's files (2 bytes a parameter at least), by a lower
    bound on the parameter count that keeps this free of the model code."""
    d, heads = cfg.d_model, cfg.n_heads
    kv = (cfg.n_kv_heads or heads) * (d // heads)
    hidden = cfg.mlp_hidden or math.ceil(8 * d / 3)  # (the default rounds up from here)
    params = cfg.vocab_size * d + cfg.n_layers * (2 * d * d + 2 * kv * d + 3 * d * hidden)
    held = sum(
        p.stat().st_size
        for p in entries_below(ckpt_dir)
        if p.is_file() and not p.is_symlink() and p.name not in (TRAINER_STATE, INTEGRITY)
    )
    if 2 * params <= held:
        return []
    return [
        f"config.model describes at least {params:,} parameters ({2 * params / 2**30:,.1f} GiB "
        f"even at 16 bits), but the checkpoint's weight files hold {held:,} bytes"
    ]


def load_model_weights(
    ckpt_dir: Path, template: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict of any checkpoint, on the CPU, in one process: DCP is read
    into `template` (e.g. `model.empty_state_dict(cfg)`); DeepSpeed's is assembled from its
    partitions, one tensor at a time."""
    if (ckpt_dir / DCP_DIR).is_dir():  # (the files' shapes checked first: DCP's would traceback)
        files = _DcpTensors(ckpt_dir / DCP_DIR, {n: t.shape for n, t in template.items()})
        dcp_load({"model": template}, files.dir, not is_distributed(), files.metadata)
        for name, tensor in template.items():
            finite(tensor, name, ckpt_dir)
        return template
    return dict(CheckpointWeights(ckpt_dir, template))


def finite(tensor: torch.Tensor, name: str, ckpt_dir: Path) -> torch.Tensor:
    """`tensor`, refused as damage where it holds a NaN or an infinity (what a converted or
    exported model would carry on without a word)."""
    bad = sum(int((~torch.isfinite(c)).sum()) for c in tensor.reshape(-1).split(1 << 22))
    if bad:
        raise damaged(ckpt_dir, f"{name} holds {bad:,} NaN or infinite values")
    return tensor


def load_state_into(state: dict[str, Any], ckpt_dir: Path) -> None:
    """Fill `state` ({"model", "optimizer"} as torch's `get_state_dict` gives them, each tensor
    whole or this rank's DTensor shard) from any checkpoint; DeepSpeed's partitions are read one
    parameter at a time (fp32 values, Adam's moments, step), so no rank holds them whole."""
    if (ckpt_dir / DCP_DIR).is_dir():
        dcp_load(state, ckpt_dir / DCP_DIR, no_dist=not is_distributed())
        return
    zero = ZeroWeights(ckpt_dir / DEEPSPEED_DIR)
    step = zero.optimizer_step()
    for name, tensor in state["model"].items():
        fill_block(tensor, zero[name])
    for name, moments in state["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            fill_block(moments[key], zero.read(name, key))
        moments["step"].fill_(step)  # (AdamW's per-parameter step: a scalar tensor)


def checkpoint_around(path: Path) -> Path | None:
    """The checkpoint (a folder holding trainer.pt and integrity.json) or run's checkpoints
    folder (holding its claim) that `path` is or lies in: files written there damage that
    checkpoint, or are pruned or moved aside with it."""
    target = Path(os.path.realpath(path))
    for folder in (target, *target.parents):
        if (folder / TRAINER_STATE).is_file() and (folder / INTEGRITY).is_file():
            return folder
        if (folder / CLAIM).is_file():
            return folder
    return None


def refuse_inside_checkpoint(path: Path, shown: str, key: str) -> None:
    """`shown` (`path`, as the message names it) outside every checkpoint; `key` sets it."""
    if (folder := checkpoint_around(path)) is None:
        return
    what = "a run's checkpoints folder" if (folder / CLAIM).is_file() else "a checkpoint"
    raise UserError(
        f"{shown} lies in {folder}, {what}: what is written there would damage its checkpoints, "
        f"or be pruned or moved aside with them, so it stops before any work. Point {key} at a "
        f"folder outside any run's checkpoints"
    )


@torch.no_grad()
def fill_block(dst: torch.Tensor, full: torch.Tensor) -> None:
    """`full` (every rank holds the same) into `dst`: whole, or this rank's block of a
    DTensor (the block DCP would read for it: no communication)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(dst, DTensor):
        dst.copy_(full)
        return
    shape, offset = compute_local_shape_and_global_offset(
        full.shape, dst.device_mesh, dst.placements
    )
    block = tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))
    dst.to_local().copy_(full[block])


class CheckpointWeights(Mapping[str, torch.Tensor]):
    """Any checkpoint's fp32 model weights by name, each read when asked (DCP's bytes of it alone,
    or DeepSpeed's put together from the ranks' partitions), so a caller taking them one at a time
    holds one full parameter at a time. `template`: the model's tensors (meta will do)."""

    def __init__(self, ckpt_dir: Path, template: dict[str, torch.Tensor]):
        self.shapes, self.dir = {n: t.shape for n, t in template.items()}, ckpt_dir
        self.source: _DcpTensors | ZeroWeights
        if (ckpt_dir / DCP_DIR).is_dir():
            self.source = _DcpTensors(ckpt_dir / DCP_DIR, self.shapes)
        elif (ckpt_dir / DEEPSPEED_DIR).is_dir():
            self.source = ZeroWeights(ckpt_dir / DEEPSPEED_DIR, self.shapes)
        else:
            raise UserError(
                f"{ckpt_dir} holds no model weights ({DCP_DIR}/ or {DEEPSPEED_DIR}/); "
                f"point at a complete checkpoint directory"
            )

    def __getitem__(self, name: str) -> torch.Tensor:
        return finite(self.source[name], name, self.dir)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


class _DcpTensors:
    """A DCP checkpoint's tensors as ZeroWeights gives DeepSpeed's, each read alone."""

    def __init__(self, dcp_dir: Path, shapes: dict[str, torch.Size]):
        self.dir, self.shapes, self.metadata = dcp_dir, shapes, dcp_metadata(dcp_dir)
        saved = self.metadata.state_dict_metadata
        for name, shape in shapes.items():  # (what DCP's load would stop at, one rank at a time)
            size = getattr(saved.get(f"model.{name}"), "size", None)
            if size is None or tuple(size) != tuple(shape):
                held = "no such tensor" if size is None else f"shape {tuple(size)}"
                raise damaged(
                    dcp_dir,
                    f"the model needs {name} of shape {tuple(shape)}; its files hold {held}: its "
                    f"trainer state names another model than its weights",
                )
        if extra := [k for k in saved if k.startswith("model.") and k[6:] not in shapes]:
            raise damaged(  # (a model of fewer layers, or tied embeddings: weights left unread)
                dcp_dir,
                f"its files hold {extra[0]}, which the model has not ({len(extra)} such "
                f"tensors): its trainer state names another model than its weights",
            )

    def read(self, name: str, key: str | None = None, shape: Any = None) -> torch.Tensor:
        """Parameter `name` (`key` None), or its optimizer state `key`."""
        tensor = torch.empty(self.shapes[name] if shape is None else shape)
        state = {name: tensor} if key is None else {"state": {name: {key: tensor}}}
        dcp_load({"optimizer" if key else "model": state}, self.dir, True, self.metadata)
        return tensor

    __getitem__ = read

    def optimizer_step(self) -> int:
        step = self.read(next(iter(self.shapes)), "step", ()).item()
        if not (step >= 0 and float(step).is_integer()):
            raise damaged(self.dir, f"the optimizer's step is {step}")
        return int(step)
