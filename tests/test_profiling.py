"""train.profile: a CPU run traces the configured steps to a Chrome-trace JSON without changing
the loss curve; a memory snapshot (CUDA only) is refused on the CPU before any work."""

from __future__ import annotations

import json
import os

import pytest

from scale_llm.config.profile import ProfileConfig
from scale_llm.errors import UserError
from tests.helpers import make_config, trainer_for


def test_profiled_run_writes_the_traced_step_and_keeps_the_loss_curve(data_dir, tmp_path):
    plain = make_config(data_dir, tmp_path, "run.name=plain", "train.max_steps=3")
    traced = make_config(
        data_dir,
        tmp_path,
        "train.max_steps=3",
        "train.profile.enabled=true",
        "train.profile.start_step=3",
        "train.profile.warmup_steps=1",
        "train.profile.active_steps=1",
    )
    expected = trainer_for(plain).fit().losses
    assert trainer_for(traced).fit().losses == expected

    folder = traced.run_dir / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_steps3-3.pt.trace.json"]
    events = json.loads((folder / "rank0_steps3-3.pt.trace.json").read_text())["traceEvents"]
    steps = [e for e in events if str(e.get("name", "")).startswith("scale_llm step")]
    assert [e["name"] for e in steps] == ["scale_llm step 3"]  # not the warm-up's step 2
    start, end = steps[0]["ts"], steps[0]["ts"] + steps[0]["dur"]
    inside = {e["name"] for e in events if e.get("ph") == "X" and start <= e["ts"] <= end}
    assert {"aten::mm", "Optimizer.step#AdamW.step"} & inside, sorted(inside)[:20]
    assert not (plain.run_dir / "profile").exists()


def test_memory_snapshot_on_a_cpu_run_is_refused_before_any_work(data_dir, tmp_path):
    cfg = make_config(data_dir, tmp_path, "train.profile.memory_snapshot_step=2")
    # with the launch's checks, among the config's problems, before the trainer exists
    with pytest.raises(UserError, match=r"memory_snapshot_step=2: .* will not use a GPU; run on"):
        trainer_for(cfg)
    assert not cfg.run_dir.exists()


def test_profiling_settings_do_not_make_another_experiment(data_dir, tmp_path):
    """A finished run relaunched to trace it is the same run (resume compares what it trains)."""
    from scale_llm.config import to_dict
    from scale_llm.train.resume import changed_settings

    before = make_config(data_dir, tmp_path)
    after = make_config(
        data_dir, tmp_path, "train.profile.enabled=true", "train.profile.start_step=2"
    )
    assert changed_settings({"config": to_dict(before)}, after) == []
    assert changed_settings(
        {"config": to_dict(before)}, make_config(data_dir, tmp_path, "train.lr=0.5")
    )


def test_the_profile_folder_may_not_be_a_name_the_run_dir_uses():
    from scale_llm.config.profile import RUN_DIR_NAMES, validate_profile
    from scale_llm.files import OWNER_MARKER
    from scale_llm.train import preflight

    run_marks = (preflight.LOCK, OWNER_MARKER)
    for name in (*preflight.RUN_DIR_FOLDERS, *preflight.RUN_DIR_FILES, *run_marks):
        assert name in RUN_DIR_NAMES, name
    for folder in ("metrics.jsonl", "config.yaml", ".lock", "checkpoints/x", ".eval-tasks-1"):
        p = ProfileConfig(enabled=True, start_step=2, folder=folder)
        assert any("train.profile.folder" in m for m in validate_profile(p, 4)), folder
    assert validate_profile(ProfileConfig(enabled=True, start_step=2, folder="prof"), 4) == []


def test_a_stop_inside_the_traced_steps_writes_the_steps_that_ran(data_dir, tmp_path, logs):
    """Stopped at step 4 of traced steps 3-5: the trace was named steps3-5 and held an empty
    `scale_llm step 5`; a resume past the warm-up named the wrong step."""
    profile = [
        "train.profile.enabled=true",
        "train.profile.start_step=3",
        "train.profile.warmup_steps=1",
        "train.profile.active_steps=3",
    ]
    cfg = make_config(data_dir, tmp_path, "train.max_steps=6", "train.exit_at_step=4", *profile)
    trainer_for(cfg).fit()
    folder = cfg.run_dir / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_steps3-4.pt.trace.json"]
    events = json.loads((folder / "rank0_steps3-4.pt.trace.json").read_text())["traceEvents"]
    names = {str(e.get("name")) for e in events if str(e.get("name")).startswith("scale_llm")}
    assert names == {"scale_llm step 3", "scale_llm step 4"}

    again = make_config(data_dir, tmp_path, "train.max_steps=6", *profile)
    trainer_for(again).fit()  # resumed at step 4: past the warm-up's step 2
    said = [line for line in logs if "not traced" in line]
    assert said == [
        "train.profile: not traced: this launch starts after step 4, and the profiler's "
        "warm-up begins at step 2 (set train.profile.start_step above 5 to trace this launch)"
    ]
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_steps3-4.pt.trace.json"]


def test_a_trace_never_replaces_a_file_of_that_name(tmp_path, monkeypatch):
    """The profile folder may link to a folder of the user's, and a relaunch may trace the same
    steps again: a file named like the trace is kept, the trace written beside it."""
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    from scale_llm.train.profiling import StepProfiler

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "rank0_steps3-3.pt.trace.json").write_text("the user's")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "profile").symlink_to(mine)
    plan = SimpleNamespace(rank=0, device=torch.device("cpu"))
    profiler = StepProfiler(ProfileConfig(enabled=True), plan, tmp_path / "run", start_step=0)

    def no_links(source, target):
        raise PermissionError(1, "Operation not permitted")

    for trace in ("a trace", "the same steps traced again"):
        path = profiler._write(
            "rank0_steps3-3.pt.trace.json", lambda t, s=trace: Path(t).write_text(s)
        )
        assert path.read_text() == trace
        assert path.parent == tmp_path / "run" / "profile"
        assert path.name.startswith("rank0_steps3-3-") and path.name.endswith(".pt.trace.json")
        monkeypatch.setattr(os, "link", no_links)  # the second: a file system without links
    assert (mine / "rank0_steps3-3.pt.trace.json").read_text() == "the user's"
    assert len(list(mine.iterdir())) == 3
