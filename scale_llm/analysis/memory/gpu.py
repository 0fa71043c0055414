"""The per-GPU estimate of a run: its one layout's (estimate.py), or under pipeline parallelism
its worst pipeline rank's (pipeline.py)."""

from __future__ import annotations

from scale_llm.analysis.memory.estimate import Estimate, estimate_layout, layout_of
from scale_llm.analysis.memory.pipeline import pipeline_estimate
from scale_llm.config import Config
from scale_llm.config.plan import RunPlan, target_plan


def estimate(cfg: Config, target: RunPlan | int) -> Estimate:
    """Per-GPU bytes of `cfg` run as `target`: a plan, or a world size of bf16 GPUs."""
    plan = target_plan(cfg, target) if isinstance(target, int) else target
    if plan.pp_degree > 1:
        return pipeline_estimate(cfg, plan, layout_of(cfg, plan))
    return estimate_layout(cfg.model, cfg.activation_checkpointing, layout_of(cfg, plan))
