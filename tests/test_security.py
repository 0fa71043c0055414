"""Hostile checkpoints: a pickle planted in any file a checkpoint holds never runs.

Each case copies a good checkpoint, plants a payload (`__reduce__` -> `os.system("touch ...")`)
in one file, and runs `generate`, `convert` or a resumed `train` on it: exit 2, an error naming
the file, no traceback, and the marker file never appears.
"""

from __future__ import annotations

import operator
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from scale_llm.cli import main
from scale_llm.components.checkpoint import write_integrity
from scale_llm.components.serialization import (
    DamagedCheckpoint,
    UnsafeCheckpoint,
    guard_deepspeed_reader,
    load_file,
    read_dcp_metadata,
)
from tests.helpers import Payload, finished_run, plant_in_torch_file


class Disguised:
    """Runs the command, then hands back the real object: a reader that unpickled it would
    finish normally (exit 0) and nobody would notice."""

    def __init__(self, marker: Path, real: object):
        self.marker, self.real = marker, real

    def __reduce__(self):
        return (operator.getitem, ((Payload(self.marker), self.real), 1))


@pytest.fixture(scope="module")
def good_run(data_dir, tmp_path_factory) -> Path:
    """A finished 2-step single-process run with its checkpoint at step 2."""
    return finished_run(
        data_dir, tmp_path_factory.mktemp("security"), "train.max_steps=2", "checkpoint.every=2"
    )


@pytest.fixture()
def run_copy(good_run, tmp_path) -> Path:
    dst = tmp_path / "runs" / "test"
    shutil.copytree(good_run, dst)
    return dst


def ckpt_of(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "step_00000002"


def plant_in_dcp_metadata(ckpt: Path, marker: Path) -> Path:
    target = ckpt / "dcp" / ".metadata"
    target.write_bytes(pickle.dumps(Payload(marker)))
    return target


def plant_disguised_dcp_metadata(ckpt: Path, marker: Path) -> Path:
    target = ckpt / "dcp" / ".metadata"
    real = pickle.loads(target.read_bytes())  # our own good file: trusted in this test
    target.write_bytes(pickle.dumps(Disguised(marker, real)))
    return target


def plant_in_dcp_byte_item(ckpt: Path, marker: Path) -> Path:
    """Rewrite the DCP checkpoint with one optimizer hyperparameter (a byte item) replaced by a
    payload."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = ckpt.parent / "flat.pt"
    dcp_to_torch_save(ckpt / "dcp", flat)  # our own good file: trusted in this test
    state = torch.load(flat, weights_only=False)
    flat.unlink()
    state["optimizer"]["param_groups"][0]["weight_decay"] = Payload(marker)
    shutil.rmtree(ckpt / "dcp")
    dcp.save(state, checkpoint_id=ckpt / "dcp", no_dist=True)
    return ckpt / "dcp"


def plant_legacy_scaler(ckpt: Path, marker: Path) -> Path:
    """Checkpoints written before the scaler moved into trainer.pt keep it in scaler.pt."""
    torch.save({"scaler": {}, "planted": Payload(marker)}, ckpt / "scaler.pt")
    return ckpt / "scaler.pt"


def weights_as_model_pt(ckpt: Path, marker: Path) -> Path:
    """A checkpoint in DeepSpeed's layout (consolidated model.pt, no dcp/) with a payload."""
    from scale_llm.components.checkpoint import load_model_weights
    from scale_llm.config import load_config
    from scale_llm.model import empty_state_dict

    cfg = load_config(ckpt.parents[1] / "config.yaml")
    weights = load_model_weights(ckpt, empty_state_dict(cfg.model))
    shutil.rmtree(ckpt / "dcp")
    weights["planted"] = Payload(marker)
    torch.save(weights, ckpt / "model.pt")
    return ckpt / "model.pt"


def cli(command: str, run_dir: Path, data_dir: Path, tmp_path: Path) -> list[str]:
    if command == "generate":
        return ["generate", str(run_dir), "--max-new-tokens", "2", "--prompt", "def"]
    if command == "convert":
        return ["convert", str(run_dir), "--out", str(tmp_path / "out.pt")]
    cfg = [
        "model.vocab_size=512",
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.seq_len=32",
        f"data.dir={data_dir}",
        f"run.dir={run_dir.parent}",
        "run.name=test",
        "train.micro_batch_size=4",
        "train.max_steps=3",
        "train.warmup_steps=1",
        "train.precision=fp32",
        "train.device=cpu",
        "logging.tensorboard=false",
        "eval.every=0",
        "checkpoint.every=0",
    ]
    return ["train", *[a for s in cfg for a in ("--set", s)]]


PLANTS = {
    "dcp-metadata": (plant_in_dcp_metadata, ["generate", "convert", "train"]),
    "dcp-metadata-disguised": (plant_disguised_dcp_metadata, ["generate", "train"]),
    "dcp-byte-item": (plant_in_dcp_byte_item, ["train"]),
    "trainer-state": (
        lambda ckpt, m: plant_in_torch_file(ckpt / "trainer.pt", m),
        ["convert", "train"],
    ),
    "legacy-scaler": (plant_legacy_scaler, ["train"]),
    "model-weights": (weights_as_model_pt, ["generate", "convert"]),
}
CASES = [(plant, cmd) for plant, (_, cmds) in PLANTS.items() for cmd in cmds]


@pytest.mark.parametrize(("plant", "command"), CASES, ids=[f"{p}-{c}" for p, c in CASES])
def test_a_planted_pickle_never_runs(
    plant, command, run_copy, data_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    target = PLANTS[plant][0](ckpt_of(run_copy), marker)
    write_integrity(ckpt_of(run_copy))  # the attacker rewrites the checksums too: they are no
    # signature, so the allow-lists are what stops the payload
    code = main(cli(command, run_copy, data_dir, tmp_path))
    err = capsys.readouterr().err
    assert not marker.exists(), "the planted code ran"
    assert code == 2, err
    assert err.startswith("error: refusing to load") and str(target) in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "out.pt").exists()


def test_good_checkpoints_still_load(good_run, data_dir, tmp_path, capsys):
    assert main(cli("convert", good_run, data_dir, tmp_path)) == 0
    assert main(cli("generate", good_run, data_dir, tmp_path)) == 0
    md = read_dcp_metadata(ckpt_of(good_run) / "dcp" / ".metadata")
    assert "model.tok_embeddings.weight" in md.state_dict_metadata


def test_metadata_pointing_outside_the_checkpoint_is_refused(run_copy):
    path = ckpt_of(run_copy) / "dcp" / ".metadata"
    md = read_dcp_metadata(path)
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../../etc/passwd"
    path.write_bytes(pickle.dumps(md))
    with pytest.raises(DamagedCheckpoint, match="leaves the checkpoint"):
        read_dcp_metadata(path)


def test_deepspeed_files_are_read_weights_only(tmp_path):
    """DeepSpeed's own reader unpickles anything; the guard swaps it for the allow-list that
    admits DeepSpeed's loss scaler / ZeRO stage classes but not a payload."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    class Engine:
        checkpoint_engine = TorchCheckpointEngine()

    engine = Engine()
    guard_deepspeed_reader(engine)
    good = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    # DeepSpeed writes the legacy (non-zip) format
    torch.save(
        {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0), "w": torch.ones(2)},
        good,
        _use_new_zipfile_serialization=False,
    )
    state = engine.checkpoint_engine.load(str(good), map_location=lambda s, loc: s)
    assert state["zero_stage"] == ZeroStageEnum.gradients and state["w"].sum() == 2
    marker = tmp_path / "pwned"
    torch.save({"w": Payload(marker)}, good, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeCheckpoint, match="posix.system|os.system"):
        engine.checkpoint_engine.load(str(good), map_location="cpu")
    assert not marker.exists()


def test_torch_files_name_the_refused_global(tmp_path):
    path = tmp_path / "trainer.pt"
    torch.save({"x": Payload(tmp_path / "pwned")}, path)
    with pytest.raises(UnsafeCheckpoint, match=r"trainer\.pt.*system"):
        load_file(path)
    assert not (tmp_path / "pwned").exists()
