"""DeepSpeed ZeRO 0-3, with optional CPU offload; the engine owns backward, accumulation,
clipping and loss scaling (the trainer's micro-losses come divided already), and bf16 / fp16 are
its own modes (no autocast)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scale_llm.components.checkpoint import DEEPSPEED_DIR, CheckpointWeights
from scale_llm.components.optim import build_optimizer, param_groups, step_if_finite
from scale_llm.components.serialization import (
    BackgroundSave,
    guard_deepspeed_reader,
    hash_deepspeed_writes,
)
from scale_llm.model import Transformer, build_model
from scale_llm.parallel.activation_checkpointing import apply_activation_checkpointing
from scale_llm.parallel.backend import Backend
from scale_llm.parallel.ds_config import deepspeed_config

log = logging.getLogger(__name__)
TAG = DEEPSPEED_DIR  # the engine's checkpoint folder inside each step_XXXXXXXX directory


@contextlib.contextmanager
def _step_only_if_finite(optimizer: torch.optim.Optimizer, norm: torch.Tensor) -> Iterator[None]:
    """For the engine's step inside: `optimizer.step()` steps only when `norm` is finite."""
    own = vars(optimizer).get("step")  # a step the instance already had (a wrapper's)
    step = optimizer.step
    optimizer.step = lambda *args, **kwargs: step_if_finite(optimizer, norm, step)
    try:
        yield
    finally:
        if own is None:
            del optimizer.step  # the class's method again
        else:
            optimizer.step = own


def _undo_the_state_building_step(optimizer: Any) -> None:
    """DeepSpeed's FP16_UnfusedOptimizer (ZeRO-0 in bf16, or fp16) builds its optimizer's state
    by one step on zero gradients: AdamW's count at 1 and its weight decay already applied to
    the fp32 master weights when training starts (the first update 0.73x its size; 0.08 off the
    loss in 4 steps). The state goes, and the masters take the 16-bit weights again."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(optimizer, FP16_UnfusedOptimizer):
        return
    optimizer.optimizer.state.clear()  # (AdamW builds it afresh at the first real step)
    with torch.no_grad():
        for masters, weights in zip(optimizer.fp32_groups, optimizer.fp16_groups, strict=True):
            for master, weight in zip(masters, weights, strict=True):
                master.copy_(weight)


class DeepSpeedBackend(Backend):
    def setup(self, model: Transformer, initial_weights: Mapping | None = None) -> nn.Module:
        # DeepSpeed still calls collectives that torch 2.13 deprecates, warning on every call
        warnings.filterwarnings(
            "ignore", category=FutureWarning, message=r"`torch\.distributed\.\w+` is deprecated"
        )
        import deepspeed

        # before initialize: the fp32 master copies start from these weights
        self.materialize_on_cpu(model, initial_weights)
        self.transform_blocks(model)
        self.module = model
        self.ds_config = deepspeed_config(self.cfg, self.plan)
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=self._client_optimizer(model), config=self.ds_config
        )
        _undo_the_state_building_step(engine.optimizer)
        self.model, self.optimizer = engine, optimizer
        self._boundary = True
        if self.plan.is_main and self.plan.precision != "fp32":  # (read from the engine)
            summed = getattr(engine.optimizer, "gradient_accumulation_dtype", None)
            summed = summed or engine.get_data_types()[1]
            log.info(
                "deepspeed: ZeRO-%d, gradients summed in %s and reduced in %s",
                self.cfg.parallel.deepspeed.zero_stage,
                str(summed).removeprefix("torch."),
                str(engine.communication_data_type).removeprefix("torch."),
            )
        return engine

    def transform_blocks(self, model: Transformer) -> None:
        if self.compile and self.cfg.parallel.deepspeed.zero_stage == 3:
            log.warning(
                "train.compile: the blocks run eager under ZeRO-3 (it gathers parameters in "
                "hooks on every layer inside a block, which the compiled graph cannot contain); "
                "the loss is still compiled. Use zero_stage 0-2 or parallel.backend=fsdp to "
                "compile the blocks"
            )
            apply_activation_checkpointing(model, self.cfg.activation_checkpointing)
            return
        super().transform_blocks(model)

    def _client_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        t = self.cfg.train
        if self.cfg.parallel.deepspeed.offload_optimizer == "cpu":
            # the step runs on the CPU: DeepSpeed's vectorized CPU Adam (built on first use)
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(
                param_groups(model, t.weight_decay),
                lr=t.lr,
                betas=(t.beta1, t.beta2),
                eps=t.eps,
                adamw_mode=True,
            )
        return build_optimizer(model, t)

    def run_files(self) -> dict[str, str]:
        return {"ds_config.json": json.dumps(self.ds_config, indent=2)}

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def sync_context(self, sync_gradients: bool) -> contextlib.AbstractContextManager:
        self._boundary = sync_gradients
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss, scale_wrt_gas=False)
        if not self._boundary:
            self.model.step()  # bookkeeping only: DeepSpeed updates at the boundary

    def clip_and_step(self) -> torch.Tensor:
        engine = self.model
        if not engine.is_gradient_accumulation_boundary():
            raise RuntimeError("DeepSpeed's micro-step count is out of step with grad_accum")
        fallback = None
        zero = self.cfg.parallel.deepspeed.zero_stage
        if not (zero or engine.fp16_enabled() or engine.bfloat16_enabled()):
            # ZeRO-0 in fp32 hands its step to the client optimizer as it is: the engine clips
            # but neither reports the norm nor checks it, so the norm is taken here and the
            # optimizer steps only if it is finite (the other modes skip one inside DeepSpeed)
            fallback = self.clip_grad_norm(0)
            with _step_only_if_finite(engine.optimizer, fallback):
                engine.step()
        else:
            engine.step()
        norm = engine.get_global_grad_norm()
        norm = fallback if norm is None else norm
        if not engine.was_step_applied():  # fp16 overflow: the step was skipped
            norm = math.inf
        if isinstance(norm, torch.Tensor):
            return norm.detach().float().reshape(())
        return torch.tensor(float("nan") if norm is None else norm, device=self.plan.device)

    def loss_scale(self) -> float | None:
        """DeepSpeed's own fp16 loss scale (its engine owns the scaler), None in bf16 / fp32."""
        engine = self.model
        if not engine.fp16_enabled():
            return None
        scale = getattr(engine.optimizer, "cur_scale", None)
        if scale is None:
            scale = getattr(getattr(engine.optimizer, "loss_scaler", None), "cur_scale", None)
        return None if scale is None else float(scale)

    def save(self, ckpt_dir: Path, background: BackgroundSave | None = None) -> None:
        """The engine's own checkpoint: each rank writes its partitions, nothing is gathered
        (components/zero_weights.py reads them). Foreground only: the engine has no other."""
        if background is not None:
            raise ValueError("DeepSpeed checkpoints are written in the foreground only")
        failed = hash_deepspeed_writes(self.model)  # so the integrity record needs no second read
        self.model.save_checkpoint(str(ckpt_dir), tag=TAG)
        if failed:  # (raised once past DeepSpeed's barriers: the other ranks are not left there)
            raise failed[0]

    def load(self, ckpt_dir: Path, layout: dict[str, Any]) -> None:
        """The engine's own checkpoint of this layout; any other one parameter at a time."""
        if layout != self.checkpoint_layout():
            self._load_per_parameter(ckpt_dir)
            return
        guard_deepspeed_reader(self.model)  # DeepSpeed's own reader unpickles anything
        path, _ = self.model.load_checkpoint(
            str(ckpt_dir), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {ckpt_dir / TAG}")

    @torch.no_grad()
    def _load_per_parameter(self, ckpt_dir: Path) -> None:
        """Another layout's weights, Adam's moments and step, through DeepSpeed's own setters."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        weights = CheckpointWeights(ckpt_dir, build_model(self.cfg.model).state_dict())
        moments, zero = weights.source, self.model.optimizer  # (Adam's, read when asked)
        _create_moments(zero, moments.optimizer_step())
        for name, param in self.model.module.named_parameters():
            safe_set_full_fp32_param(param, weights[name].to(self.plan.device))
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(param, moments.read(name, key).to(param.device), key)
        _fp32_to_module(zero)


def _create_moments(zero: Any, step: int) -> None:
    """Adam's state beside each flat fp32 partition at `step`, linked to the parameters as a first
    step links it: DeepSpeed 0.19 makes it only at the first step, and its setters write into it."""
    flats = getattr(zero, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
    if flats is None:
        flats = zero.fp32_partitioned_groups_flat  # ZeRO-3
    for flat in flats:
        state = zero.optimizer.state[flat]
        for key in ("exp_avg", "exp_avg_sq"):
            state.setdefault(key, torch.zeros_like(flat))
        adamw = isinstance(zero.optimizer, torch.optim.AdamW)  # (a float32 tensor; CPU Adam: int)
        state["step"] = torch.tensor(float(step), device=flat.device) if adamw else step
    if flats is getattr(zero, "single_partition_of_fp32_groups", None):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def _fp32_to_module(zero: Any) -> None:
    """The module's weights from the fp32 partitions, as after DeepSpeed's universal load."""
    if hasattr(zero, "update_lp_params"):
        zero.update_lp_params()
        return
    for fp32, lp in zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat):
        if fp32.numel():
            lp.data.copy_(fp32.data)
    for flat, params in zip(zero.fp16_partitioned_groups_flat, zero.fp16_partitioned_groups):
        for param, values in zip(params, zero.unflatten(flat, params)):
            param.data = values.data
