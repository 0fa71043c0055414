"""The DeepSpeed checkpoint reader (components/zero_weights.py) against partitions laid out here
by hand in DeepSpeed 0.19.8's file format: 3 ranks, odd sizes, two parameter groups, so that
ZeRO-1/2's alignment paddings and shortened last slices and ZeRO-3's ceil padding all occur."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
import torch

from scale_llm.components.serialization import DamagedCheckpoint
from scale_llm.components.zero_weights import ZeroWeights

WORLD = 3
GROUPS = [  # two parameter groups (decayed, not), odd sizes
    {"embed.weight": (7, 5), "layers.0.w": (3, 3), "layers.0.b": (5,)},
    {"norm.weight": (11,), "head.bias": (1,), "layers.1.w": (2, 7)},
]
KEYS = (None, "exp_avg", "exp_avg_sq")  # the fp32 weights, then Adam's moments
PAD = 1e9  # in every padding slot: a value read from one shows at once


def values(numel: int) -> dict[str | None, torch.Tensor]:
    """Each key's distinct values of one parameter (flat)."""
    start = values.next
    values.next += 3 * numel
    return {
        key: torch.arange(start + i * numel, start + (i + 1) * numel).float()
        for i, key in enumerate(KEYS)
    }


def laid_out(shapes: list[dict[str, tuple[int, ...]]]) -> dict[str, dict[str | None, torch.Tensor]]:
    values.next = 1
    return {name: values(math.prod(s)) for group in shapes for name, s in group.items()}


def _model_states(stage: int, ds: Path, want: dict, shapes: list) -> None:
    """Rank 0's model states (ZeRO-3: every rank's) as DeepSpeed's engine writes them."""
    module = {n: want[n][None].view(s).bfloat16() for g in shapes for n, s in g.items()}
    state = {
        "module": module,
        "buffer_names": [],
        "param_shapes": [{n: torch.Size(s) for n, s in g.items()} for g in shapes],
        "frozen_param_shapes": None,
        "shared_params": {},
        "frozen_param_fragments": None,
        "ds_version": "0.19.8",
        "global_steps": 4,
        "dp_world_size": WORLD,
    }
    if stage < 3:
        torch.save(state, ds / "mp_rank_00_model_states.pt")
        return
    for rank in range(WORLD):
        torch.save(state, ds / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")


def _adam(flats: list[dict[str | None, torch.Tensor]]) -> dict:
    """torch AdamW's state_dict over one flat partition per group."""
    state = {
        g: {"step": torch.tensor(4.0), "exp_avg": f["exp_avg"], "exp_avg_sq": f["exp_avg_sq"]}
        for g, f in enumerate(flats)
    }
    groups = [{"lr": 1e-3, "weight_decay": 0.1 * (1 - g), "params": [g]} for g in range(len(flats))]
    return {"state": state, "param_groups": groups}


def write_zero2(ds: Path, shapes: list = GROUPS) -> dict:
    """ZeRO-2 (stage_1_and_2.py): each group's parameters end to end, each but the last padded
    to 8 values (16 bytes of bf16), the group padded to 2 * world and cut in `world` equal
    slices; the saved fp32 slice drops the group's end padding (the last ranks' slices are
    shorter), the moments keep it (a torch state_dict, not elastic)."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    want = laid_out(shapes)
    per_rank = [[] for _ in range(WORLD)]
    param_pads, group_pads = [], [[] for _ in range(WORLD)]
    for group in shapes:
        flat, pads = {k: [] for k in KEYS}, []
        for i, name in enumerate(group):
            n = len(want[name][None])
            offset = sum(len(t) for t in flat[None]) + n
            pads.append(0 if i == len(group) - 1 else -offset % 8)
            for key in KEYS:
                flat[key] += [want[name][key], torch.full((pads[-1],), PAD)]
        param_pads.append(pads)
        used = sum(len(t) for t in flat[None])
        size = math.ceil(used / (2 * WORLD)) * 2 * WORLD // WORLD
        for key in KEYS:
            whole = torch.cat([*flat[key], torch.full((size * WORLD - used,), PAD)])
            for rank in range(WORLD):
                if key is None:
                    pad = min(size, max(0, (rank + 1) * size - used))
                    group_pads[rank].append(pad)
                    per_rank[rank].append({None: whole[rank * size : (rank + 1) * size - pad]})
                else:
                    per_rank[rank][-1][key] = whole[rank * size : (rank + 1) * size].clone()
    _model_states(2, ds, want, shapes)
    for rank, flats in enumerate(per_rank):
        inner = {
            "loss_scaler": None,
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": 1.0,
            "base_optimizer_state": _adam(flats),
            "single_partition_of_fp32_groups": [f[None].clone() for f in flats],
            "zero_stage": ZeroStageEnum.gradients,
            "group_paddings": group_pads[rank],
            "param_alignment_paddings": param_pads,
            "partition_count": [WORLD] * len(shapes),
            "ds_version": "0.19.8",
            "param_slice_mappings": [],
        }
        name = f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        torch.save({"optimizer_state_dict": inner, "ds_version": "0.19.8"}, ds / name)
    return want


def write_zero3(ds: Path, shapes: list = GROUPS) -> dict:
    """ZeRO-3 (stage3.py): rank r holds values [r * s, (r + 1) * s) of every parameter, s =
    ceil(numel / world), the end zero-padded, its parameters end to end per group; the moments
    lie beside (a torch state_dict under `optimizer_state_dict`)."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    want = laid_out(shapes)
    for rank in range(WORLD):
        flats = []
        for group in shapes:
            flat = {}
            for key in KEYS:
                pieces = []
                for name in group:
                    full = want[name][key]
                    share = math.ceil(len(full) / WORLD)
                    padded = torch.cat([full, torch.zeros(share * WORLD - len(full))])
                    pieces.append(padded[rank * share : (rank + 1) * share])
                flat[key] = torch.cat(pieces)
            flats.append(flat)
        inner = {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": None,
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": WORLD,
            "optimizer_state_dict": _adam(flats),
            "fp32_flat_groups": [f[None] for f in flats],
        }
        name = f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        torch.save({"optimizer_state_dict": inner, "ds_version": "0.19.8"}, ds / name)
    _model_states(3, ds, want, shapes)
    return want


WRITERS = {2: write_zero2, 3: write_zero3}


@pytest.mark.parametrize("stage", [2, 3])
def test_every_tensor_and_moment_is_the_one_laid_out(stage, tmp_path):
    want = WRITERS[stage](tmp_path)
    zero = ZeroWeights(tmp_path)
    assert list(zero) == [n for g in GROUPS for n in g]
    for name, shape in ((n, s) for g in GROUPS for n, s in g.items()):
        assert torch.equal(zero[name], want[name][None].view(shape)), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(zero.read(name, key), want[name][key].view(shape)), (name, key)
    assert zero.optimizer_step() == 4
    zero.check_optimizer_state()


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_own_consolidation_reads_the_same_weights(stage, tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    (tmp_path / "deepspeed").mkdir()
    WRITERS[stage](tmp_path / "deepspeed")
    theirs = get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="deepspeed")
    ours = ZeroWeights(tmp_path / "deepspeed")
    assert sorted(theirs) == sorted(ours)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_reading_opens_each_file_once(tmp_path, monkeypatch):
    from scale_llm.components import zero_weights

    write_zero3(tmp_path)
    opened = []
    real = zero_weights.load_file
    monkeypatch.setattr(
        zero_weights, "load_file", lambda p, **kw: opened.append(p) or real(p, **kw)
    )
    zero = ZeroWeights(tmp_path)
    for name in zero:
        for key in KEYS:
            zero.read(name, key)
    zero.check_optimizer_state()
    assert sorted(opened) == sorted(set(opened)) and len(opened) == WORLD + 1


def _rewrite(path: Path, change) -> None:
    from scale_llm.components.serialization import deepspeed_safe_globals

    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


def _shape(group: int, name: str, shape: tuple[int, ...]):
    def change(state: dict) -> None:
        state["param_shapes"][group][name] = shape

    return change


def _shared(alias: str, name: str):
    def change(state: dict) -> None:
        state["shared_params"] = {alias: name}

    return change


@pytest.mark.parametrize(
    ("stage", "change", "said"),
    [
        (2, _shape(0, "embed.weight", (10**30,)), "param_shapes is not a list of {name: shape}"),
        (2, _shape(0, "embed.weight", (2**47, 2**17)), f"lists 'embed.weight' of {2**64} values"),
        (3, _shape(0, "embed.weight", (2**40, 2**20)), f"lists 'embed.weight' of {2**60} values"),
        # the group's last parameter shorter: values are left over
        (2, _shape(1, "layers.1.w", (2, 6)), "hold 38 values in group 1, param_shapes lists 36"),
        (3, _shape(1, "layers.1.w", (2, 6)), "of rank 0 hold 27 values, param_shapes lists 26"),
        # a parameter of its own sent to another of its shape: read as that one's, silently
        (2, _shared("layers.0.w", "layers.1.w"), "sends parameter 'layers.0.w' to 'layers.1.w'"),
    ],
    ids=[
        "dimension",
        "2**64 values",
        "zero3 2**60 values",
        "zero2 left over",
        "zero3 left over",
        "shared onto a parameter",
    ],
)
def test_param_shapes_that_do_not_use_the_partitions_up_are_refused(stage, change, said, tmp_path):
    WRITERS[stage](tmp_path)
    model = "mp_rank_00" if stage < 3 else "zero_pp_rank_0_mp_rank_00"
    _rewrite(tmp_path / f"{model}_model_states.pt", change)
    with pytest.raises(DamagedCheckpoint) as e:
        ZeroWeights(tmp_path)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_two_partition_files_of_one_rank_are_refused(tmp_path):
    write_zero2(tmp_path)
    bf16 = tmp_path / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(bf16.read_bytes())
    with pytest.raises(DamagedCheckpoint, match="rank 1 has two optimizer partitions") as e:
        ZeroWeights(tmp_path)
    assert bf16.name in str(e.value) and "zero_pp_rank_1_mp_rank_00_optim" in str(e.value)


def read_everything(ds: Path) -> float:
    """Seconds to read every tensor and moment of the checkpoint in `ds`."""
    start = time.perf_counter()
    zero = ZeroWeights(ds)
    for name in zero:
        for key in KEYS:
            zero.read(name, key)
    return time.perf_counter() - start


if __name__ == "__main__":  # the timing the commit message quotes: 3 ranks, 2 x 120 parameters
    import sys
    import tempfile

    shapes = [{f"g{g}.p{i}": (17, 9 + i) for i in range(120)} for g in range(2)]
    for stage, write in WRITERS.items():
        with tempfile.TemporaryDirectory() as tmp:
            write(Path(tmp), shapes)
            seconds = min(read_everything(Path(tmp)) for _ in range(3))
            print(f"ZeRO-{stage}: {seconds:.3f} s", file=sys.stdout)
    os._exit(0)


def test_a_bf16_optimizers_state_is_refused_as_deepspeeds_own_not_as_damage(tmp_path):
    """bf16 ZeRO-1 with data_types.grad_accum_dtype fp32 (a setting the config refuses) saved
    DeepSpeed's BF16_Optimizer state, which has no zero_stage: convert and the other readers
    called it damaged, with the advice to delete the checkpoint."""
    from scale_llm.components import zero_weights
    from scale_llm.errors import UserError

    partition = tmp_path / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with pytest.raises(UserError, match="a state of DeepSpeed's BF16_Optimizer") as info:
        zero_weights._pieces(tmp_path, [], [partition], [{"partition_count": 1}])
    assert not isinstance(info.value, DamagedCheckpoint) and "delete" not in str(info.value)
    other = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"  # (no stage: damage)
    with pytest.raises(zero_weights._Damaged, match="zero_stage None is not 1, 2 or 3"):
        zero_weights._pieces(tmp_path, [], [other], [{"partition_count": 1}])
