"""Checkpoints are read through allow-lists: good checkpoints still load with them, and
DeepSpeed's own reader is swapped for one. (A pickle planted in any file a checkpoint holds,
refused by every command, and a DCP metadata that points outside its checkpoint:
tests/test_errors.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scale_llm.cli import main
from scale_llm.components.serialization import (
    UnsafeCheckpoint,
    guard_deepspeed_reader,
    read_dcp_metadata,
)
from tests.helpers import Payload, finished_run


@pytest.fixture(scope="module")
def good_run(data_dir, tmp_path_factory) -> Path:
    """A finished 2-step single-process run with its checkpoint at step 2."""
    return finished_run(
        data_dir, tmp_path_factory.mktemp("security"), "train.max_steps=2", "checkpoint.every=2"
    )


def ckpt_of(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "step_00000002"


def cli(command: str, run_dir: Path, tmp_path: Path) -> list[str]:
    if command == "generate":
        return ["generate", str(run_dir), "--max-new-tokens", "2", "--prompt", "def"]
    return ["convert", str(run_dir), "--out", str(tmp_path / "out.pt")]


def test_good_checkpoints_still_load(good_run, tmp_path, capsys):
    assert main(cli("convert", good_run, tmp_path)) == 0
    assert main(cli("generate", good_run, tmp_path)) == 0
    md = read_dcp_metadata(ckpt_of(good_run) / "dcp" / ".metadata")
    assert "model.tok_embeddings.weight" in md.state_dict_metadata


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
