"""FP8 matmuls in the transformer blocks' linears (`train.fp8`) through torchao's Float8Linear,
applied first on the meta model: weights stay high precision under their names, so optimizer and
checkpoints are as without fp8. Emulated on the CPU: the curve of an fp8 run, not its speed."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from scale_llm.config import Config
from scale_llm.config.fp8 import fp8_all_gathers
from scale_llm.config.plan import RunPlan
from scale_llm.errors import UserError, install_hint

log = logging.getLogger(__name__)

FP8_CAPABILITY = (8, 9)  # Ada (L4, RTX 4090) and Hopper (H100, H200): the first with fp8 GEMMs


def check_fp8(cfg: Config, plan: RunPlan, capability: tuple[int, int] | None = None) -> None:
    """Preflight: torchao and an fp8 GPU (`capability`: this rank's GPU's, asked when None; the
    backend and fp16: the plan's launch_problems). One UserError naming the fix."""
    if not cfg.train.fp8.enabled:
        return
    if importlib.util.find_spec("torchao") is None:
        raise UserError(
            f"train.fp8.enabled=true needs torchao (its Float8Linear), which is not installed: "
            f"{install_hint('fp8')}; or set train.fp8.enabled=false"
        )
    if plan.device.type == "cuda":
        major, minor = capability or torch.cuda.get_device_capability(plan.device)
        if (major, minor) < FP8_CAPABILITY:
            raise UserError(
                f"train.fp8.enabled=true needs fp8 matmuls, which GPUs of compute capability "
                f"8.9 or newer have (L4, RTX 4090, H100, H200); {plan.device} is {major}.{minor}: "
                f"set train.fp8.enabled=false"
            )


def float8_config(cfg: Config, plan: RunPlan):  # -> torchao.float8.Float8LinearConfig
    """torchao's config for `train.fp8`: the recipe, emulation off a GPU, FSDP2's fp8 gathers."""
    from torchao.float8 import Float8LinearConfig

    fp8 = cfg.train.fp8
    config = Float8LinearConfig.from_recipe_name(fp8.recipe)
    gathers = plan.backend == "fsdp" and fp8_all_gathers(fp8)
    emulate = plan.device.type != "cuda"
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=gathers)


# the blocks' linears that tensor parallelism splits row-wise (the others: column-wise)
ROW_WISE = ("attention.wo", "feed_forward.w2")


def convertible(linear: nn.Linear, tp: int = 1, row_wise: bool = False) -> bool:
    """Whether the fp8 GEMM takes this linear's shape on each rank (both dims multiples of 16):
    under tensor parallelism 1/tp of its outputs, or of its inputs when `row_wise`."""
    split_in, split_out = (tp, 1) if row_wise else (1, tp)
    return linear.in_features % (16 * split_in) == 0 and linear.out_features % (16 * split_out) == 0


def apply_fp8(model: nn.Module, cfg: Config, plan: RunPlan) -> None:
    """Swap the blocks' linears for Float8Linear in place (meta device); logs what and how."""
    if not cfg.train.fp8.enabled:
        return
    _import_torchao(quiet=plan.device.type != "cuda")
    from torchao.float8 import convert_to_float8_training

    config = float8_config(cfg, plan)
    if cfg.train.fp8.recipe == "rowwise":  # torchtitan's workaround for pytorch#150859
        torch._inductor.config.emulate_precision_casts = True
    tp = plan.tp_degree
    fits = lambda m, fqn: convertible(m, tp, fqn in ROW_WISE)  # (fqn: in the block)
    skipped, converted = [], 0
    for i, block in enumerate(model.layers):
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear) and not fits(module, name):
                skipped.append(f"layers.{i}.{name} ({_shape(module, tp, name in ROW_WISE)})")
        convert_to_float8_training(block, config=config, module_filter_fn=fits)
        converted += sum(1 for m in block.modules() if _is_float8(m))
    _say(cfg, config, converted, skipped)


def _shape(linear: nn.Linear, tp: int, row_wise: bool) -> str:
    """`in x out`, and under tensor parallelism what each rank's GEMM has of it."""
    n_in, n_out = linear.in_features, linear.out_features
    if tp == 1:
        return f"{n_in} x {n_out}"
    local = f"{n_in // tp} x {n_out}" if row_wise else f"{n_in} x {n_out // tp}"
    return f"{n_in} x {n_out}, {local} on each of {tp} tp ranks"


def precompute_scales_after_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config, plan: RunPlan
) -> None:
    """Where FSDP2 gathers tensorwise fp8 weights: every weight's scale in one all-reduce after
    each optimizer step (as torchtitan), not one per weight in the next forward (same scales)."""
    if not (cfg.train.fp8.enabled and plan.backend == "fsdp" and fp8_all_gathers(cfg.train.fp8)):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    # whatever steps (trainer, bench) gets new scales; a skipped step keeps weights and scales
    optimizer.register_step_post_hook(
        lambda _optimizer, _args, _kwargs: precompute_float8_dynamic_scale_for_fsdp(model)
    )


def plain_tensors(state: Any) -> Any:
    """`state` with torchao's fp8 weight wrapper (FSDP2 gathering fp8 weights puts it in each
    parameter's DTensor, and AdamW's zeros_like keeps it in the moments) replaced by the plain
    tensor it wraps: saved as it is, its class is pickled into the checkpoint, which then only a
    process importing torchao.float8 reads (no resume without fp8, export or generate)."""
    wrapper = getattr(
        sys.modules.get("torchao.float8.fsdp_utils"), "WeightWithDynamicFloat8CastTensor", None
    )
    if wrapper is None:
        return state

    def plain(value: Any) -> Any:
        local = value._local_tensor if isinstance(value, DTensor) else value
        if not isinstance(local, wrapper):
            return value
        if not isinstance(value, DTensor):
            return local._tensor
        return DTensor.from_local(
            local._tensor,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )

    return tree_map(plain, state)


def _import_torchao(quiet: bool) -> None:
    """Import torchao without torch's deprecation warning about its enum (nothing a user can act
    on); `quiet`: nor torchao's about CUDA kernels and Triton (the emulated path needs neither)."""
    names = ["torch.utils._pytree", *(["torchao"] if quiet else [])]
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _say(cfg: Config, config, converted: int, skipped: list[str]) -> None:
    where = "fp8 matmuls"
    if config.emulate:
        where = "emulated on the CPU (fp8 values, fp32 matmuls: the curve, not the speed)"
    gather = ", FSDP2 gathers fp8 weights" if config.enable_fsdp_float8_all_gather else ""
    log.info(
        f"fp8: {cfg.train.fp8.recipe} scaling in {converted} block linears, {where}{gather}; "
        f"the embedding and the output head stay in high precision"
    )
    if skipped:
        log.warning(
            f"fp8: {len(skipped)} linears stay in high precision, their dims (on each rank) "
            f"not multiples of 16: {', '.join(skipped[:4])}{' ...' if len(skipped) > 4 else ''}"
        )


def _is_float8(module: nn.Module) -> bool:
    """Whether `module` is torchao's Float8Linear (never imports torchao: not imported, none)."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    return linear is not None and isinstance(module, linear.Float8Linear)


def tp_styles(block: nn.Module, mesh: DeviceMesh) -> tuple[type, type, type | None]:
    """(column-wise, row-wise, input preparation) tensor-parallel styles for `block`: torchao's
    Float8 ones for tensorwise fp8 linears on GPUs (the input cast and gathered in fp8 once),
    else torch's plain ones and None: rowwise, as torchtitan, and gloo, which carries no fp8."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    granularity = lambda m: m.config.cast_config_input.scaling_granularity.name
    fp8 = all(_is_float8(m) and granularity(m) == "TENSORWISE" for m in linears)  # (skipped: plain)
    if not fp8 or mesh.device_type != "cuda":
        return ColwiseParallel, RowwiseParallel, None
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
