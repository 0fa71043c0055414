"""The `train.profile` config section (which steps to trace, the CUDA memory snapshot) and its
checks; the loop's profiler (scale_llm.train.profiling) reads it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from scale_llm.config.schema import bound_problems, config_key

# RUN_DIR's own names (train/preflight.py's, held to this list by tests/test_profiling.py) and
# the prefix of eval.tasks' scratch exports: the profile folder may not be one of them
RUN_DIR_NAMES = (
    *("checkpoints", "tensorboard", "wandb", ".wandb", "eval", "export", "comm_trace"),
    *("config.yaml", "plan.json", "tokenizer.model", "hf-tokenizer.json", "ds_config.json"),
    *("metrics.jsonl", "wandb-id.txt", ".lock", ".scale-llm-owner.json"),
)
SCRATCH_PREFIX = ".eval-tasks-"


@dataclass
class ProfileConfig:
    enabled: bool = config_key(
        False,
        "trace the steps start_step .. start_step + active_steps - 1 with `torch.profiler` "
        "(CPU ops, and CUDA kernels on a GPU; shapes and memory recorded): one Chrome-trace JSON "
        "per rank in `RUN_DIR/<folder>/`, for Perfetto (ui.perfetto.dev), chrome://tracing or "
        "TensorBoard's profiler tab. See [training.md](training.md)",
    )
    start_step: int = config_key(5, "the first traced optimizer step (1 is the first)")
    warmup_steps: int = config_key(
        1,
        "steps just before start_step that the profiler runs but discards (the first steps "
        "it sees carry its own start-up cost)",
    )
    active_steps: int = config_key(2, "optimizer steps traced, from start_step on")
    folder: str = config_key(
        "profile", "where traces and memory snapshots go, relative to the run dir"
    )
    memory_snapshot_step: int | None = config_key(
        None,
        "a GPU run records the CUDA caching allocator's history "
        "(`torch.cuda.memory._record_memory_history`) from its start and writes a snapshot "
        "after this optimizer step: `RUN_DIR/<folder>/memory_snapshot_rank<R>_step<N>.pickle`, "
        "for pytorch.org/memory_viz; a CPU run refuses it (no CUDA allocator); null: none",
    )


def validate_profile(p: ProfileConfig, max_steps: int) -> list[str]:
    """What is wrong with train.profile, each message naming its key and the fix."""
    e, key = [], "train.profile"
    if p.enabled:
        e += bound_problems(p, "warmup_steps", ">= 0", f"{key}.")
        e += bound_problems(p, "active_steps", ">= 1 (steps traced)", f"{key}.")
        if p.start_step - max(p.warmup_steps, 0) < 1:
            e.append(
                f"{key}.start_step={p.start_step} leaves no room for {key}.warmup_steps="
                f"{p.warmup_steps} before it (steps count from 1); e.g. {key}.start_step="
                f"{max(p.warmup_steps, 0) + 1}"
            )
        if (last := p.start_step + max(p.active_steps, 1) - 1) > max_steps > 0:
            e.append(
                f"{key}: the traced steps end at step {last}, after train.max_steps="
                f"{max_steps}; lower {key}.start_step or {key}.active_steps"
            )
    if (step := p.memory_snapshot_step) is not None and not 1 <= step <= max(max_steps, 1):
        e.append(
            f"{key}.memory_snapshot_step={step} must lie in [1, train.max_steps={max_steps}] "
            f"(the optimizer step after which the snapshot is written), or null"
        )
    path = PurePath(p.folder)
    if not p.folder.strip() or not path.parts or path.is_absolute() or ".." in path.parts:
        e.append(
            f"{key}.folder={p.folder!r} must be a folder inside the run dir (a relative path "
            f"without '..'), e.g. {key}.folder=profile"
        )
    elif path.parts[0] in RUN_DIR_NAMES or path.parts[0].startswith(SCRATCH_PREFIX):
        e.append(
            f"{key}.folder={p.folder!r} is (inside) the run dir's own {path.parts[0]}; pick "
            f"another name, e.g. {key}.folder=profile"
        )
    return e
