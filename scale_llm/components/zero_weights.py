"""A DeepSpeed checkpoint's fp32 model weights and Adam state, read one tensor at a time from
its own files.

A DeepSpeed save writes each rank's partitions and nothing else; the full weights are put
together where they are needed (a resume on another backend, generate, export, convert):
- ZeRO-1/2: each rank holds one slice of every parameter group's flat fp32 vector (the group's
  parameters end to end in `param_shapes` order, each followed by its alignment padding);
- ZeRO-3: each rank holds ceil(numel / world) values of every parameter, end to end;
- ZeRO-0 has no partitions: the module's state is the weights (16-bit under bf16).
The base optimizer's state (Adam's exp_avg, exp_avg_sq) of each group lies beside its flat fp32
slice, value for value (plus DeepSpeed's end padding), so a moment is read by the same pieces.
Every file is read through `load_file` (weights_only, DeepSpeed's three classes allowed),
memory-mapped, once for the life of the reader: a tensor copies its values out of the pages it
spans, so the reader holds one full parameter at a time (and the pages touched), never the model.
param_shapes must use up the partitions' values exactly, as DeepSpeed's zero_to_fp32 checks.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from scale_llm.components.serialization import damaged, deepspeed_safe_globals, load_file

MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
_PARTITION = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
Groups = list[dict[str, torch.Size]]  # each parameter group's {name: shape}, in order
_MAX_DIM = 2**48  # (no real dimension comes near; a larger one is damage, not a shape)


class _Layout(Exception):
    """The partitions do not hold the parameters param_shapes lists (one line: what)."""


@dataclasses.dataclass(frozen=True)
class _Piece:
    """`length` values from `start` of the fp32 group `group` of rank `rank`'s partition."""

    rank: int
    group: int
    start: int
    length: int


def model_states_file(ds_dir: Path) -> Path | None:
    """Rank 0's model-state file (ZeRO 0-2's, or ZeRO-3's), or None."""
    return next((ds_dir / n for n in MODEL_STATES if (ds_dir / n).is_file()), None)


class ZeroWeights(Mapping[str, torch.Tensor]):
    """The fp32 weights of DeepSpeed's checkpoint folder `ds_dir` by name, each assembled from
    the partitions when asked."""

    def __init__(self, ds_dir: Path):
        self.model_file = model_states_file(ds_dir)
        if self.model_file is None:
            raise damaged(ds_dir, f"neither {' nor '.join(MODEL_STATES)} is there")
        self._loaded: dict[Path, Any] = {}  # each file's one memory-mapped load
        self._flats: dict[tuple[int, str | None], list[torch.Tensor]] = {}
        self._states = states = self._load(self.model_file)
        module, groups = _module_and_groups(states, self.model_file)
        self.shapes: dict[str, torch.Size] = {}
        self.where: dict[str, list[_Piece] | None] = {}  # None: the module's own tensor
        if groups is None:  # ZeRO-0: the module holds the weights
            self.partitions: list[Path] = []
            for name, tensor in module.items():
                self.shapes[name], self.where[name] = tensor.shape, None
        else:  # ZeRO 1-3: the parameters are in the partitions, the buffers in the module
            self.partitions = partition_files(ds_dir)
            stage, sizes = _stage_and_sizes(self.partitions, [self._inner(r) for r in self.ranks])
            try:
                _check_sizes(groups, sizes)
                if stage == 3:
                    self.where = _zero3_pieces(groups, sizes)
                else:
                    paddings = _paddings(self._inner(0), self.partitions[0])
                    self.where = _zero12_pieces(groups, sizes, paddings)
            except _Layout as e:
                raise damaged(ds_dir, f"its optimizer partitions {e}") from None
            self.shapes = {name: shape for group in groups for name, shape in group.items()}
            for name in states.get("buffer_names") or ():
                if name in module:
                    self.shapes[name], self.where[name] = module[name].shape, None
        for alias, name in (states.get("shared_params") or {}).items():
            if not isinstance(alias, str) or name not in self.shapes:
                raise damaged(self.model_file, f"shared_params names {name!r}, no parameter")
            self.shapes[alias], self.where[alias] = self.shapes[name], self.where[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.where[name] is None:  # (a buffer, or ZeRO-0)
            return self._states["module"][name].to(torch.float32, copy=True)
        return self.read(name)

    def read(self, name: str, key: str | None = None) -> torch.Tensor:
        """Parameter `name`'s fp32 values (`key` None), or its optimizer state `key` (Adam's
        exp_avg, exp_avg_sq): each lies in the partitions as the fp32 values do."""
        shape, pieces = self.shapes[name], self.where[name]
        if pieces is None:
            raise damaged(self.model_file, f"{name!r} has no optimizer state (ZeRO-0?)")
        if not pieces:  # (no values: nothing to read)
            return torch.zeros(shape)
        flat = torch.cat(
            [self._flat(p.rank, key)[p.group].narrow(0, p.start, p.length) for p in pieces]
        )
        return flat[: shape.numel()].view(shape).float()  # (a copy, the mapping untouched)

    def check_optimizer_state(self) -> None:
        """Every partition holds Adam's moments laid out as its fp32 values, and one step."""
        for rank in self.ranks:
            for key in ("exp_avg", "exp_avg_sq"):
                self._flat(rank, key)
        self.optimizer_step()

    def optimizer_step(self) -> int:
        """The optimizer steps taken (the base optimizer's `step`, one for every group)."""
        if not self.partitions:
            raise damaged(self.model_file.parent, "it holds no optimizer partitions (ZeRO-0)")
        path = self.partitions[0]
        steps = {_step(s) for s in _base_state(self._inner(0), path)}
        if len(steps) != 1 or None in steps:
            raise damaged(path, f"its optimizer groups' steps are {sorted(map(str, steps))}")
        return steps.pop()

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def ranks(self) -> range:
        return range(len(self.partitions))

    def _load(self, path: Path) -> Any:
        """The file's one memory-mapped load (its tensors' pages read when touched)."""
        if path not in self._loaded:
            self._loaded[path] = load_file(path, safe_globals=deepspeed_safe_globals(), mmap=True)
        return self._loaded[path]

    def _inner(self, rank: int) -> dict[str, Any]:
        return _optimizer_state(self._load(self.partitions[rank]), self.partitions[rank])

    def _flat(self, rank: int, key: str | None) -> list[torch.Tensor]:
        """Rank `rank`'s flat fp32 values (`key` None) or optimizer state `key`, per group."""
        if (rank, key) not in self._flats:
            self._flats[rank, key] = _flat_groups(self._inner(rank), self.partitions[rank], key)
        return self._flats[rank, key]


def _is_shape(shape: Any) -> bool:
    return isinstance(shape, tuple) and all(type(d) is int and 0 <= d < _MAX_DIM for d in shape)


def _module_and_groups(states: Any, path: Path) -> tuple[dict[str, torch.Tensor], Groups | None]:
    """The module state and each partitioned group's {name: shape} (None: ZeRO-0), checked."""
    module = states.get("module") if isinstance(states, dict) else None
    if not isinstance(module, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in module.items()
    ):
        raise damaged(path, "its module state is not a {name: tensor} mapping")
    groups = states.get("param_shapes")
    if groups is None:
        return module, None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and all(isinstance(k, str) and _is_shape(s) for k, s in g.items())
        for g in groups
    ):
        raise damaged(path, "param_shapes is not a list of {name: shape}, one per group")
    if states.get("frozen_param_shapes"):  # (a scale_llm run trains every parameter)
        raise damaged(path, "it lists frozen parameters, which no scale_llm run has")
    return module, [{k: torch.Size(s) for k, s in g.items()} for g in groups]


def partition_files(ds_dir: Path) -> list[Path]:
    """Every rank's optimizer partition file, by rank: all of ranks 0..N-1, or damage."""
    found: dict[int, Path] = {}
    for path in sorted(ds_dir.iterdir()):
        if (m := _PARTITION.match(path.name)) and path.is_file():
            if (rank := int(m.group(1))) in found:  # (which one the save wrote is unknowable)
                raise damaged(
                    ds_dir,
                    f"rank {rank} has two optimizer partitions, {found[rank].name} and {path.name}",
                )
            found[rank] = path
    if not found or sorted(found) != list(range(len(found))):
        raise damaged(ds_dir, f"its optimizer partitions are of ranks {sorted(found)}")
    return [found[rank] for rank in range(len(found))]


def _optimizer_state(state: Any, path: Path) -> dict[str, Any]:
    inner = state.get("optimizer_state_dict") if isinstance(state, dict) else None
    if not isinstance(inner, dict):
        raise damaged(path, "it holds no optimizer_state_dict")
    return inner


def _fp32_groups(inner: dict[str, Any], path: Path) -> list[torch.Tensor]:
    """A partition file's flat fp32 slices, one per parameter group."""
    groups = inner.get("fp32_flat_groups", inner.get("single_partition_of_fp32_groups"))
    if not isinstance(groups, list) or not all(_is_flat(g) for g in groups):
        raise damaged(path, "its fp32 groups are not a list of flat fp32 tensors")
    return groups


def _is_flat(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype == torch.float32


def _base_state(inner: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """The base optimizer's state of each group's flat partition (ZeRO-1/2: its torch
    state_dict, or a list when written elastic; ZeRO-3: its torch state_dict)."""
    base = inner.get("base_optimizer_state", inner.get("optimizer_state_dict"))
    if isinstance(base, dict):
        state = base.get("state")
        base = [state.get(g) for g in range(len(state))] if isinstance(state, dict) else None
    if not isinstance(base, list) or not all(isinstance(s, dict) for s in base):
        raise damaged(path, "it holds no optimizer state per parameter group")
    return base


def _step(state: dict[str, Any]) -> int | None:
    step = state.get("step")
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    return step if type(step) is int and step >= 0 else None


def _flat_groups(inner: dict[str, Any], path: Path, key: str | None) -> list[torch.Tensor]:
    """A partition file's flat fp32 values (`key` None) or optimizer state `key`, per group;
    a state is as long as the group's values or longer (DeepSpeed's end padding)."""
    groups = _fp32_groups(inner, path)
    if key is None:
        return groups
    states = [s.get(key) for s in _base_state(inner, path)]
    if len(states) != len(groups) or not all(
        _is_flat(s) and len(s) >= len(g) for s, g in zip(states, groups, strict=True)
    ):
        raise damaged(path, f"its optimizer state {key!r} is not one flat fp32 tensor per group")
    return states


def _stage_and_sizes(
    partitions: list[Path], inners: list[dict[str, Any]]
) -> tuple[int, list[list[int]]]:
    """The ZeRO stage, and the length of each rank's fp32 groups ([rank][group])."""
    first = inners[0]
    stage, count = first.get("zero_stage"), first.get("partition_count")
    count = max(count) if isinstance(count, list) and count else count
    if not isinstance(stage, int) or stage not in (1, 2, 3):  # (an IntEnum in the file)
        raise damaged(partitions[0], f"zero_stage {stage!r} is not 1, 2 or 3")
    if count != len(partitions):
        raise damaged(
            partitions[0].parent,
            f"it holds {len(partitions)} optimizer partitions of a save by {count!r} ranks",
        )
    sizes = [
        [g.numel() for g in _fp32_groups(i, p)] for i, p in zip(inners, partitions, strict=True)
    ]
    return int(stage), sizes


def _check_sizes(groups: Groups, sizes: list[list[int]]) -> None:
    """No parameter holds more values than the partitions do (nor could torch count them)."""
    held = sum(map(sum, sizes))
    for name, shape in ((n, s) for group in groups for n, s in group.items()):
        if (numel := math.prod(shape)) > held:
            raise _Layout(f"hold {held} values, but param_shapes lists {name!r} of {numel} values")


def _paddings(inner: dict[str, Any], partition: Path) -> list[list[int]] | None:
    """The alignment padding after each parameter, per group (None: written without any)."""
    paddings = inner.get("param_alignment_paddings")
    if paddings is not None and not (
        isinstance(paddings, list)
        and all(isinstance(g, list) and all(type(n) is int and n >= 0 for n in g) for g in paddings)
    ):
        raise damaged(partition, "param_alignment_paddings is not a list of counts per group")
    return paddings


def _spans(sizes: list[int], start: int, length: int, what: str) -> list[tuple[int, int, int]]:
    """(index, start, length) of the values [start, start + length) of tensors of `sizes` laid
    end to end; too few values is damage."""
    out = []
    for i, size in enumerate(sizes):
        if length == 0:
            break
        if start < size:
            take = min(size - start, length)
            out.append((i, start, take))
            start, length = 0, length - take
        else:
            start -= size
    if length:
        raise _Layout(f"end inside {what!r}")
    return out


def _zero12_pieces(
    groups: Groups, sizes: list[list[int]], paddings: list[list[int]] | None
) -> dict[str, list[_Piece]]:
    """ZeRO-1/2: group g's flat fp32 vector is the ranks' slices of group g end to end."""
    if any(len(s) != len(groups) for s in sizes) or (
        paddings is not None and [len(p) for p in paddings] != [len(g) for g in groups]
    ):
        raise _Layout("hold other parameter groups than param_shapes lists")
    out = {}
    for g, group in enumerate(groups):
        offset, per_rank = 0, [s[g] for s in sizes]
        for i, (name, shape) in enumerate(group.items()):
            spans = _spans(per_rank, offset, shape.numel(), name)
            out[name] = [_Piece(rank, g, start, n) for rank, start, n in spans]
            offset += shape.numel() + (paddings[g][i] if paddings is not None else 0)
        _used_up(offset, sum(per_rank), paddings is not None, len(sizes), f"in group {g}")
    return out


def _used_up(used: int, held: int, exact: bool, world: int, where: str) -> None:
    """param_shapes uses up a group's values (zero_to_fp32's check: written without per-parameter
    paddings, both counts rounded up to 2 * world, DeepSpeed's group alignment)."""
    if not exact:
        used, held = (math.ceil(n / (2 * world)) * 2 * world for n in (used, held))
    if used != held:
        raise _Layout(f"hold {held} values {where}, param_shapes lists {used}")


def _zero3_pieces(groups: Groups, sizes: list[list[int]]) -> dict[str, list[_Piece]]:
    """ZeRO-3: each rank holds ceil(numel / world) values of every parameter, end to end
    across its groups; the ranks' pieces in rank order, cut to numel, are the parameter."""
    world, offset, out = len(sizes), 0, {}
    for group in groups:
        for name, shape in group.items():
            share = math.ceil(shape.numel() / world)
            out[name] = [
                _Piece(rank, g, start, n)
                for rank, per_group in enumerate(sizes)
                for g, start, n in _spans(per_group, offset, share, name)
            ]
            offset += share
    for rank, per_group in enumerate(sizes):  # (every rank holds `offset` values)
        if sum(per_group) != offset:
            raise _Layout(
                f"of rank {rank} hold {sum(per_group)} values, param_shapes lists {offset}"
            )
    return out
