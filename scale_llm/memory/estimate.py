"""Per-GPU bytes of model states for each backend layout, and the whole estimate."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from scale_llm.config import ActivationCheckpointingConfig, Config, ModelConfig
from scale_llm.errors import UserError
from scale_llm.memory.activations import (
    block_matmul_params,
    logits_bytes,
    numerics_for,
    recompute_bytes,
    saved_activation_bytes,
)
from scale_llm.plan import RunPlan, target_plan

GiB = 1 << 30
OVERHEAD_FRACTION = 0.05

# ----------------------------------------------------------------------------- model states


@dataclass(frozen=True)
class Layout:
    """The settings that decide per-GPU memory."""

    backend: str
    precision: str  # bf16 | fp16 | fp32 (as the plan resolved it)
    world: int
    micro_batch: int
    grad_accum: int
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    reshard_after_forward: bool = True
    fsdp_offload: bool = False

    def describe(self) -> str:
        if self.backend == "deepspeed":
            extra = f" ZeRO-{self.zero_stage}"
            extra += " + optimizer offload" if self.offload_optimizer else ""
            extra += " + param offload" if self.offload_param else ""
        elif self.backend == "fsdp":
            extra = " (reshard_after_forward)" if self.reshard_after_forward else " (no reshard)"
            extra += " + cpu offload" if self.fsdp_offload else ""
        else:
            extra = ""
        return f"{self.backend}{extra}, world {self.world}, {self.precision}"


def layout_of(cfg: Config, plan: RunPlan) -> Layout:
    p = cfg.parallel
    return Layout(
        backend=plan.backend,
        precision=plan.precision,
        world=plan.world_size,
        micro_batch=plan.micro_batch_size,
        grad_accum=plan.grad_accum,
        zero_stage=p.deepspeed.zero_stage,
        offload_optimizer=p.deepspeed.offload_optimizer == "cpu",
        offload_param=p.deepspeed.offload_param == "cpu",
        reshard_after_forward=p.fsdp.reshard_after_forward,
        fsdp_offload=p.fsdp.cpu_offload,
    )


@dataclass
class ParamCounts:
    total: int
    block: int  # one transformer block
    root: int  # embeddings, final norm, output head

    @staticmethod
    def of(m: ModelConfig) -> ParamCounts:
        per_block = block_matmul_params(m) + 2 * m.d_model
        embed = m.vocab_size * m.d_model
        root = embed * (1 if m.tie_embeddings else 2) + m.d_model
        return ParamCounts(root + m.n_layers * per_block, per_block, root)


def state_bytes(n: ParamCounts, lay: Layout) -> tuple[dict[str, float], dict[str, float]]:
    """(gpu, cpu) bytes for params, grads and optimizer under the layout."""
    P, W = n.total, lay.world
    half = lay.precision != "fp32"
    c = 2 if half else 4  # bytes of a 16-bit (or fp32) working copy
    if lay.backend == "fsdp":
        # sharded fp32 params / grads / Adam moments; gathered c-byte params while computing
        working = c * (P if not lay.reshard_after_forward else 2 * n.block + n.root)
        sharded = {"params": 4 * P / W, "grads": 4 * P / W, "optimizer": 8 * P / W}
        transient_grads = (c + 4) * n.block  # one block's unsharded grads before reduce-scatter
        gpu = {"params": working, "grads": transient_grads, "optimizer": 0.0}
        cpu = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
        target = cpu if lay.fsdp_offload else gpu
        for k, v in sharded.items():
            target[k] += v
        return gpu, cpu
    if lay.backend == "deepspeed":
        return _deepspeed_states(n, lay, c, half)
    # single / ddp: fp32 params and grads (autocast casts per op), AdamW moments
    return {"params": 4 * P, "grads": 4 * P, "optimizer": 8 * P}, {}


def _deepspeed_states(n: ParamCounts, lay: Layout, c: int, half: bool):
    """ZeRO (Rajbhandari et al. 2020): c-byte params and grads, and the optimizer's fp32 master
    weights (16-bit modes) plus two moments, partitioned by stage. In 16-bit modes with a
    partitioned optimizer (stage >= 1) the step also holds an fp32 copy of this rank's gradient
    partition: DeepSpeed's own estimator counts it ("4_grads_32bit"), and so does this one."""
    P, W, s = n.total, lay.world, lay.zero_stage
    optim = (12 if half else 8) * P
    params = c * P / W if s >= 3 else c * P
    grads = c * P / W if s >= 2 else c * P
    if half and s >= 1 and not lay.offload_optimizer:
        grads += 4 * P / W  # the fp32 gradient partition the optimizer steps on
    optim = optim / W if s >= 1 else optim
    gpu = {"params": params, "grads": grads, "optimizer": optim}
    cpu = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    if s >= 3:  # parameters gathered while a block computes (like FSDP with resharding)
        gpu["params"] += c * (2 * n.block + n.root)
    if lay.offload_optimizer:
        cpu["optimizer"], gpu["optimizer"] = gpu["optimizer"], 0.0
        cpu["grads"] = 4 * P / W  # fp32 gradient partition for the CPU step
    if lay.offload_param:
        cpu["params"] = c * P / W
        gpu["params"] -= c * P / W
    return gpu, cpu


# ----------------------------------------------------------------------------- the estimate


@dataclass
class Estimate:
    params: int
    layout: Layout
    model: ModelConfig
    ac: ActivationCheckpointingConfig
    gpu: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.gpu["total"]

    def to_json(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "bytes_per_gpu": {k: int(v) for k, v in self.gpu.items()},
            "cpu_bytes_per_rank": {k: int(v) for k, v in self.cpu.items() if v},
            "layout": dataclasses.asdict(self.layout),
            "activation_checkpointing": self.ac.mode,
            "attention": self.model.attention,
        }


def estimate_layout(m: ModelConfig, ac: ActivationCheckpointingConfig, lay: Layout) -> Estimate:
    n = ParamCounts.of(m)
    num = numerics_for(lay.precision, lay.backend)
    gpu, cpu = state_bytes(n, lay)
    saved = saved_activation_bytes(m, ac, lay.micro_batch, num)
    logits_saved = logits_bytes(m, lay.micro_batch, num)
    gpu["activations"] = saved - logits_saved + recompute_bytes(m, ac, lay.micro_batch, num)
    # the logits kept by the chunked loss and, in backward, their gradient (same dtype); the
    # loss's one fp32 chunk at a time (64 MiB) is inside the overhead allowance
    gpu["logits"] = 2 * logits_saved
    gpu["overhead"] = OVERHEAD_FRACTION * sum(gpu.values())
    gpu["total"] = sum(gpu.values())
    return Estimate(n.total, lay, m, ac, gpu, cpu)


def estimate(cfg: Config, target: RunPlan | int) -> Estimate:
    """Per-GPU bytes of `cfg` run as `target`: the run's own plan, or a world size of
    bf16-capable GPUs (`scale_llm.plan.target_plan`)."""
    plan = target_plan(cfg, target) if isinstance(target, int) else target
    return estimate_layout(cfg.model, cfg.activation_checkpointing, layout_of(cfg, plan))


# ----------------------------------------------------------------------------- units


_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """'80GiB' -> bytes. Units: B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = (m.group(2) or "b").lower() if m else ""
    if not m or unit not in _UNITS:
        raise UserError(
            f"memory size {text!r} is not understood; write a number with one of the "
            f"units B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers "
            f"of 1024), e.g. --fit 80GiB"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
