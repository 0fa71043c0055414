"""A DeepSpeed checkpoint's fp32 weights and Adam state, read one tensor at a time from its files
(a resume on another backend, generate, export and convert put the weights together here). Each
file is loaded once, memory-mapped: the reader holds one parameter at a time, never the model.
param_shapes must use the values up exactly, as DeepSpeed's zero_to_fp32 checks."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from scale_llm.components.serialization import damaged, deepspeed_safe_globals, load_file
from scale_llm.errors import UserError

MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
_PARTITION = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
Groups = list[dict[str, torch.Size]]  # each parameter group's {name: shape}, in order
Pieces = list[tuple[int, int, int, int]]  # (rank, group, start, length) of a rank's flat groups
_MAX_DIM = 2**48  # (no real dimension comes near; a larger one is damage, not a shape)


class _Damaged(Exception):
    """(the file, what is wrong with it): a check's refusal."""


class _Layout(Exception):
    """The partitions do not hold the parameters param_shapes lists (one line: what)."""


def _refusing(method: Callable[..., Any]) -> Callable[..., Any]:
    """The reader's one way out: `_Damaged` leaves as serialization's DamagedCheckpoint."""

    @functools.wraps(method)
    def refusing(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except _Damaged as e:
            raise damaged(*e.args) from None

    return refusing


def _load(path: Path) -> Any:
    """The file's one load, memory-mapped (its tensors' pages read when touched)."""
    return load_file(path, safe_globals=deepspeed_safe_globals(), mmap=True)


class ZeroWeights(Mapping[str, torch.Tensor]):
    """The fp32 weights of DeepSpeed's checkpoint folder `ds_dir` by name, each assembled from
    the partitions when asked; `model`: the shapes they must have (None: any)."""

    @_refusing
    def __init__(self, ds_dir: Path, model: Mapping[str, torch.Size] | None = None):
        found = [ds_dir / n for n in MODEL_STATES if (ds_dir / n).is_file()]
        if not found:
            raise _Damaged(ds_dir, f"neither {' nor '.join(MODEL_STATES)} is there")
        self.model_file = found[0]
        self._states = states = _load(self.model_file)
        module, groups = _module_and_groups(states, self.model_file)
        self.partitions: list[Path] = []
        self._inners: list[dict[str, Any]] = []  # each partition's optimizer_state_dict
        self._flats: dict[tuple[int, str | None], list[torch.Tensor]] = {}
        self.where: dict[str, Pieces | None]  # None: the module's own tensor
        if groups is None:  # ZeRO-0: the module holds the weights (16-bit under bf16)
            self.shapes = {name: tensor.shape for name, tensor in module.items()}
            self.where = dict.fromkeys(module)
        else:  # ZeRO 1-3: the parameters are in the partitions, the buffers in the module
            self.partitions = _partition_files(ds_dir)
            self._inners = [_optimizer_state(_load(p), p) for p in self.partitions]
            self.where = _pieces(ds_dir, groups, self.partitions, self._inners)
            self.shapes = {name: shape for group in groups for name, shape in group.items()}
            for name in states.get("buffer_names") or ():
                if name in module:
                    self.shapes[name], self.where[name] = module[name].shape, None
        real = set(self.shapes)  # (ZeRO-0's module holds a tied weight under both names)
        for alias, name in (states.get("shared_params") or {}).items():
            if not isinstance(alias, str) or name not in real:
                raise _Damaged(self.model_file, f"shared_params names {name!r}, no parameter")
            if alias in real and groups is not None:  # (it would read another's values)
                raise _Damaged(
                    self.model_file, f"shared_params sends parameter {alias!r} to {name!r}"
                )
            self.shapes[alias], self.where[alias] = self.shapes[name], self.where[name]
        if model is not None and (differs := _shape_differences(self.shapes, model)):
            raise _Damaged(ds_dir, f"{differs}, unlike the model it records")

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.where[name] is None:  # (a buffer, or ZeRO-0)
            return self._states["module"][name].to(torch.float32, copy=True)
        return self.read(name)

    @_refusing
    def read(self, name: str, key: str | None = None) -> torch.Tensor:
        """Parameter `name`'s fp32 values (`key` None), or its optimizer state `key` (Adam's
        exp_avg, exp_avg_sq): each lies in the partitions as the fp32 values do."""
        shape, pieces = self.shapes[name], self.where[name]
        if pieces is None:
            raise _Damaged(self.model_file, f"{name!r} has no optimizer state (ZeRO-0?)")
        if not pieces:  # (no values: nothing to read)
            return torch.zeros(shape)
        flat = torch.cat([self._flat(r, key)[g].narrow(0, s, n) for r, g, s, n in pieces])
        return flat[: shape.numel()].view(shape).float()  # (a copy, the mapping untouched)

    @_refusing
    def check_optimizer_state(self) -> None:
        """Every partition holds Adam's moments laid out as its fp32 values, and one step."""
        for rank in range(len(self.partitions)):
            for key in ("exp_avg", "exp_avg_sq"):
                self._flat(rank, key)
        self.optimizer_step()

    @_refusing
    def optimizer_step(self) -> int:
        """The optimizer steps taken (the base optimizer's `step`, one for every group)."""
        if not self.partitions:
            raise _Damaged(self.model_file.parent, "it holds no optimizer partitions (ZeRO-0)")
        path = self.partitions[0]
        steps = {_step(s) for s in _base_state(self._inners[0], path)}
        if len(steps) != 1 or None in steps:
            raise _Damaged(path, f"its optimizer groups' steps are {sorted(map(str, steps))}")
        return steps.pop()

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def _flat(self, rank: int, key: str | None) -> list[torch.Tensor]:
        """Rank `rank`'s flat fp32 values (`key` None) or optimizer state `key`, per group."""
        if (rank, key) not in self._flats:
            self._flats[rank, key] = _flat_groups(self._inners[rank], self.partitions[rank], key)
        return self._flats[rank, key]


def _is_shape(shape: Any) -> bool:
    return isinstance(shape, tuple) and all(type(d) is int and 0 <= d < _MAX_DIM for d in shape)


def _is_flat(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype == torch.float32


def _module_and_groups(states: Any, path: Path) -> tuple[dict[str, torch.Tensor], Groups | None]:
    """The module state and each partitioned group's {name: shape} (None: ZeRO-0), checked."""
    module = states.get("module") if isinstance(states, dict) else None
    if not isinstance(module, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in module.items()
    ):
        raise _Damaged(path, "its module state is not a {name: tensor} mapping")
    groups = states.get("param_shapes")
    if groups is None:
        return module, None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and all(isinstance(k, str) and _is_shape(s) for k, s in g.items())
        for g in groups
    ):
        raise _Damaged(path, "param_shapes is not a list of {name: shape}, one per group")
    if states.get("frozen_param_shapes"):  # (a scale_llm run trains every parameter)
        raise _Damaged(path, "it lists frozen parameters, which no scale_llm run has")
    return module, [{k: torch.Size(s) for k, s in g.items()} for g in groups]


def _partition_files(ds_dir: Path) -> list[Path]:
    """Every rank's optimizer partition file, by rank: all of ranks 0..N-1, or damage."""
    found: dict[int, Path] = {}
    for path in sorted(ds_dir.iterdir()):
        if (m := _PARTITION.match(path.name)) and path.is_file():
            if (rank := int(m.group(1))) in found:  # (which one the save wrote is unknowable)
                two = f"{found[rank].name} and {path.name}"
                raise _Damaged(ds_dir, f"rank {rank} has two optimizer partitions, {two}")
            found[rank] = path
    if not found or sorted(found) != list(range(len(found))):
        raise _Damaged(ds_dir, f"its optimizer partitions are of ranks {sorted(found)}")
    return [found[rank] for rank in range(len(found))]


def _optimizer_state(state: Any, path: Path) -> dict[str, Any]:
    inner = state.get("optimizer_state_dict") if isinstance(state, dict) else None
    if not isinstance(inner, dict):
        raise _Damaged(path, "it holds no optimizer_state_dict")
    return inner


def _fp32_groups(inner: dict[str, Any], path: Path) -> list[torch.Tensor]:
    """A partition file's flat fp32 slices, one per parameter group."""
    groups = inner.get("fp32_flat_groups", inner.get("single_partition_of_fp32_groups"))
    if not isinstance(groups, list) or not all(_is_flat(g) for g in groups):
        raise _Damaged(path, "its fp32 groups are not a list of flat fp32 tensors")
    return groups


def _base_state(inner: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """The base optimizer's state of each group's flat partition (ZeRO-1/2: its torch
    state_dict, or a list when written elastic; ZeRO-3: its torch state_dict)."""
    base = inner.get("base_optimizer_state", inner.get("optimizer_state_dict"))
    if isinstance(base, dict):
        state = base.get("state")
        base = [state.get(g) for g in range(len(state))] if isinstance(state, dict) else None
    if not isinstance(base, list) or not all(isinstance(s, dict) for s in base):
        raise _Damaged(path, "it holds no optimizer state per parameter group")
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
        raise _Damaged(path, f"its optimizer state {key!r} is not one flat fp32 tensor per group")
    return states


def _pieces(
    ds_dir: Path, groups: Groups, partitions: list[Path], inners: list[dict[str, Any]]
) -> dict[str, Pieces]:
    """Where each parameter's values lie in the partitions, which param_shapes must use up."""
    stage, count = inners[0].get("zero_stage"), inners[0].get("partition_count")
    count = max(count) if isinstance(count, list) and count else count
    if stage is None and partitions[0].name.startswith("bf16_zero"):  # (no damage: refused)
        raise UserError(
            f"{partitions[0]} is a state of DeepSpeed's BF16_Optimizer (bf16 under ZeRO-0/1 with "
            f"data_types.grad_accum_dtype set, a setting scale_llm refuses), which scale_llm "
            f"cannot read: resume from a checkpoint of another layout, or take the weights with "
            f"DeepSpeed's own tools (deepspeed.utils.zero_to_fp32)"
        )
    if not isinstance(stage, int) or stage not in (1, 2, 3):  # (an IntEnum in the file)
        raise _Damaged(partitions[0], f"zero_stage {stage!r} is not 1, 2 or 3")
    if count != len(partitions):
        saved = f"{len(partitions)} optimizer partitions of a save by {count!r} ranks"
        raise _Damaged(ds_dir, f"it holds {saved}")
    sizes = [  # the length of each rank's fp32 groups: [rank][group]
        [g.numel() for g in _fp32_groups(i, p)] for i, p in zip(inners, partitions, strict=True)
    ]
    held = sum(map(sum, sizes))  # no parameter holds more (nor could torch count it)
    for name, shape in ((n, s) for group in groups for n, s in group.items()):
        if (numel := math.prod(shape)) > held:
            lists = f"param_shapes lists {name!r} of {numel} values"
            raise _Damaged(ds_dir, f"its optimizer partitions hold {held} values, but {lists}")
    try:
        if stage == 3:
            return _zero3_pieces(groups, sizes)
        return _zero12_pieces(groups, sizes, _paddings(inners[0], partitions[0]))
    except _Layout as e:
        raise _Damaged(ds_dir, f"its optimizer partitions {e}") from None


def _paddings(inner: dict[str, Any], partition: Path) -> list[list[int]] | None:
    """The alignment padding after each parameter, per group (None: written without any)."""
    paddings = inner.get("param_alignment_paddings")
    if paddings is not None and not (
        isinstance(paddings, list)
        and all(isinstance(g, list) and all(type(n) is int and n >= 0 for n in g) for g in paddings)
    ):
        raise _Damaged(partition, "param_alignment_paddings is not a list of counts per group")
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
) -> dict[str, Pieces]:
    """ZeRO-1/2: group g's flat fp32 vector is the ranks' slices of group g end to end, its
    parameters in param_shapes order, each followed by its alignment padding."""
    if any(len(s) != len(groups) for s in sizes) or (
        paddings is not None and [len(p) for p in paddings] != [len(g) for g in groups]
    ):
        raise _Layout("hold other parameter groups than param_shapes lists")
    out = {}
    for g, group in enumerate(groups):
        offset, per_rank = 0, [s[g] for s in sizes]
        for i, (name, shape) in enumerate(group.items()):
            spans = _spans(per_rank, offset, shape.numel(), name)
            out[name] = [(rank, g, start, n) for rank, start, n in spans]
            offset += shape.numel() + (paddings[g][i] if paddings is not None else 0)
        used, held, world = offset, sum(per_rank), len(sizes)
        if paddings is None:  # (zero_to_fp32's check: both rounded up to DeepSpeed's alignment)
            used, held = (math.ceil(n / (2 * world)) * 2 * world for n in (used, held))
        if used != held:
            raise _Layout(f"hold {held} values in group {g}, param_shapes lists {used}")
    return out


def _zero3_pieces(groups: Groups, sizes: list[list[int]]) -> dict[str, Pieces]:
    """ZeRO-3: each rank holds ceil(numel / world) values of every parameter, end to end
    across its groups; the ranks' pieces in rank order, cut to numel, are the parameter."""
    world, offset, out = len(sizes), 0, {}
    for group in groups:
        for name, shape in group.items():
            share = math.ceil(shape.numel() / world)
            out[name] = [
                (rank, g, start, n)
                for rank, per_group in enumerate(sizes)
                for g, start, n in _spans(per_group, offset, share, name)
            ]
            offset += share
    for rank, per_group in enumerate(sizes):  # (every rank holds `offset` values)
        if (held := sum(per_group)) != offset:
            raise _Layout(f"of rank {rank} hold {held} values, param_shapes lists {offset}")
    return out


def _shape_differences(found: Mapping[str, torch.Size], want: Mapping[str, torch.Size]) -> str:
    """The first difference between a checkpoint's tensors and the model's, or ''."""
    if missing := [n for n in want if n not in found]:
        return f"it holds no {missing[0]!r}"
    if extra := [n for n in found if n not in want]:
        return f"it holds {extra[0]!r}, which the model has not"
    bad = next((n for n in want if tuple(found[n]) != tuple(want[n])), None)
    return f"its {bad!r} is {tuple(found[bad])}, not {tuple(want[bad])}" if bad else ""
