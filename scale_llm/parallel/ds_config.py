"""The DeepSpeed config, generated in one place from the same YAML keys every backend reads.

`train.micro_batch_size`, `train.grad_accum`, `train.grad_clip` and `train.precision` mean the
same thing under DeepSpeed as elsewhere; `parallel.deepspeed.*` picks the ZeRO stage and offload.
Experts may add raw entries in `parallel.deepspeed.config`; entries that would contradict the
framework's own keys are refused, naming the key to use instead.
"""

from __future__ import annotations

import copy
from typing import Any

from scale_llm.config import Config, deep_merge

# ds_config entries the framework owns -> the YAML key that sets them
OWNED = {
    "train_batch_size": "train.micro_batch_size x train.grad_accum x world size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "gradient_clipping": "train.grad_clip",
    "bf16": "train.precision",
    "fp16": "train.precision",
    "optimizer": "train.lr / train.weight_decay / train.beta1 / train.beta2 (the framework "
    "builds AdamW and sets the LR each step)",
    "scheduler": "train.warmup_steps / train.min_lr (the framework sets the LR each step)",
    "zero_optimization.stage": "parallel.deepspeed.zero_stage",
    "zero_optimization.offload_optimizer": "parallel.deepspeed.offload_optimizer",
    "zero_optimization.offload_param": "parallel.deepspeed.offload_param",
}


def passthrough_problems(raw: dict[str, Any]) -> list[str]:
    problems = []
    for key, instead in OWNED.items():
        head, _, tail = key.partition(".")
        present = head in raw and (not tail or (isinstance(raw[head], dict) and tail in raw[head]))
        if present:
            problems.append(f"parallel.deepspeed.config.{key}: set by {instead}; remove it here")
    return problems


def deepspeed_config(cfg: Config, world_size: int, precision: str) -> dict[str, Any]:
    """The ds_config dict; `precision` is the resolved one (bf16 | fp16 | fp32, never auto)."""
    t, ds = cfg.train, cfg.parallel.deepspeed
    zero: dict[str, Any] = {
        "stage": ds.zero_stage,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 5e7,
    }
    if ds.zero_stage == 3:
        # gather full weights when DeepSpeed saves, so consolidated weights can be written
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if ds.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if ds.offload_param == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    generated: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world_size,
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
    return copy.deepcopy(deep_merge(generated, ds.config or {}))
