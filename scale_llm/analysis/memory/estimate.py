"""Per-GPU bytes of model states for each backend layout, and the whole estimate; for ZeRO-1/2's
optimizer offload also its host buffers (with what torch's pinned allocator rounds them up to)
and the bytes it copies between host and GPU per step."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from scale_llm.analysis.memory.activations import (
    Numerics,
    block_activation_bytes,
    block_backward_bytes,
    block_matmul_params,
    checkpointed_count,
    kept_per_block,
    loss_backward_bytes,
    loss_forward_bytes,
    numerics_for,
    resident_input_bytes,
    saved_activation_bytes,
)
from scale_llm.config import ActivationCheckpointingConfig, Config, ModelConfig
from scale_llm.config.plan import RunPlan, target_plan
from scale_llm.config.sections import mlp_hidden_size
from scale_llm.errors import UserError
from scale_llm.parallel.ds_config import deepspeed_config

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
    fsdp_reduce_every: bool = True  # reduce-scatter every micro-step (else accumulate unsharded)
    fused_norm: bool = True  # RMSNorm saves its input and rstd (CUDA, CPU): norm_saved_bytes
    ddp_bucket_view: bool = True  # DDP's gradient_as_bucket_view
    ds_bucket_elements: int = 50_000_000  # DeepSpeed's reduce_bucket_size (generated config)
    ds_overlap_comm: bool = True  # two reduce buckets (double buffering) in ZeRO-1/2
    ds_max_live: int = 1_000_000_000  # ZeRO-3's stage3_max_live_parameters (elements)
    ds_persistence_threshold: int = 100_000  # ZeRO-3: smaller params are never partitioned
    ds_pin_memory: bool = True  # offload_optimizer.pin_memory: page-locked host buffers
    ds_grad_accum_dtype: str | None = None  # data_types.grad_accum_dtype (None: the params')
    pinned_round_limit: int | None = None  # bytes: larger pinned blocks are not rounded up
    tp: int = 1  # tensor parallelism: each rank holds 1/tp of every matmul weight
    sequence_parallel: bool = False
    replicate: int = 1  # HSDP: data-parallel groups that each hold a whole sharded copy

    @property
    def shards(self) -> int:
        """Ranks one FSDP2 unit's states are sharded over: the mesh's shard dimension (the
        world over the tp ranks and, under HSDP, over the replicas)."""
        return self.world // (self.tp * self.replicate)

    @property
    def working_bytes(self) -> int:
        """Bytes per element of a 16-bit working copy (fp32 runs: 4)."""
        return 2 if self.precision != "fp32" else 4

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
        if self.tp > 1:
            extra += f" x tensor parallel {self.tp}"
            extra += " (sequence parallel)" if self.sequence_parallel else ""
        return f"{self.backend}{extra}, world {self.world}, {self.precision}"


def layout_of(cfg: Config, plan: RunPlan) -> Layout:
    p = cfg.parallel
    ds = deepspeed_config(cfg, plan)  # DeepSpeed's settings as the run will pass them
    zero = ds["zero_optimization"]
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
        fsdp_reduce_every=p.fsdp.reduce_every_micro_step,
        fused_norm=plan.device.type in ("cuda", "cpu"),
        ddp_bucket_view=p.ddp.gradient_as_bucket_view,
        ds_bucket_elements=int(float(zero.get("reduce_bucket_size", 5e8))),
        ds_overlap_comm=bool(zero.get("overlap_comm", False)),
        ds_max_live=int(float(zero.get("stage3_max_live_parameters", 1e9))),
        ds_persistence_threshold=int(float(zero.get("stage3_param_persistence_threshold", 1e5))),
        # DeepSpeed's CPU accelerator pins nothing (its pin_memory returns the tensor)
        ds_pin_memory=plan.device.type == "cuda"
        and bool((zero.get("offload_optimizer") or {}).get("pin_memory", False)),
        ds_grad_accum_dtype=_dtype_name((ds.get("data_types") or {}).get("grad_accum_dtype")),
        pinned_round_limit=pinned_round_limit(os.environ),
        tp=plan.tp_degree,
        replicate=plan.replicate_degree,
        sequence_parallel=plan.tp_degree > 1 and p.sequence_parallel,
    )


def _dtype_name(value: Any) -> str | None:
    """DeepSpeed's spellings of a dtype (its DtypeEnum) as fp32 / bf16 / fp16."""
    names = {
        "fp32": ("fp32", "float32", "float", "torch.float32"),
        "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
        "fp16": ("fp16", "float16", "half", "torch.float16"),
    }
    text = str(value).lower()
    return next((name for name, spellings in names.items() if text in spellings), None)


@dataclass
class ParamCounts:
    total: int
    block: int  # one transformer block
    root: int  # embeddings, final norm, output head
    layers: int = 1
    block_tensors: tuple[int, ...] = ()  # elements of each of a block's parameters
    root_tensors: tuple[int, ...] = ()

    @staticmethod
    def of(m: ModelConfig, tp: int = 1) -> ParamCounts:
        """The model's parameters, or one rank's under tensor parallelism `tp`: 1/tp of every
        matmul weight and of the embedding and head (split by heads, width or vocabulary),
        the norms whole on every rank."""
        d, F = m.d_model, mlp_hidden_size(m) // tp
        dq = m.n_heads * (d // m.n_heads) // tp
        qkv = d * (dq + 2 * (m.n_kv_heads or m.n_heads) * (d // m.n_heads) // tp)
        block_tensors = (qkv, dq * d, d * F, d * F, F * d, d, d)  # wqkv wo w1 w3 w2, 2 norms
        assert sum(block_tensors) == block_matmul_params(m, tp) + 2 * d
        embed = m.vocab_size // tp * d
        root_tensors = (embed, d) if m.tie_embeddings else (embed, embed, d)
        per_block, root = sum(block_tensors), sum(root_tensors)
        total = root + m.n_layers * per_block
        return ParamCounts(total, per_block, root, m.n_layers, block_tensors, root_tensors)

    def below(self, threshold: int) -> tuple[int, int]:
        """Elements of the parameters smaller than `threshold`: (per block, in the root)."""

        def small(tensors: tuple[int, ...]) -> int:
            return sum(t for t in tensors if t < threshold)

        return small(self.block_tensors), small(self.root_tensors)


def state_bytes(n: ParamCounts, lay: Layout) -> tuple[dict[str, float], dict[str, float]]:
    """(gpu, cpu) bytes for params, grads and optimizer under the layout."""
    P, W = n.total, lay.world
    half = lay.precision != "fp32"
    c = lay.working_bytes
    if lay.backend == "fsdp":  # (n: this rank's part under tensor parallelism)
        W = lay.shards
        # sharded fp32 params / grads / Adam moments, and gathered c-byte params at their
        # largest (fsdp_gathered_params); no-sync accumulation keeps every gradient unsharded
        biggest = max(n.block, n.root)
        working = fsdp_gathered_params(n, lay, "largest")
        sharded = {"params": 4 * P / W, "grads": 4 * P / W, "optimizer": 8 * P / W}
        unsharded = fsdp_unsharded_grads(n, lay, biggest)
        if lay.grad_accum > 1 and not lay.fsdp_reduce_every:
            unsharded += 4 * P  # fp32 (the reduce dtype) until the last micro-step's reduction
        gpu = {"params": working, "grads": unsharded, "optimizer": 0.0}
        cpu = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
        target = cpu if lay.fsdp_offload else gpu
        for k, v in sharded.items():
            target[k] += v
        return gpu, cpu
    if lay.backend == "deepspeed":
        return _deepspeed_states(n, lay, c, half)
    # single / ddp: fp32 params and grads (autocast casts per op), AdamW moments. DDP's buckets
    # hold the gradients with gradient_as_bucket_view (zeroed in place between steps, so the
    # no_sync() micro-steps accumulate into them too); without it, buckets and .grad: 2x
    grads = 8 * P if lay.backend == "ddp" and not lay.ddp_bucket_view else 4 * P
    return {"params": 4 * P, "grads": grads, "optimizer": 8 * P}, {}


def fsdp_gathered_params(n: ParamCounts, lay: Layout, at: int | str) -> float:
    """FSDP2's gathered (unsharded, compute-dtype) parameters while block `at` runs its
    backward, during the loss (`at` "loss"), or at their largest over the step ("largest"),
    from FSDP2's unshard / reshard order and measured on 2 gloo ranks:
    - resharding: the block computing (the last block during the loss: it is never resharded
      after forward) and, from the root's pre-backward (after the loss's backward: the root is
      resharded after its forward like the blocks) to the end, the root (embeddings, head),
      plus in a block's backward the all-gather output
      of the block below, prefetched (none below block 0). At their largest, also the
      all-gather output of the larger of root and block next to both (the forward's deferred
      free, the root's re-gather): fake-tensor traces at 8 ranks, 400m and 1b exact.
    - without resharding: everything through the loss; in block i's backward the root and
      blocks 0..i (each block reshards after its own backward)."""
    c = lay.working_bytes
    if not lay.reshard_after_forward:
        if at == "largest":
            return c * (n.total + n.block)
        return c * (n.total if at == "loss" else n.root + (int(at) + 1) * n.block)
    if at == "largest":
        return c * (n.root + n.block + max(n.block, n.root))
    if at == "loss":  # measured on 2 gloo ranks (the live storages, by owner)
        return c * n.block
    return c * (n.root + (2 if int(at) > 0 else 1) * n.block)


def fsdp_unsharded_grads(n: ParamCounts, lay: Layout, unit: int) -> float:
    """FSDP2's unsharded gradients of one unit of `unit` parameters before its reduce-scatter
    (16-bit, and the fp32 reduce-scatter input). Its largest is the largest unit's: a block, or
    the root (embeddings, head) where that is larger, as traces of 400m/1b/7b at 8 ranks showed."""
    return float((lay.working_bytes + 4) * unit)


def ds_reduce_buckets(lay: Layout) -> float:
    """Bytes of DeepSpeed's gradient reduce buckets (ZeRO >= 1), whatever the model's size:
    reduce_bucket_size elements in the gradients' dtype, two with overlap_comm in ZeRO-1/2
    (made at a backward's first gradient, freed after it), one in ZeRO-3 (made with the
    engine)."""
    if lay.backend != "deepspeed" or lay.zero_stage < 1:
        return 0.0
    count = 1 if lay.zero_stage >= 3 else (2 if lay.ds_overlap_comm else 1)
    return float(count * lay.working_bytes * lay.ds_bucket_elements)


def zero3_gathered_params(n: ParamCounts, lay: Layout) -> float:
    """ZeRO-3's 16-bit (fp32 runs: 32-bit) parameters held whole beyond this rank's partition.
    Parameters smaller than stage3_param_persistence_threshold are never partitioned. The
    others are gathered for the module using them; DeepSpeed's parameter coordinator keeps what
    its prefetcher fetched or skipped for later use and what is reused soon, up to
    stage3_max_live_parameters elements (1e9 by default: a model under 1B parameters stays
    whole). Measured on 2 gloo ranks (DeepSpeed 0.19): the whole 16-bit model at the loss's
    backward at d_model 256 x 4 layers, whatever the reuse distance and prefetch bucket (with
    stage3_max_live_parameters 1 too: the peak did not move); at d_model 1024 x 8 layers, 36
    of 197 MiB with stage3_max_live_parameters 2e7 (38 MiB). Counted: max_live elements, at
    least the root and a block, at most every parameter; released by the optimizer step."""
    small_block, small_root = n.below(lay.ds_persistence_threshold)
    persistent = n.layers * small_block + small_root
    partitioned = n.total - persistent
    held = min(partitioned, max(lay.ds_max_live, (n.root - small_root) + (n.block - small_block)))
    return lay.working_bytes * (held + persistent * (1 - 1 / lay.world))


def _deepspeed_states(n: ParamCounts, lay: Layout, c: int, half: bool):
    """ZeRO (Rajbhandari et al. 2020): c-byte params and grads, and the optimizer's fp32 master
    weights (16-bit modes) plus two moments, partitioned by stage. In 16-bit modes with a
    partitioned optimizer (stage >= 1) the step also holds an fp32 copy of this rank's gradient
    partition: DeepSpeed's own estimator counts it ("4_grads_32bit"), and so does this one.
    Measured on 2 gloo ranks (DeepSpeed 0.19): without accumulation ZeRO-1 keeps no full
    gradients either (it reduces through the same buckets into the partition, like ZeRO-2);
    the reduce buckets are `ds_reduce_buckets`."""
    P, W, s = n.total, lay.world, lay.zero_stage
    # fp32 master weights: in fp32 mode ZeRO-1/2/3 still keep a separate flat fp32 partition
    # (measured; ZeRO-3 clones it in _create_fp32_partitions); ZeRO-0 steps on the parameters
    optim = (12 if half or s >= 1 else 8) * P
    params = c * P / W if s >= 3 else c * P
    grads = c * P / W if s >= 1 else c * P
    if half and s >= 1 and not lay.offload_optimizer:
        grads += 4 * P / W  # the fp32 gradient partition the optimizer steps on
    grads += ds_reduce_buckets(lay)
    if s == 1 and lay.grad_accum > 1:  # ZeRO-1 accumulates whole gradients in .grad between
        grads += c * P  # micro-steps and partitions them at the boundary (measured: c x P more)
    optim = optim / W if s >= 1 else optim
    gpu = {"params": params, "grads": grads, "optimizer": optim}
    cpu = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    if s >= 3:
        gpu["params"] += zero3_gathered_params(n, lay)
    if lay.offload_optimizer and s in (1, 2):
        gpu["optimizer"] = 0.0
        gpu["grads"] += zero_offload_gpu_grads(n, lay) - c * P / W
        cpu.update(zero_offload_host(n, lay))
    elif lay.offload_optimizer:
        cpu["optimizer"], gpu["optimizer"] = gpu["optimizer"], 0.0
        cpu["grads"] = 4 * P / W  # fp32 gradient partition for the CPU step
    if lay.offload_param:
        cpu["params"] = c * P / W
        gpu["params"] -= c * P / W
    return gpu, cpu


# ----------------------------------------------------------------------------- ZeRO-Offload


def optimizer_groups(n: ParamCounts) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Elements of each parameter of the optimizer's two groups in the model's order, as
    DeepSpeed flattens them (`components.optim.param_groups`): weight decay on the blocks'
    matmul weights and an untied head; none on the embedding and the norms."""
    embed, d = n.root_tensors[0], n.root_tensors[-1]
    matmuls, norms = n.block_tensors[:5], n.block_tensors[5:]
    head = () if len(n.root_tensors) == 2 else (embed,)  # (embed, d) when tied
    return matmuls * n.layers + head, (embed,) + norms * n.layers + (d,)


@dataclass(frozen=True)
class RankPartition:
    """One rank's share of one flattened parameter group under ZeRO-1/2 (DeepSpeed's
    `get_partition_info`): the group is padded to a multiple of 2 x world elements and cut into
    `world` equal partitions; a parameter belongs to every partition it overlaps."""

    elements: int  # the partition, padding included
    overlapping: tuple[int, ...]  # whole sizes of the parameters that overlap it
    inside: int  # parameter elements inside it (no padding)

    @staticmethod
    def of(sizes: tuple[int, ...], world: int, rank: int) -> RankPartition:
        align = 2 * world
        size = -(-sum(sizes) // align) * align // world
        start, end, at = rank * size, (rank + 1) * size, 0
        overlapping, inside = [], 0
        for numel in sizes:
            if at < end and at + numel > start:
                overlapping.append(numel)
                inside += min(at + numel, end) - max(at, start)
            at += numel
        return RankPartition(size, tuple(overlapping), inside)


def zero_offload_compact(lay: Layout) -> bool:
    """ZeRO-2 with offload accumulates a step's gradients in an fp32 partition on the GPU
    (`_use_compact_grad_partition_buffer`) when `data_types.grad_accum_dtype` is fp32 and the
    parameters are 16-bit; otherwise in 16-bit copies on the host, sent back each micro-step.
    (ZeRO-1 with fp32 accumulation also keeps fp32 copies of whole gradients on the GPU, which
    the estimate does not count: the generated ds_config asks for it under ZeRO-2 only.)"""
    return lay.zero_stage == 2 and lay.ds_grad_accum_dtype == "fp32" and lay.precision != "fp32"


def zero_offload_accumulates(lay: Layout) -> bool:
    """Whether ZeRO-Offload accumulates gradients on the host, in `accumulated_grads_in_cpu`:
    ZeRO-2 with grad_accum > 1 unless `zero_offload_compact`. ZeRO-1 reduces only at a step's
    last micro-step, from 16-bit gradients kept on the GPU until then, and makes none (counted
    on 2 gloo ranks: its `micro_step_id` is still 0 there)."""
    return lay.zero_stage == 2 and lay.grad_accum > 1 and not zero_offload_compact(lay)


def zero_offload_host_blocks(n: ParamCounts, lay: Layout, rank: int = 0) -> dict[str, list[int]]:
    """The host buffers of ZeRO-1/2's optimizer offload on `rank`, each allocation's bytes, by
    DeepSpeed's own names (deepspeed/runtime/zero/stage_1_and_2.py, 0.19), per parameter group:
    - `single_partition_of_fp32_groups`: the fp32 master partition (pinned with pin_memory);
    - its `.grad`: the fp32 gradient partition the CPU step reads (pinned);
    - `state` of DeepSpeedCPUAdam: exp_avg and exp_avg_sq, fp32 (pageable `zeros_like`);
    - `param_buffer_of_bit16_for_cpu_offload_groups`: the updated parameters in their own
      dtype, staged for the copy to the GPU (pinned);
    - `accumulated_grads_in_cpu` (`zero_offload_accumulates`): one parameter-dtype copy of
      every parameter overlapping the partition, whole (pinned each);
    and once, `temp_grad_buffer_for_cpu_offload`: the largest parameter in the parameters'
    dtype (pinned; allocated, never read in this version)."""
    c = lay.working_bytes
    blocks: dict[str, list[int]] = {
        name: [] for name in ("master", "grads", "moments", "staging", "accumulators")
    }
    groups = optimizer_groups(n)
    for sizes in groups:
        part = RankPartition.of(sizes, lay.world, rank)
        blocks["master"].append(4 * part.elements)
        blocks["grads"].append(4 * part.elements)
        blocks["moments"] += [4 * part.elements] * 2
        blocks["staging"].append(c * part.elements)
        if zero_offload_accumulates(lay):
            blocks["accumulators"] += [c * numel for numel in part.overlapping]
    blocks["copy buffer"] = [c * max(max(sizes) for sizes in groups)]
    return blocks


PINNED_BLOCKS = ("master", "grads", "staging", "accumulators", "copy buffer")


def zero_offload_host(n: ParamCounts, lay: Layout, rank: int = 0) -> dict[str, float]:
    """`rank`'s host bytes of ZeRO-1/2 optimizer offload (`zero_offload_host_blocks`) as the
    estimate reports them: optimizer (fp32 master + moments), grads, staging, accumulators,
    copy buffer, and `pinned rounding`, what torch's pinned allocator adds to the pinned ones
    (`pinned_block_bytes`); none without pin_memory."""
    blocks = zero_offload_host_blocks(n, lay, rank)
    pinned = [b for name in PINNED_BLOCKS for b in blocks[name]] if lay.ds_pin_memory else []
    rounding = sum(pinned_block_bytes(b, lay.pinned_round_limit) - b for b in pinned)
    return {
        "optimizer": float(sum(blocks["master"]) + sum(blocks["moments"])),
        "grads": float(sum(blocks["grads"])),
        "staging": float(sum(blocks["staging"])),
        "accumulators": float(sum(blocks["accumulators"])),
        "copy buffer": float(sum(blocks["copy buffer"])),
        "pinned rounding": float(rounding),
    }


def zero_offload_gpu_grads(n: ParamCounts, lay: Layout) -> float:
    """ZeRO-1/2 with optimizer offload keeps no 16-bit gradient partition on the GPU (counted
    between micro-steps on 2 gloo ranks, ZeRO-2): each reduced gradient leaves from the reduce
    bucket (`ds_reduce_buckets`, counted apart) through `temp_grad_buffer_for_gpu_offload` (the
    largest parameter, in its dtype), and, with `zero_offload_compact`, an fp32 accumulation
    partition per group lives from a step's first reduction to the step."""
    largest = max(max(sizes) for sizes in optimizer_groups(n))
    compact = 0
    if zero_offload_compact(lay):
        compact = sum(4 * RankPartition.of(g, lay.world, 0).elements for g in optimizer_groups(n))
    return float(lay.working_bytes * largest + compact)


def zero_offload_traffic(n: ParamCounts, lay: Layout, rank: int = 0) -> dict[str, dict[str, float]]:
    """Bytes copied between host and GPU per optimizer step on `rank` under ZeRO-1/2 optimizer
    offload, by direction and reason (stage_1_and_2.py, 0.19):
    - to the host, fp32 gradients: at the step's last micro-step each reduced gradient's part
      in the partition, cast to fp32 on the GPU, into the fp32 gradient partition;
    - to the GPU, parameters: the updated partition, from the staging copy;
    - with `zero_offload_accumulates` (grad_accum N > 1), the gradient accumulators
      (`async_accumulate_grad_in_cpu_via_gpu`): every overlapping parameter's gradient goes to
      the host on each of the N micro-steps and the sum so far comes back to the GPU to be
      added to on each after the first (N and N - 1 copies of each)."""
    c, N = lay.working_bytes, lay.grad_accum
    to_host: dict[str, float] = {"fp32 gradients": 0.0}
    to_gpu: dict[str, float] = {"parameters": 0.0}
    for sizes in optimizer_groups(n):
        part = RankPartition.of(sizes, lay.world, rank)
        to_host["fp32 gradients"] += 4 * part.inside
        to_gpu["parameters"] += c * part.elements
        if zero_offload_accumulates(lay):
            whole = c * sum(part.overlapping)
            for way, copies in ((to_host, N), (to_gpu, N - 1)):
                way["gradient accumulators"] = way.get("gradient accumulators", 0) + copies * whole
    return {"to host": to_host, "to GPU": to_gpu}


# ----------------------------------------------------------------------------- pinned memory


def pinned_block_bytes(nbytes: int, round_limit: int | None = None) -> int:
    """The bytes torch's pinned host allocator takes for an `nbytes` request (`tensor.pin_memory()`
    and `pin_memory=True` go through it): CachingHostAllocatorImpl::allocate rounds each block
    up to the next power of two (ATen/core/CachingHostAllocator.h, torch 2.13), except blocks
    larger than `round_limit` (`pinned_round_limit`). Blocks are never split or shared, so
    a 25.1 GiB fp32 partition takes 32 GiB. `pinned_use_cuda_host_register` (malloc +
    cudaHostRegister) and `pinned_reserve_segment_size_mb` (one segment reserved up front) still
    allocate the rounded size; expandable_segments is the GPU's allocator only."""
    if nbytes <= 0 or (round_limit is not None and nbytes > round_limit):
        return max(nbytes, 0)
    return 1 << (nbytes - 1).bit_length()


def pinned_round_limit(environ: Mapping[str, str]) -> int | None:
    """Bytes above which torch's pinned allocator does not round a block up (None: it rounds
    every block, the default): `pinned_max_round_threshold_mb` and `pinned_max_cached_size_mb`
    (MiB; torch >= 2.13), read as torch reads them, from PYTORCH_ALLOC_CONF if set, else
    PYTORCH_CUDA_ALLOC_CONF (c10/core/AllocatorConfig.cpp)."""
    settings = environ.get("PYTORCH_ALLOC_CONF")
    if settings is None:
        settings = environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    limits = [
        int(mib) << 20
        for key, mib in re.findall(r"(?:^|,)\s*(\w+)\s*:\s*(\d+)", settings)
        if key in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")
    ]
    return min(limits) if limits else None


# ----------------------------------------------------------------------------- the estimate


@dataclass
class Estimate:
    """Per-GPU bytes. `gpu` holds each part at its own largest over the step (params, grads,
    optimizer, activations, logits, temporaries), `peak` the largest sum of what is alive at
    once (`phases`: the loss's backward, each block's backward, the optimizer step), and
    `total` the peak plus the allocator allowance (`overhead`). `parts` holds what each phase
    is made of, by the same five categories (`peak_parts`: the peak phase's)."""

    params: int
    layout: Layout
    model: ModelConfig
    ac: ActivationCheckpointingConfig
    gpu: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    parts: dict[str, dict[str, float]] = field(default_factory=dict)
    # host <-> GPU bytes per optimizer step of optimizer offload, by direction and reason
    traffic: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def peak_parts(self) -> dict[str, float]:
        return self.parts[self.peak_phase]

    @property
    def total(self) -> float:
        return self.gpu["total"]

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    def to_json(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "bytes_per_gpu": {k: int(v) for k, v in self.gpu.items()},
            "phases": {k: int(v) for k, v in self.phases.items()},
            "peak_phase": self.peak_phase,
            "peak_parts": {k: int(v) for k, v in self.peak_parts.items()},
            "cpu_bytes_per_rank": {k: int(v) for k, v in self.cpu.items() if v},
            "offload_bytes_per_step": {
                way: {k: int(v) for k, v in parts.items()} for way, parts in self.traffic.items()
            },
            "layout": dataclasses.asdict(self.layout),
            "activation_checkpointing": self.ac.mode,
            "attention": self.model.attention,
        }


def estimate_layout(m: ModelConfig, ac: ActivationCheckpointingConfig, lay: Layout) -> Estimate:
    n = ParamCounts.of(m, lay.tp)
    num = numerics_for(lay.precision, lay.backend, lay.fused_norm, lay.tp, lay.sequence_parallel)
    gpu, cpu = state_bytes(n, lay)
    parts, gpu["activations"], gpu["temporaries"] = step_phases(m, ac, lay, n, gpu, num)
    for k in ("activations", "temporaries"):  # (autocast's weight cache, a tied head's gradient)
        gpu[k] = max(gpu[k], *(p[k] for p in parts.values()))
    phases = {name: sum(p.values()) for name, p in parts.items()}
    gpu["peak"] = max(phases.values())
    gpu["overhead"] = OVERHEAD_FRACTION * gpu["peak"]
    gpu["total"] = gpu["peak"] + gpu["overhead"]
    traffic = {}
    if lay.backend == "deepspeed" and lay.offload_optimizer and lay.zero_stage in (1, 2):
        traffic = zero_offload_traffic(n, lay)
    total = ParamCounts.of(m).total  # the model's, not one tensor-parallel rank's
    return Estimate(total, lay, m, ac, gpu, cpu, phases, parts, traffic)


# PCIe 5.0 x16, each way: 16 lanes x 32 GT/s x 128/130 (encoding) / 8 bits
PCIE5_X16_BYTES_PER_S = 16 * 32e9 * 128 / 130 / 8


def format_offload_traffic(est: Estimate) -> str:
    """One line for the report: the offload's host <-> GPU bytes per optimizer step (per rank)
    by direction and reason, and the least time they take over PCIe 5.0 x16. DeepSpeed issues
    them one after another, so the time is their sum over one direction's bandwidth. "" when
    the layout offloads nothing (or is ZeRO-3's, not modelled here)."""
    if not est.traffic:
        return ""
    ways = []
    for way, parts in est.traffic.items():
        reasons = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in parts.items())
        ways.append(f"{way} {sum(parts.values()) / 1e9:.2f} GB ({reasons})")
    total = sum(sum(parts.values()) for parts in est.traffic.values())
    return (
        f"host<->GPU copies per optimizer step: {'; '.join(ways)}: {total / 1e9:.2f} GB, "
        f"at least {total / PCIE5_X16_BYTES_PER_S:.2f} s over PCIe 5.0 x16 "
        f"({PCIE5_X16_BYTES_PER_S / 1e9:.0f} GB/s each way)"
    )


def step_phases(
    m: ModelConfig,
    ac: ActivationCheckpointingConfig,
    lay: Layout,
    n: ParamCounts,
    gpu: dict[str, float],
    num: Numerics,
) -> tuple[dict[str, dict[str, float]], float, float]:
    """(bytes alive at each moment a step can peak, by category, the largest activations, the
    largest temporaries) given the model states in `gpu` (params, grads, optimizer). The
    categories are those `measure.LiveStorages` gives what it sees: the backends' transient
    gradient buffers (reduce buckets, reduce-scatter inputs, unsharded gradients) are
    gradients, their gathered parameters parameters, what the forward (or a recomputation)
    keeps activations, and the work of the moment (the loss's chunk, the logits' gradient, a
    block's backward, the optimizer's own) temporaries.

    The parts do not peak together: gradients are absent at the start of the first backward
    (`zero_grad(set_to_none=True)`) and complete only at its end, activations are freed block by
    block as the backward walks down. With grad_accum > 1 the gradients of the earlier
    micro-steps are there throughout (the last micro-step is the fullest); DDP's buckets and
    ZeRO-3's reduce bucket and flat gradient partition exist from the start whatever the
    accumulation, ZeRO-1/2's reduce buckets only through a backward.
    - loss forward / loss: all that the forward saved (the kept logits too) and the loss's own
      work: one fp32 chunk's log-softmax, or in backward the logits' gradient and its chunk;
    - block i (from the top): the gradients so far (the head and the blocks above, or their
      shards), what the blocks below keep, block i's activations (kept or recomputed) less its
      MLP product, and the gradients in flight inside it; under FSDP2 the gathered parameters
      and in-flight gradients of that moment (`fsdp_gathered_params`);
    - step: all gradients (fused AdamW, on every device, updates in place: no temporaries).
    """
    B, L = lay.micro_batch, m.n_layers
    loss_params = gpu["params"]  # the parameters held through the loss
    grads = gpu["grads"]
    bytes_per_grad, shard = 4.0, 1.0
    persistent = grads
    # the gradient a block's backward has made by its peak: the MLP down-projection's weight
    # gradient, in the parameters' dtype, where it is kept as made (FSDP2's unsharded
    # gradients; a first micro-step's .grad); one added into a DDP bucket, a DeepSpeed bucket
    # or an earlier micro-step's .grad is freed by then (measured on 2 gloo ranks)
    c = lay.working_bytes if lay.backend in ("fsdp", "deepspeed") else 4  # (else fp32 params)
    fsdp = lay.backend == "fsdp"
    kept_as_made = fsdp or (
        lay.backend != "deepspeed"
        and not (lay.backend == "ddp" and lay.ddp_bucket_view)
        and lay.grad_accum == 1
    )
    this_block = c * m.d_model * (mlp_hidden_size(m) // lay.tp) if kept_as_made else 0.0
    # a tied head's gradient waits inside autograd (a temporary) until the embedding's
    # backward adds its part, at the end of the backward; an untied head's is a gradient
    embed = m.vocab_size // lay.tp * m.d_model
    waiting = c * embed if m.tie_embeddings else 0.0
    if fsdp:
        persistent = grads - fsdp_unsharded_grads(n, lay, max(n.block, n.root))
        shard = 0.0 if lay.fsdp_offload else 1.0 / lay.shards  # offload: shards on the host
        sharded_params = gpu["params"] - fsdp_gathered_params(n, lay, "largest")
    buckets = ds_reduce_buckets(lay)
    carry = persistent if (lay.grad_accum > 1 or lay.backend == "ddp") else 0.0  # DDP: buckets
    if lay.backend == "deepspeed":  # the reduce buckets from the first backward on; the fp32
        # gradient partition (16-bit modes) only for the step
        half, partitioned = lay.precision != "fp32", lay.zero_stage >= 1
        stepped_in_fp32 = half and partitioned and not lay.offload_optimizer
        fp32_part = 4 * n.total / lay.world if stepped_in_fp32 else 0.0
        carry = buckets + (persistent - buckets - fp32_part if lay.grad_accum > 1 else 0.0)
        if lay.zero_stage >= 3:  # its flat gradient partition exists from the start
            carry = persistent - fp32_part
        if lay.zero_stage == 1 and lay.grad_accum > 1:  # whole gradients until the last
            carry -= c * n.total / lay.world  # micro-step's reduction makes the partition
        # gradients land in 16 bits (partitioned from ZeRO-1 on), next to the buckets
        bytes_per_grad = 2.0 if half else 4.0
        shard = 1.0 / lay.world if partitioned else 1.0
    resident = resident_input_bytes(m, B)
    kept = kept_per_block(m, ac, B, num)
    full_block = block_activation_bytes(m, B, num)
    loss_bwd = loss_backward_bytes(m, B, num)
    in_block = block_backward_bytes(m, B, num)
    saved = saved_activation_bytes(m, ac, B, num)  # incl. the logits the loss keeps
    activations = saved
    # autocast caches its bf16 weight copies until the forward's autocast region ends: for the
    # checkpointed blocks (whose copies are not saved for backward) they are extra until then
    cast_cache = 2 * block_matmul_params(m) * checkpointed_count(m, ac) if num.autocast else 0
    if fsdp:
        loss_params = sharded_params + fsdp_gathered_params(n, lay, "loss")
    # ZeRO-1/2 allocate their reduce buckets at a backward's first gradient (an untied head's
    # as the loss's backward ends; a tied head's waits, so the final norm's) and free them
    # after it; ZeRO-3 holds its one from the start
    per_backward = buckets if lay.backend == "deepspeed" and lay.zero_stage in (1, 2) else 0.0
    # ZeRO-1 with accumulation keeps them from the first micro-step's backward to the last's
    # reduction: the last micro-step's forward and loss have them (measured on 2 gloo ranks)
    kept_buckets = lay.zero_stage == 1 and lay.grad_accum > 1
    loss_carry = carry - (0.0 if kept_buckets else per_backward)

    def at(params: float, grads: float, activations: float, temporaries: float):
        return {
            "params": params,
            "grads": grads,
            "optimizer": gpu["optimizer"],
            "activations": activations,
            "temporaries": temporaries,
        }

    phases = {
        "loss forward": at(
            loss_params, loss_carry, saved + cast_cache, loss_forward_bytes(m, B, num)
        ),
        "loss backward": at(loss_params, loss_carry, saved, loss_bwd),
    }
    head = (0 if m.tie_embeddings else embed) + m.d_model  # the head's and final norm's
    # a block's backward peaks at its MLP's product's backward: by then the product itself (the
    # down-projection's input) is freed, and the three hidden-width gradients are alive
    product = num.compute * B * m.seq_len * (mlp_hidden_size(m) // lay.tp)
    for i in reversed(range(L)):
        transient = this_block
        if fsdp:  # the root's unsharded gradients so far (the head's; reduced at the end of
            # the backward), the shards of the blocks above, and the block above's fp32
            # reduce-scatter input (FSDP2 keeps one until the next reduce-scatter)
            transient += c * head + (4.0 * n.block if i < L - 1 else 0.0)
            so_far = 4.0 * shard * (L - 1 - i) * n.block
            params_now = sharded_params + fsdp_gathered_params(n, lay, i)
        else:
            made = head + (L - 1 - i) * n.block  # gradient elements so far
            if buckets:  # ZeRO: in the buckets until one fills and is reduced into the partition
                made = made // lay.ds_bucket_elements * lay.ds_bucket_elements
            so_far = bytes_per_grad * shard * made + buckets
            params_now = gpu["params"]
        so_far = min(so_far, persistent)  # never more than the step holds
        alive = resident + sum(kept[:i]) + full_block
        activations = max(activations, alive)
        phases[f"block {i} backward"] = at(
            params_now, max(carry, so_far) + transient, alive - product, in_block + waiting
        )
    step_params = sharded_params if fsdp else gpu["params"]  # FSDP: all resharded by now
    if lay.backend == "deepspeed" and lay.zero_stage >= 3:  # released after the backward
        step_params -= zero3_gathered_params(n, lay)
    step_grads = persistent - per_backward
    phases["optimizer step"] = at(step_params, step_grads, 0.0, 0.0)  # fused AdamW: in place
    return phases, activations, max(loss_bwd, in_block)


def estimate(cfg: Config, target: RunPlan | int) -> Estimate:
    """Per-GPU bytes of `cfg` run as `target`: the run's own plan, or a world size of
    bf16-capable GPUs (`scale_llm.config.plan.target_plan`)."""
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
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value):  # (a 400-digit number)
        raise UserError(f"memory size {text!r} is too large to be a memory size; e.g. --fit 80GiB")
    return int(value)


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
