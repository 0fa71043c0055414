"""Reading and writing the pickled files a run leaves behind, without ever running their code.

A pickle can call any importable callable while it loads, so every pickled file goes through an
allow-list: `torch.load(weights_only=True)` (DeepSpeed's files: plus three DeepSpeed classes), DCP's
.metadata a restricted unpickler. Anything else is an `UnsafeCheckpoint` before it is called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import itertools
import math
import pickle
import re
import struct
import sys
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scale_llm.errors import UserError

TRUST = "see 'Security' in docs/reliability.md for what is safe to load"


class UnsafeCheckpoint(UserError):
    """A checkpoint file names a class or function that no checkpoint of ours holds."""


class DamagedCheckpoint(UserError):
    """A checkpoint file cannot be read: truncated, overwritten or not the format it claims."""


def refused(path: Path | str, what: str, fix: str = "") -> UnsafeCheckpoint:
    fix = fix or "Delete the file or the checkpoint, or resume from another one"
    return UnsafeCheckpoint(
        f"refusing to load {path}: it holds a pickled {what}, which no checkpoint written by "
        f"scale_llm, PyTorch's distributed checkpoint or DeepSpeed contains; unpickling it could "
        f"run code planted in the file. Nothing from it was loaded. {fix} ({TRUST})"
    )


def damaged(path: Path | str, reason: str, fix: str = "") -> DamagedCheckpoint:
    fix = fix or "resume from an earlier checkpoint or delete this one"
    return DamagedCheckpoint(
        f"cannot read {path}: the file is damaged or incomplete ({reason[:200]}); {fix}"
    )


def _refused_global(e: Exception) -> str | None:
    """The name torch's weights-only unpickler refused, if that is why it failed."""
    if m := re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", str(e)):
        return m.group(1)
    if "Weights only load failed" in str(e):
        m = re.search(r"Unsupported operand \d+|Unsupported class [\w.]+|Trying to [^.\n]+", str(e))
        return m.group(0) if m else "object outside the weights-only allow-list"
    return None


def load_file(
    path: Path | str,
    map_location: Any = "cpu",
    safe_globals: list[Any] | tuple[Any, ...] = (),
    mmap: bool = False,
    fix: str = "",
) -> Any:
    """`torch.load(weights_only=True)` of one file (`mmap`: its tensors mapped, read when
    touched); a refused global or a damaged file becomes a UserError naming the file (and
    `fix`, where it is not a checkpoint's)."""
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except (
        pickle.UnpicklingError,
        RuntimeError,
        EOFError,
        ValueError,
        KeyError,
        OSError,
        IndexError,
        struct.error,
        AssertionError,
        TypeError,
        AttributeError,
    ) as e:  # (the last five: the unpickler and torch's legacy reader on random bytes)
        if isinstance(e, FileNotFoundError | PermissionError):
            raise
        name = _refused_global(e) if isinstance(e, pickle.UnpicklingError) else None
        if name is not None:
            raise refused(path, f"`{name}`", fix) from None
        raise damaged(path, str(e).splitlines()[0] if str(e) else type(e).__name__, fix) from None


def save_file(obj: Any, path: Path | str) -> None:
    """torch.save through the hashing file system, into a checkpoint's own `.tmp-step_N`."""
    from scale_llm.components.digests import HashingFileSystem

    with HashingFileSystem().create_stream(path, "wb") as f:
        torch.save(obj, f)


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
_PLAIN = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name among torch's layouts
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in _PATHS),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses and enums and a few plain torch values, nothing else."""

    def __init__(self, file: Any, path: Path | str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), torch.dtype | torch.memory_format
        ):
            return getattr(torch, name)
        if module in _DCP_MODULES and "." not in name:  # (a dotted name reaches all of torch)
            obj = super().find_class(module, name)
            if (  # defined there: not a name it imports (`Enum` itself makes classes)
                isinstance(obj, type)
                and obj.__module__ == module
                and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
            ):
                return obj
        raise refused(self.path, f"`{module}.{name}`")

    def persistent_load(self, pid: Any) -> Any:
        raise refused(self.path, "persistent reference")


def dcp_metadata(checkpoint_id: Path) -> Any:
    """The checked metadata of the DCP checkpoint folder `checkpoint_id`."""
    metadata_file = Path(checkpoint_id) / ".metadata"
    if not metadata_file.is_file():
        raise damaged(checkpoint_id, "its .metadata file is missing")
    return read_dcp_metadata(metadata_file)  # errors here name the file (DCP's would not)


def read_dcp_metadata(path: Path | str) -> Any:
    """The Metadata object of a DCP checkpoint's metadata file, through the allow-list."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise damaged(path, f"{type(e).__name__}: {e}") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise damaged(path, f"it holds a {type(metadata).__name__}, not DCP metadata")
    stored = metadata.storage_data or {}
    for info in stored.values():
        rel = getattr(info, "relative_path", "")
        if not isinstance(rel, str) or "/" in rel or "\\" in rel or rel in ("", ".", ".."):
            raise damaged(path, f"a data file name that leaves the checkpoint: {rel!r}")
    held = {(getattr(k, "fqn", None), tuple(getattr(k, "offset", None) or ())) for k in stored}
    for fqn, entry in (metadata.state_dict_metadata or {}).items():
        if hasattr(entry, "chunks") and (problem := _tiling_problem(fqn, entry, held)):
            raise damaged(path, f"{fqn}: {problem}")
    return metadata


def _tiling_problem(fqn: str, entry: Any, held: set[tuple[Any, tuple]]) -> str | None:
    """Why a tensor's chunks do not cover it exactly once, each with bytes to read (`held`: the
    (name, offset) of every stored chunk); None when they do. DCP reads a tensor into memory it
    leaves uninitialized where no chunk lands."""
    shape, chunks = tuple(getattr(entry, "size", None) or ()), list(entry.chunks or [])
    nd = len(shape)
    try:  # (n, nd) whole numbers; a ragged, float or bool entry is none
        at = np.array([tuple(c.offsets) for c in chunks]).reshape(len(chunks), nd)
        size = np.array([tuple(c.sizes) for c in chunks]).reshape(len(chunks), nd)
        dims = np.array(shape, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return f"its chunks do not fit a tensor of shape {shape}"
    if at.size and (at.dtype.kind != "i" or size.dtype.kind != "i") or (dims < 0).any():
        return f"its chunks do not fit a tensor of shape {shape}"
    if (at < 0).any() or (size < 0).any() or (at + size > dims).any():
        return f"a chunk reaches past its shape {shape}"
    if missing := [tuple(c.offsets) for c in chunks if (fqn, tuple(c.offsets)) not in held]:
        return f"its chunk at {missing[0]} names no bytes"
    volume = sum(math.prod(map(int, row)) for row in size)  # (Python ints: no overflow)
    if nd == 0 or volume != math.prod(shape):
        once = volume == math.prod(shape) and len(chunks) == 1
        return None if once else "its chunks do not cover it exactly once"
    if volume == 0:  # (a tensor of no elements: nothing to read, whatever its chunks)
        return None
    # cut each dim at every chunk's edges: a cell between neighbouring cuts lies in a chunk whole
    # or not at all. Each chunk adds +-1 at its 2^nd corners; the running sums count its cells
    cuts = [
        np.unique(np.concatenate([[0, n], at[:, d], at[:, d] + size[:, d]]))
        for d, n in enumerate(shape)
    ]
    ends = [
        (np.searchsorted(c, at[:, d]), np.searchsorted(c, at[:, d] + size[:, d]))
        for d, c in enumerate(cuts)
    ]
    if math.prod(len(c) - 1 for c in cuts) > 64 * len(chunks):  # (a save's chunks form a grid)
        return f"its {len(chunks):,} chunks do not form a grid"
    count = np.zeros([len(c) for c in cuts], np.int64)
    for corner in itertools.product((0, 1), repeat=nd):
        index = tuple(ends[d][k] for d, k in enumerate(corner))
        np.add.at(count, index, (-1) ** sum(corner))
    for d in range(nd):
        count = np.cumsum(count, axis=d)
    cells = count[tuple(slice(0, len(c) - 1) for c in cuts)]
    return None if (cells == 1).all() else "its chunks do not cover it exactly once"


def _safe_reader_and_planner(checkpoint_id: Path, metadata: Any) -> tuple[Any, Any]:
    """A FileSystemReader returning the metadata read through the allow-list, and a planner
    reading byte items weights_only (DCP's own use pickle.load and weights_only=False)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                what = f"{checkpoint_id} (item {fqn})"
                if (name := _refused_global(e)) is not None:
                    raise refused(what, f"`{name}`") from None
                raise damaged(what, str(e).splitlines()[0]) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return Reader(checkpoint_id), Planner()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process save / load even when told it is one (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# what DCP raises reading bytes that are not what the metadata says: a short file, a size
# mismatch, a torch.save zip cut short (other errors, I/O and bugs, keep their own report)
READ_ERRORS = (EOFError, ValueError)


def dcp_load(
    state: dict[str, Any], checkpoint_id: Path, no_dist: bool, metadata: Any = None
) -> None:
    """`torch.distributed.checkpoint.load` into `state`, through the allow-lists above
    (`metadata`: the checkpoint's, already read by `dcp_metadata`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    checkpoint_id = Path(checkpoint_id)
    metadata = metadata or dcp_metadata(checkpoint_id)
    reader, planner = _safe_reader_and_planner(checkpoint_id, metadata)
    try:
        with _quiet_single_process():
            dcp.load(
                state,
                checkpoint_id=checkpoint_id,
                storage_reader=reader,
                planner=planner,
                no_dist=no_dist,
            )
    except CheckpointException as e:  # DCP wraps each rank's exception
        failures = [err for _, (err, _) in sorted(getattr(e, "failures", {}).items())]
        for err in failures:
            if isinstance(err, UserError):
                raise err from None
        for err in failures:  # a tensor pickled as a class outside the allow-list
            if isinstance(err, pickle.UnpicklingError) and (name := _refused_global(err)):
                if name.endswith(".WeightWithDynamicFloat8CastTensor"):
                    raise UserError(
                        f"{checkpoint_id}: its tensors were saved inside torchao's fp8 weight "
                        f"class (an FSDP2 run gathering fp8 weights, written before 2026-12-07), "
                        f"which only a run with train.fp8.enabled=true reads; resume it so "
                        f"(parallel.backend=fsdp) and read the checkpoint it saves next"
                    ) from None
                raise refused(checkpoint_id, f"`{name}`") from None
        for err in failures:  # a file gone while it was read: not the user's path to fix
            if isinstance(err, FileNotFoundError):
                raise damaged(
                    checkpoint_id,
                    f"its file {Path(err.filename or '?').name} is missing: an incomplete copy, "
                    f"or removed while it was read (a live run's checkpoint.keep_last removes "
                    f"its older checkpoints)",
                    "copy the whole checkpoint elsewhere first, or read a newer one",
                ) from None
        for err in failures:  # files that do not hold what the metadata says
            zipped = isinstance(err, RuntimeError) and "PytorchStreamReader" in str(err)
            if isinstance(err, READ_ERRORS) or zipped:
                said = str(err).strip().splitlines()[:1]
                raise damaged(checkpoint_id, ": ".join([type(err).__name__, *said])) from None
        raise


@dataclasses.dataclass
class BackgroundSave:
    """How a DCP save runs in the background (`checkpoint.async_mode`): the writer thread's own
    process group (None in one process), the stager (None: a fresh host copy per save; a kept
    `DefaultStager`: one reused copy), and `on_written` (the crash tests' fault point)."""

    group: Any = None
    stager: Any = None
    on_written: Callable[[], None] | None = None


def background_save(async_mode: str, device: torch.device) -> BackgroundSave | None:
    """What `checkpoint.async_mode` asks for (None: disabled); collective (makes a group)."""
    if async_mode == "disabled":
        return None
    from scale_llm.components.distributed import side_group

    stager = kept_stager(device) if async_mode == "async_with_pinned_mem" else None
    return BackgroundSave(group=side_group(), stager=stager)


def kept_stager(device: torch.device) -> Any:
    """A DCP stager reusing one host copy of the state (page-locked and non-blocking on a GPU)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    gpu = device.type == "cuda"
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=gpu,
            use_shared_memory=False,  # (for a writer process; ours is a thread)
            use_async_staging=False,  # the copy is done when the save call returns
            use_non_blocking_copy=gpu,
        )
    )


def dcp_save(
    state: dict[str, Any],
    checkpoint_id: Path,
    no_dist: bool,
    background: BackgroundSave | None = None,
) -> Future | None:
    """torch.distributed.checkpoint's save through the hashing file system. With `background`,
    `async_save`: the state is in host memory when this returns the write's Future."""
    import torch.distributed.checkpoint as dcp

    from scale_llm.components.digests import HashingFileSystem

    on_written = background and background.on_written

    class Writer(dcp.FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            done = super().write_data(plan, planner)  # (written when it returns)
            if on_written is not None:
                on_written()
            return done

    writer = Writer(checkpoint_id)
    writer.fs = HashingFileSystem()
    if background is None:
        with _quiet_single_process():
            dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id, no_dist=no_dist)
        return None
    # DCP's writer thread warns too; a filter cannot be scoped to a block another thread runs
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    return dcp.async_save(
        state,
        storage_writer=writer,
        checkpoint_id=checkpoint_id,
        process_group=background.group,
        async_stager=background.stager,  # None: the writer stages (a fresh copy each save)
        no_dist=no_dist,
    )


def deepspeed_safe_globals() -> list[Any]:
    """The DeepSpeed classes its ZeRO checkpoint files hold (ZeRO 0-3, DeepSpeed 0.19). Its
    logger writes to the stdout of its import: stderr here, where generate prints its text."""
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def hash_deepspeed_writes(engine: Any) -> list[Exception]:
    """Make a DeepSpeed engine's torch checkpoint engine write through the hashing file system.
    A write that fails is recorded in the list returned, not raised: the rank then passes
    DeepSpeed's barriers with the others, and the caller raises it after the save."""
    from scale_llm.components.digests import HashingFileSystem

    failed: list[Exception] = []
    writer = engine.checkpoint_engine
    if type(writer).__name__ != "TorchCheckpointEngine":
        return failed
    zipfile = getattr(writer, "zipfile_serialization", True)

    def save(state_dict: Any, path: str) -> None:  # (DeepSpeed writes into our .tmp-step_N)
        if failed:
            return
        try:
            with HashingFileSystem().create_stream(path, "wb") as f:
                torch.save(state_dict, f, _use_new_zipfile_serialization=zipfile)
        except Exception as e:
            failed.append(e)

    writer.save = save
    return failed


def guard_deepspeed_reader(engine: Any) -> None:
    """Make a DeepSpeed engine read its files `weights_only` (its own unpickles anything)."""
    allowed = deepspeed_safe_globals()

    def load(path: str, map_location: Any = None) -> Any:
        return load_file(path, map_location=map_location, safe_globals=allowed)

    engine.checkpoint_engine.load = load
