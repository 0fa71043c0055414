"""The DeepSpeed config, generated in one place from the same YAML keys every backend reads, plus
the raw entries of `parallel.deepspeed.config` (config/parallel.py refuses contradicting ones and
sections outside its PASSTHROUGH)."""

from __future__ import annotations

import copy
import importlib.util
import os
from typing import Any

from scale_llm.components.distributed import deepspeed_on
from scale_llm.config import Config, deep_merge
from scale_llm.config.plan import RunPlan
from scale_llm.errors import UserError


def deepspeed_config(cfg: Config, plan: RunPlan) -> dict[str, Any]:
    """The ds_config dict for this run (batch layout and precision from the plan)."""
    t, ds, precision = cfg.train, cfg.parallel.deepspeed, plan.precision
    zero: dict[str, Any] = {
        "stage": ds.zero_stage,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 5e7,
    }
    for offload in ("offload_optimizer", "offload_param"):
        if getattr(ds, offload) == "cpu":
            zero[offload] = {"device": "cpu", "pin_memory": True}
    generated: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "train_batch_size": plan.sequences_per_step,
        "gradient_clipping": t.grad_clip,
        "bf16": {"enabled": precision == "bf16"},
        # dynamic loss scaling, the same policy as torch.amp.GradScaler's defaults
        "fp16": {
            "enabled": precision == "fp16",
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 2000,
            "hysteresis": 1,
            "min_loss_scale": 1,
        },
        "zero_optimization": zero,
        # the framework passes a torch AdamW; ZeRO handles any torch optimizer correctly
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,  # the framework logs; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
    }
    offloaded_zero2 = ds.zero_stage == 2 and ds.offload_optimizer == "cpu"
    if precision == "fp16" and offloaded_zero2 and plan.grad_accum > 1:
        generated["data_types"] = {"grad_accum_dtype": "fp32"}  # (the offload reason below)
    if precision == "bf16" and ds.zero_stage >= 1:
        # gradients reduced in fp32 as FSDP2's are (DeepSpeed's bf16 default: bf16), and under
        # ZeRO-2/3 summed over micro-steps in fp32 too (with offload: one copy to the host a
        # step, not 16-bit round trips per micro-step); ZeRO-0/1 have no such path
        generated["communication_data_type"] = "fp32"
        if ds.zero_stage >= 2:
            generated["data_types"] = {"grad_accum_dtype": "fp32"}
    return copy.deepcopy(deep_merge(generated, ds.config or {}))


def check_zero_settings(cfg: Config, plan: RunPlan) -> None:
    """DeepSpeed's own models judge zero_optimization and comms_logger as the run hands them
    over, before any work: an unknown or mistyped entry of parallel.deepspeed.config is named
    with DeepSpeed's words."""
    if plan.backend != "deepspeed" or importlib.util.find_spec("deepspeed") is None:
        return  # (a missing deepspeed is named where the backend is built)
    deepspeed_on(plan.device)
    try:  # (DeepSpeed picks its accelerator on import: DS_ACCELERATOR, where set, by name)
        from deepspeed.comm.config import CommsLoggerConfig
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ValueError as e:  # (an unknown name, or one whose package is missing: mps, npu)
        if "DS_ACCELERATOR" not in str(e) and "Accelerator requires" not in str(e):
            raise
        raise UserError(
            f"DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR', '')[:60]}: DeepSpeed refuses it "
            f"({' '.join(str(e).split())[:300]}); set one it can use on this machine, or unset "
            f"it and DeepSpeed picks the machine's"
        ) from None
    from pydantic import ValidationError

    merged = deepspeed_config(cfg, plan)
    for section, model in (
        ("zero_optimization", DeepSpeedZeroConfig),
        ("comms_logger", CommsLoggerConfig),
    ):
        try:
            model(**merged.get(section, {}))
        except (ValidationError, AssertionError, TypeError, ValueError) as e:
            said = (str(e).splitlines() or [type(e).__name__])[0]
            if isinstance(e, ValidationError):
                said = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise UserError(
                f"parallel.deepspeed.config.{section}: DeepSpeed refuses it ({said}); fix or "
                f"remove those entries"
            ) from None
