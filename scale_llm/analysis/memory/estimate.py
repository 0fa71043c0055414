"""Per-GPU bytes of model states for each backend layout, and the whole estimate; for ZeRO-1/2's
optimizer offload also its host buffers (as torch's pinned allocator rounds them) and the bytes
it copies between host and GPU per step."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from scale_llm.analysis.memory.activations import (
    Numerics,
    block_activation_bytes,
    block_backward_bytes,
    block_matmul_params,
    checkpointed_count,
    fp8_cast_bytes,
    head_activation_bytes,
    kept_per_block,
    loss_backward_bytes,
    loss_forward_bytes,
    numerics_for,
    resident_input_bytes,
    widths,
)
from scale_llm.config import ActivationCheckpointingConfig, Config, ModelConfig, compiles
from scale_llm.config.fp8 import fp8_all_gathers
from scale_llm.config.plan import RunPlan
from scale_llm.config.sections import mlp_hidden_size
from scale_llm.errors import UserError, short
from scale_llm.model.attention import choose
from scale_llm.parallel.ds_config import deepspeed_config

GiB = 1 << 30
OVERHEAD_FRACTION = 0.05
PARTS = ("params", "grads", "optimizer", "activations", "temporaries")


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
    ds_comm_dtype: str | None = None  # communication_data_type (None: the params')
    pinned_round_limit: int | None = None  # bytes: larger pinned blocks are not rounded up
    tp: int = 1  # tensor parallelism: each rank holds 1/tp of every matmul weight
    sequence_parallel: bool = False
    replicate: int = 1  # HSDP: data-parallel groups that each hold a whole sharded copy
    pp: int = 1  # pipeline parallelism: groups of ranks that each hold some stages
    holds_embedding: bool = True  # a pipeline rank without the first stage has no embedding
    holds_head: bool = True  # ... without the last no final norm, head or loss
    fp8: str = ""  # train.fp8's recipe (tensorwise | rowwise); "": off
    dense_mask: bool = False  # the document mask reaches attention as (B, 1, T, T) bools
    fp8_gather: bool = False  # FSDP2 gathers the blocks' linear weights in fp8 (1 byte)
    compiled: bool = True  # compiled blocks: fp8's casts fuse into their fp8 outputs

    @property
    def shards(self) -> int:
        """Ranks one FSDP2 unit's states are sharded over: the world over tp, pp and replicas."""
        return self.world // (self.tp * self.replicate * self.pp)

    @property
    def working_bytes(self) -> int:
        """Bytes per element of a 16-bit working copy (fp32 runs: 4)."""
        return 2 if self.precision != "fp32" else 4

    def numerics(self) -> Numerics:
        """How this layout's tensors are stored (a pipeline's loss gathers the vocabulary)."""
        sp, fp8, whole = self.sequence_parallel, bool(self.fp8), self.pp > 1
        return numerics_for(
            self.precision,
            self.backend,
            self.fused_norm,
            self.tp,
            sp,
            fp8,
            whole_logits=whole,
            dense_mask=self.dense_mask,
        )

    def describe(self) -> str:
        extra = ""
        if self.backend == "deepspeed":
            extra = f" ZeRO-{self.zero_stage}"
            extra += " + optimizer offload" if self.offload_optimizer else ""
            extra += " + param offload" if self.offload_param else ""
        elif self.backend == "fsdp":
            extra = " (reshard_after_forward)" if self.reshard_after_forward else " (no reshard)"
            extra += " + cpu offload" if self.fsdp_offload else ""
        if self.tp > 1:
            extra += f" x tensor parallel {self.tp}"
            extra += " (sequence parallel)" if self.sequence_parallel else ""
        if self.pp > 1:
            extra += f" x pipeline parallel {self.pp}"
        fp8 = f" + fp8 {self.fp8} linears" if self.fp8 else ""
        return f"{self.backend}{extra}, world {self.world}, {self.precision}{fp8}"


def layout_of(cfg: Config, plan: RunPlan) -> Layout:
    p, fp8 = cfg.parallel, cfg.train.fp8
    linears = fp8.enabled and plan.backend in ("single", "fsdp")  # (the ones taking fp8 linears)
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
        dense_mask=_dense_mask(cfg.model, plan),
        ddp_bucket_view=p.ddp.gradient_as_bucket_view,
        ds_bucket_elements=_elements(zero, "reduce_bucket_size", 5e8, least=1),
        ds_overlap_comm=bool(zero.get("overlap_comm", False)),
        ds_max_live=_elements(zero, "stage3_max_live_parameters", 1e9),
        ds_persistence_threshold=_elements(zero, "stage3_param_persistence_threshold", 1e5),
        # DeepSpeed's CPU accelerator pins nothing (its pin_memory returns the tensor)
        ds_pin_memory=plan.device.type == "cuda"
        and bool((zero.get("offload_optimizer") or {}).get("pin_memory", False)),
        ds_grad_accum_dtype=_dtype_name((ds.get("data_types") or {}).get("grad_accum_dtype")),
        ds_comm_dtype=_dtype_name(ds.get("communication_data_type")),
        pinned_round_limit=pinned_round_limit(os.environ),
        tp=plan.tp_degree,
        replicate=plan.replicate_degree,
        pp=plan.pp_degree,
        sequence_parallel=plan.tp_degree > 1 and p.sequence_parallel,
        fp8=fp8.recipe if linears else "",
        fp8_gather=linears and plan.backend == "fsdp" and fp8_all_gathers(fp8),
        compiled=compiles(cfg.train, "cuda") if linears else True,
    )


def _dense_mask(m: ModelConfig, plan: RunPlan) -> bool:
    """Whether attention gets the document mask as a (B, 1, T, T) tensor (the CPU; on a GPU,
    fp32 or a head size FlashAttention cannot take): `model.attention.choose`'s pick."""
    if m.attention_mask != "document" or m.attention == "eager":
        return False
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision, torch.float32)
    gqa = (m.n_kv_heads or m.n_heads) != m.n_heads
    return choose(plan.device.type, dtype, True, gqa, m.d_model // m.n_heads).dense_mask


def _elements(zero: dict[str, Any], key: str, default: float, least: int = 0) -> int:
    """A count of elements in DeepSpeed's zero_optimization, read as its config model reads it:
    under its name or the one without `stage3_`, "auto" for the default, a whole number."""
    value = zero.get(key, zero.get(key.removeprefix("stage3_"), default))
    value = default if value == "auto" else value
    whole = isinstance(value, int) and not isinstance(value, bool)
    whole = whole or (isinstance(value, float) and value.is_integer())
    if not whole or value < least:
        raise UserError(
            f"parallel.deepspeed.config.zero_optimization.{key}={short(value)} is not a count "
            f"of elements; give a whole number >= {least} (DeepSpeed's default: "
            f"{int(default):,}), or remove it"
        )
    return int(value)


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
    def of(m: ModelConfig, tp: int = 1, embedding: bool = True, head: bool = True) -> ParamCounts:
        """The model's parameters, or one rank's under tensor parallelism `tp`: 1/tp of every
        matmul weight and of the embedding and head, the norms whole; a pipeline rank's holds
        the `embedding` (the first stage's) and the final norm and `head` (the last's) or not."""
        g = widths(m, tp)
        d, F, embed = g["d"], g["F"], g["V"] * g["d"]
        qkv = d * (g["dq"] + 2 * g["dkv"])
        block_tensors = (qkv, g["dq"] * d, d * F, d * F, F * d, d, d)  # wqkv wo w1 w3 w2, 2 norms
        root_tensors = (embed, d) if m.tie_embeddings else (embed, embed, d)
        if not (embedding and head):  # (a pipeline's stages: the head is never tied there)
            root_tensors = ((embed,) if embedding else ()) + ((embed, d) if head else ())
        per_block, root = sum(block_tensors), sum(root_tensors)
        total = root + m.n_layers * per_block
        return ParamCounts(total, per_block, root, m.n_layers, block_tensors, root_tensors)


def state_bytes(n: ParamCounts, lay: Layout) -> tuple[dict[str, float], dict[str, float]]:
    """(gpu, cpu) bytes for params, grads and optimizer under the layout."""
    P = n.total
    if lay.backend == "fsdp":  # sharded fp32 params / grads / Adam moments, gathered c-byte
        # params at their largest; no-sync accumulation keeps every gradient unsharded
        unsharded = fsdp_unsharded_grads(n, lay)
        if lay.grad_accum > 1 and not lay.fsdp_reduce_every:
            unsharded += 4 * P  # fp32 (the reduce dtype) until the last micro-step's reduction
        gpu = {"params": fsdp_gathered_params(n, lay, "largest"), "grads": unsharded}
        gpu["optimizer"], cpu = 0.0, dict.fromkeys(("params", "grads", "optimizer"), 0.0)
        target = cpu if lay.fsdp_offload else gpu
        for k, per_param in (("params", 4), ("grads", 4), ("optimizer", 8)):
            target[k] += per_param * P / lay.shards
        return gpu, cpu
    if lay.backend == "deepspeed":
        return _deepspeed_states(n, lay, lay.working_bytes, lay.precision != "fp32")
    # single / ddp: fp32 params and grads, AdamW moments; DDP's buckets hold the gradients with
    # gradient_as_bucket_view (no_sync() accumulates into them too), else buckets and .grad: 2x
    grads = 8 * P if lay.backend == "ddp" and not lay.ddp_bucket_view else 4 * P
    return {"params": 4 * P, "grads": grads, "optimizer": 8 * P}, {}


def fsdp_gathered_params(n: ParamCounts, lay: Layout, at: int | str) -> float:
    """FSDP2's gathered parameters while block `at` runs its backward, during the "loss", or at
    their "largest" (2 gloo ranks, fake traces at 8): resharded, the block computing, the root from
    its pre-backward on and the prefetched block below; else all to the loss, then root, 0..i."""
    c = lay.working_bytes
    matmul = sum(n.block_tensors[:5]) if lay.fp8_gather else 0  # wqkv wo w1 w3 w2 gather in fp8
    root, block = c * n.root, float(matmul + c * (n.block - matmul))
    if not lay.reshard_after_forward:
        every = root + n.layers * block
        if at == "largest":
            return every + block
        return every if at == "loss" else root + (int(at) + 1) * block
    if at == "largest":
        return root + block + max(block, root)
    if at == "loss":  # measured on 2 gloo ranks (the live storages, by owner)
        return block
    return root + (2 if int(at) > 0 else 1) * block


def fsdp_unsharded_grads(n: ParamCounts, lay: Layout) -> float:
    """FSDP2's unsharded gradients of its largest unit before their reduce-scatter (16-bit, and
    the fp32 reduce-scatter input)."""
    return float((lay.working_bytes + 4) * max(n.block, n.root))


def ds_reduce_buckets(lay: Layout) -> float:
    """Bytes of DeepSpeed's gradient reduce buckets (ZeRO >= 1), whatever the model's size:
    reduce_bucket_size elements each, two with overlap_comm in ZeRO-1/2, one in ZeRO-3."""
    if lay.backend != "deepspeed" or lay.zero_stage < 1:
        return 0.0
    count = 1 if lay.zero_stage >= 3 else (2 if lay.ds_overlap_comm else 1)
    # ZeRO-3 makes its bucket in the communication dtype, ZeRO-1/2 in the parameters'
    width = 4 if lay.zero_stage >= 3 and lay.ds_comm_dtype == "fp32" else lay.working_bytes
    return float(count * width * lay.ds_bucket_elements)


def zero3_gathered_params(n: ParamCounts, lay: Layout) -> float:
    """ZeRO-3's working-dtype parameters held whole beyond this rank's partition until the step:
    those under stage3_param_persistence_threshold, and up to stage3_max_live_parameters the
    coordinator keeps gathered (at least the root and a block; 2 gloo ranks, DeepSpeed 0.19)."""
    small = lay.ds_persistence_threshold
    small_block = sum(t for t in n.block_tensors if t < small)
    small_root = sum(t for t in n.root_tensors if t < small)
    persistent = n.layers * small_block + small_root
    partitioned = n.total - persistent
    held = min(partitioned, max(lay.ds_max_live, (n.root - small_root) + (n.block - small_block)))
    return lay.working_bytes * (held + persistent * (1 - 1 / lay.world))


def _deepspeed_states(n: ParamCounts, lay: Layout, c: int, half: bool):
    """ZeRO: c-byte params and grads, fp32 master weights and two moments, partitioned by stage;
    from stage 1 in 16 bits the fp32 gradient partition the step reads. 2 gloo ranks."""
    P, W, s = n.total, lay.world, lay.zero_stage
    # fp32 master weights: in fp32 mode ZeRO-1/2/3 still keep a separate flat fp32 partition
    # (measured; ZeRO-3 clones it in _create_fp32_partitions); ZeRO-0 steps on the parameters
    optim = 12 * P / W if s >= 1 else (12 if half else 8) * P
    params = c * P / W + zero3_gathered_params(n, lay) if s >= 3 else c * P
    grads = c * P / W if s >= 1 else c * P
    if s >= 3 and lay.ds_grad_accum_dtype == "fp32":  # its flat gradient partition, in fp32
        grads = 4 * P / W
    if half and s >= 1 and not lay.offload_optimizer:
        grads += 4 * P / W  # the fp32 gradient partition the optimizer steps on
        if zero_offload_compact(lay):  # ... and the fp32 accumulation partition beside it
            grads += 4 * P / W
    grads += ds_reduce_buckets(lay)
    if s == 1 and lay.grad_accum > 1:  # ZeRO-1 accumulates whole gradients in .grad between
        grads += c * P  # micro-steps and partitions them at the boundary (measured: c x P more)
    gpu = {"params": params, "grads": grads, "optimizer": optim}
    cpu = dict.fromkeys(gpu, 0.0)
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


def optimizer_groups(n: ParamCounts) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Elements of each parameter of the optimizer's two groups, as DeepSpeed flattens them
    (`components.optim.param_groups`): matmul weights and an untied head (decayed); the rest."""
    embed, d = n.root_tensors[0], n.root_tensors[-1]
    matmuls, norms = n.block_tensors[:5], n.block_tensors[5:]
    head = () if len(n.root_tensors) == 2 else (embed,)  # (embed, d) when tied
    return matmuls * n.layers + head, (embed,) + norms * n.layers + (d,)


@dataclass(frozen=True)
class RankPartition:
    """One rank's share of a flattened parameter group under ZeRO-1/2 (`get_partition_info`):
    padded to a multiple of 2 x world, cut in `world`; a parameter is in each it overlaps."""

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
    """ZeRO-2 accumulates a step's gradients in an fp32 partition on the GPU
    (`_use_compact_grad_partition_buffer`) with grad_accum_dtype fp32 and 16-bit parameters (the
    generated config's bf16 choice); else offload sums on the host. (ZeRO-1's: not asked for.)"""
    return lay.zero_stage == 2 and lay.ds_grad_accum_dtype == "fp32" and lay.precision != "fp32"


def zero_offload_accumulates(lay: Layout) -> bool:
    """Whether ZeRO-Offload accumulates gradients on the host (`accumulated_grads_in_cpu`):
    ZeRO-2 with grad_accum > 1 unless compact; ZeRO-1 reduces only at a step's last micro-step."""
    return lay.zero_stage == 2 and lay.grad_accum > 1 and not zero_offload_compact(lay)


def zero_offload_host_blocks(n: ParamCounts, lay: Layout, rank: int = 0) -> dict[str, list[int]]:
    """Each host allocation of ZeRO-1/2's optimizer offload on `rank` (stage_1_and_2.py, 0.19),
    per group: the fp32 master partition, its `.grad`, the 16-bit staging copy, accumulators
    (pinned); CPUAdam's two moments (pageable); once, `temp_grad_buffer_for_cpu_offload`."""
    c, groups = lay.working_bytes, optimizer_groups(n)
    blocks = {k: [] for k in ("master", "grads", "moments", "staging", "accumulators")}
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


def zero_offload_host(n: ParamCounts, lay: Layout) -> dict[str, float]:
    """Rank 0's host bytes of ZeRO-1/2 optimizer offload by the report's parts, with `pinned
    rounding`: what torch's pinned allocator adds to the pinned blocks (none unpinned)."""
    blocks = zero_offload_host_blocks(n, lay)
    pinned = [b for name in PINNED_BLOCKS for b in blocks[name]] if lay.ds_pin_memory else []
    rounding = sum(pinned_block_bytes(b, lay.pinned_round_limit) - b for b in pinned)
    host = {"optimizer": float(sum(blocks["master"]) + sum(blocks["moments"]))}
    host |= {k: float(sum(blocks[k])) for k in ("grads", "staging", "accumulators", "copy buffer")}
    return host | {"pinned rounding": float(rounding)}


def zero_offload_gpu_grads(n: ParamCounts, lay: Layout) -> float:
    """ZeRO-1/2 with optimizer offload keeps no 16-bit gradient partition on the GPU: a reduced
    gradient leaves through `temp_grad_buffer_for_gpu_offload` (the largest parameter), plus
    with `zero_offload_compact` an fp32 accumulation partition per group."""
    groups, compact = optimizer_groups(n), zero_offload_compact(lay)
    fp32 = sum(4 * RankPartition.of(g, lay.world, 0).elements for g in groups) if compact else 0
    return float(lay.working_bytes * max(max(sizes) for sizes in groups) + fp32)


def zero_offload_traffic(n: ParamCounts, lay: Layout, rank: int = 0) -> dict[str, dict[str, float]]:
    """Host <-> GPU bytes per step on `rank` under ZeRO-1/2 optimizer offload, by direction and
    reason: fp32 gradients out, parameters back, and when it accumulates on the host each
    overlapping parameter's gradient out on all N micro-steps and back on all but the first."""
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


def pinned_block_bytes(nbytes: int, round_limit: int | None = None) -> int:
    """The bytes torch's pinned host allocator takes for `nbytes`: the next power of two
    (CachingHostAllocator.h, torch 2.13; never split or shared) up to `round_limit`."""
    if nbytes <= 0 or (round_limit is not None and nbytes > round_limit):
        return max(nbytes, 0)
    return 1 << (nbytes - 1).bit_length()


def pinned_round_limit(environ: Mapping[str, str]) -> int | None:
    """Bytes above which torch's pinned allocator does not round a block up (None: it rounds
    every block): `pinned_max_round_threshold_mb` / `pinned_max_cached_size_mb`, read as torch
    (2.13) reads them: from PYTORCH_CUDA_ALLOC_CONF if set, else PYTORCH_ALLOC_CONF."""
    settings = environ.get("PYTORCH_CUDA_ALLOC_CONF", environ.get("PYTORCH_ALLOC_CONF", ""))
    pairs = re.findall(r"(?:^|,)\s*(\w+)\s*:\s*(\d+)", settings)
    keys = ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")
    return min((int(mib) << 20 for key, mib in pairs if key in keys), default=None)


@dataclass
class Estimate:
    """Per-GPU bytes: `gpu` each part at its own largest over the step, `peak` (the largest
    sum of `phases`) and `total` (the peak plus `overhead`); `parts` each phase's parts."""

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
    startup_host: float = 0.0  # one rank's host bytes while the model is built
    # a pipeline: each pipeline rank's own estimate; this one is the worst (`pipeline_rank`'s)
    pipeline_ranks: list[Estimate] = field(default_factory=list)
    pipeline_rank: int = 0

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
        peaks = [int(r.gpu["peak"]) for r in self.pipeline_ranks]
        pipeline = {"pipeline_rank": self.pipeline_rank, "pipeline_rank_peaks": peaks}
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
            **(pipeline if peaks else {}),
            "activation_checkpointing": self.ac.mode,
            "attention": self.model.attention,
        }


def estimate_layout(
    m: ModelConfig,
    ac: ActivationCheckpointingConfig,
    lay: Layout,
    flags: Sequence[bool] | None = None,
) -> Estimate:
    """One rank's estimate for `m`'s blocks; `flags`: which are checkpointed, where not as `ac`
    picks them by their index in `m` (a pipeline rank's blocks: `checkpointed_flags`)."""
    n = ParamCounts.of(m, lay.tp, lay.holds_embedding, lay.holds_head)
    gpu, cpu = state_bytes(n, lay)
    parts, gpu["activations"], gpu["temporaries"] = step_phases(m, ac, lay, n, gpu, flags)
    for k in ("activations", "temporaries"):  # (autocast's weight cache, a tied head's gradient)
        gpu[k] = max(gpu[k], *(p[k] for p in parts.values()))
    phases = phase_totals(parts, gpu)
    offload = lay.backend == "deepspeed" and lay.offload_optimizer and lay.zero_stage in (1, 2)
    traffic = zero_offload_traffic(n, lay) if offload else {}
    total = ParamCounts.of(m).total  # the model's, not one tensor-parallel rank's
    host = startup_host_bytes(m, n, lay)
    return Estimate(total, lay, m, ac, gpu, cpu, phases, parts, traffic, host)


def phase_totals(parts: dict[str, dict[str, float]], gpu: dict[str, float]) -> dict[str, float]:
    """Each phase's bytes (the sum of its `parts`); `gpu`'s peak (the largest), allocator
    allowance and total set from them."""
    phases = {name: sum(p.values()) for name, p in parts.items()}
    gpu["peak"] = max(phases.values())
    gpu["overhead"] = OVERHEAD_FRACTION * gpu["peak"]
    gpu["total"] = gpu["peak"] + gpu["overhead"]
    return phases


def startup_host_bytes(m: ModelConfig, n: ParamCounts, lay: Layout) -> float:
    """One rank's host bytes while the model is built: FSDP2 and tensor parallelism fill their
    fp32 shards one whole parameter at a time (with a reader's copy of it from init_from or a
    checkpoint); the other backends build the whole fp32 model on the CPU first."""
    whole = ParamCounts.of(m)
    if lay.backend != "fsdp":
        return 4.0 * whole.total
    return 4.0 * n.total / lay.shards + 2 * 4.0 * max(whole.block_tensors + whole.root_tensors)


# PCIe 5.0 x16, each way: 16 lanes x 32 GT/s x 128/130 (encoding) / 8 bits
PCIE5_X16_BYTES_PER_S = 16 * 32e9 * 128 / 130 / 8


def format_offload_traffic(est: Estimate) -> str:
    """The report's line for the offload's host <-> GPU bytes per optimizer step and their
    least time over PCIe 5.0 x16 (issued one after another); "" without ZeRO-1/2 offload."""
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
    flags: Sequence[bool] | None = None,
) -> tuple[dict[str, dict[str, float]], float, float]:
    """(bytes alive by category at each moment a step can peak: the loss's forward and backward,
    each block's backward, the optimizer step; the largest activations; the largest
    temporaries), given the states in `gpu`, in `LiveStorages`' categories (docs/memory.md)."""
    B, L, num = lay.micro_batch, m.n_layers, lay.numerics()
    loss_params = gpu["params"]  # the parameters held through the loss
    bytes_per_grad, shard, persistent = 4.0, 1.0, gpu["grads"]
    # the gradient a block's backward has made by its peak: the MLP down-projection's, where
    # it is kept as made (FSDP2's unsharded gradients, a first micro-step's .grad); one added
    # into a bucket or an earlier .grad is freed by then (measured on 2 gloo ranks)
    c = lay.working_bytes if lay.backend in ("fsdp", "deepspeed") else 4  # (else fp32 params)
    fsdp = lay.backend == "fsdp"
    bucketed = lay.backend == "deepspeed" or (lay.backend == "ddp" and lay.ddp_bucket_view)
    kept_as_made = fsdp or (not bucketed and lay.grad_accum == 1)
    this_block = c * m.d_model * (mlp_hidden_size(m) // lay.tp) if kept_as_made else 0.0
    # a tied head's gradient waits in autograd (a temporary) until the embedding's backward
    embed = m.vocab_size // lay.tp * m.d_model
    waiting = c * embed if m.tie_embeddings else 0.0
    if fsdp:
        persistent -= fsdp_unsharded_grads(n, lay)
        shard = 0.0 if lay.fsdp_offload else 1.0 / lay.shards  # offload: shards on the host
        sharded_params = gpu["params"] - fsdp_gathered_params(n, lay, "largest")
        loss_params = sharded_params + fsdp_gathered_params(n, lay, "loss")
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
    kept = kept_per_block(m, ac, B, num, flags)
    full_block = block_activation_bytes(m, B, num)
    loss_bwd = loss_backward_bytes(m, B, num)
    in_block = block_backward_bytes(m, B, num)
    # incl. the logits the loss keeps; a pipeline stage before the last: its blocks' and inputs
    saved = sum(kept) + (head_activation_bytes(m, B, num) if lay.holds_head else resident)
    activations = saved
    # autocast caches its bf16 weight copies until the forward ends: extra for checkpointed
    # blocks (fp8 linears cast their weights themselves)
    recomputed = checkpointed_count(m, ac, flags)
    cast_cache = 2 * block_matmul_params(m) * recomputed if num.autocast and not num.fp8 else 0
    fp8_casts = fp8_cast_bytes(m, B, num, lay.fp8, lay.compiled)  # beside a block's backward
    # ZeRO-1/2 allocate their reduce buckets at a backward's first gradient and free them after
    # it; ZeRO-3 holds its one from the start
    per_backward = buckets if lay.backend == "deepspeed" and lay.zero_stage in (1, 2) else 0.0
    # ZeRO-1 with accumulation keeps them from the first micro-step's backward to the last's
    # reduction: the last micro-step's forward and loss have them (measured on 2 gloo ranks)
    kept_buckets = lay.zero_stage == 1 and lay.grad_accum > 1
    loss_carry = carry - (0.0 if kept_buckets else per_backward)

    def at(params: float, grads: float, activations: float, temporaries: float):
        return dict(zip(PARTS, (params, grads, gpu["optimizer"], activations, temporaries)))

    phases, head = {}, 0  # (a pipeline stage before the last computes no loss)
    if lay.holds_head:
        head = (0 if m.tie_embeddings else embed) + m.d_model  # the head's and final norm's
        fwd = loss_forward_bytes(m, B, num)
        phases["loss forward"] = at(loss_params, loss_carry, saved + cast_cache, fwd)
        phases["loss backward"] = at(loss_params, loss_carry, saved, loss_bwd)
    # a block's backward peaks at its MLP product's backward: the product is freed by then
    product = num.compute * B * m.seq_len * (mlp_hidden_size(m) // lay.tp)
    temporaries = in_block + waiting + fp8_casts
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
        grads_now = max(carry, so_far) + transient
        phases[f"block {i} backward"] = at(params_now, grads_now, alive - product, temporaries)
    step_params = sharded_params if fsdp else gpu["params"]  # FSDP: all resharded by now
    if lay.backend == "deepspeed" and lay.zero_stage >= 3:  # released after the backward
        step_params -= zero3_gathered_params(n, lay)
    phases["optimizer step"] = at(step_params, persistent - per_backward, 0.0, 0.0)  # in place
    if lay.backend == "deepspeed" and zero_offload_compact(lay) and not lay.offload_optimizer:
        # the end of a backward's reduction into the fp32 partition: the reduced bucket in fp32
        # and its 16-bit copy, less this rank's part, beside everything else (fitted on 2 and 4
        # gloo ranks, DeepSpeed 0.19.8: 6 x (1 - 1/world) bytes a gradient element, exact)
        moving = min(n.total, lay.ds_bucket_elements) * 6 * (1 - 1 / lay.world)
        phases["gradient reduction"] = at(gpu["params"], persistent + moving, 0.0, 0.0)
    return phases, activations, max(loss_bwd, in_block)


# b; kb, mb, gb, tb (powers of 1000); kib, mib, gib, tib (powers of 1024)
_UNITS = {"b": 1, **{f"{p}b": 10 ** (3 * i) for i, p in enumerate("kmgt", 1)}}
_UNITS |= {f"{p}ib": 1 << (10 * i) for i, p in enumerate("kmgt", 1)}


def parse_bytes(text: str, bare: bool = False) -> int:
    """'80GiB' -> bytes. Units: B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (1024);
    a number without one is bytes only with `bare` or from 1 MiB (`--fit 80` is a mistake)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = (m.group(2) or "b").lower() if m else ""
    if not m or unit not in _UNITS:
        raise UserError(
            f"memory size {text!r} is not understood; write a number with one of the "
            f"units B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers "
            f"of 1024), e.g. --fit 80GiB"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not (m.group(2) or bare) and value < 2**20:  # (`--fit 80`: 80 bytes, nothing fits)
        raise UserError(f"memory size {text!r} has no unit: write one, e.g. {text.strip()}GiB")
    if not math.isfinite(value):  # (a 400-digit number)
        raise UserError(f"memory size {text!r} is too large to be a memory size; e.g. --fit 80GiB")
    return int(value)


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
