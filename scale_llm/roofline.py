"""`scale-llm bench CONFIG --roofline`: where the time of one training step goes, on paper.

One micro-batch forward + backward of the config's model runs on the meta device (no memory, no
compute) in the compute dtype (bf16 weights, as autocast / FSDP's policy compute), under a
dispatch mode that counts, for every aten op, its FLOPs (torch's FLOP registry) and the bytes it
reads and writes (inputs + outputs, i.e. no fusion). Attention is counted as a flash kernel
would run it (causal: half the T x T work; reads Q, K, V, writes O; backward 2.5x the forward
FLOPs), not as the meta device's math fallback. The loss is the plain fp32 cross-entropy
(what `train.compile`, on in the GPU configs, compiles; eager runs use the chunked form, which
trades a second read of the logits for memory). The AdamW step is added analytically (fused:
reads param, grad, two moments; writes param and moments, all fp32) once per optimizer step.
Under DeepSpeed ZeRO-1/2 with `offload_optimizer: cpu` the step runs on the CPU instead (its
time is not modelled: it depends on the host), and the copies between host and GPU take its
row: the estimator's bytes per step (`zero_offload_traffic`, by direction and reason) over
PCIe 5.0 x16, counted whole in both totals (an upper bound: DeepSpeed issues the gradients'
copies on its reduction stream during the last micro-step's backward).

Each op class then takes max(FLOPs / peak FLOP/s, bytes / peak bandwidth): a roofline. Two
totals bound the step time: `eager` (every op's traffic, nothing fused or overlapped) and
`matmul-bound` (only matmuls, attention and the optimizer cost time: what perfect fusion of the
element-wise work would approach). MFU is computed from the model FLOPs (6N + attention) either
way, as the trainer reports it.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from scale_llm.components.loss import plain_cross_entropy
from scale_llm.config import Config
from scale_llm.memory.estimate import (
    PCIE5_X16_BYTES_PER_S,
    ParamCounts,
    layout_of,
    zero_offload_traffic,
)
from scale_llm.model import build_model
from scale_llm.parallel.activation_checkpointing import apply_activation_checkpointing
from scale_llm.plan import target_plan

# (name, dense bf16 FLOP/s, HBM bytes/s), from the vendors' data sheets
DEVICES = {
    "H100-SXM": (989e12, 3.35e12),
    "H200": (989e12, 4.8e12),
    "A100-80GB": (312e12, 2.04e12),
}
MATMUL_OPS = {"mm", "addmm", "bmm", "matmul", "linear"}
VIEWS = {  # ops that move no data (views, allocations)
    *("view", "_unsafe_view", "expand", "transpose", "t", "detach", "alias", "split"),
    *("split_with_sizes", "slice", "select", "unsqueeze", "squeeze", "permute", "as_strided"),
    *("empty", "empty_like", "new_empty", "unbind", "narrow", "lift_fresh"),
}
NVLINK_BYTES_PER_S = 450e9  # H100 / H200 SXM NVLink 4: 900 GB/s bidirectional per GPU


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if name in VIEWS:
            return out  # no data moves
        cls = _class_of(name)
        packet = func._overloadpacket
        if packet in flop_registry:
            self.flops[cls] += flop_registry[packet](*args, **kwargs, out_val=out)
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.bytes[cls] += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _class_of(name: str) -> str:
    if name in MATMUL_OPS:
        return "matmul"
    if "norm" in name:
        return "rms_norm"
    if "softmax" in name or "nll_loss" in name:
        return "loss"
    if name in ("embedding", "embedding_dense_backward"):
        return "embedding"
    return "element-wise and copies"


class _FlashAttention(torch.autograd.Function):
    """Stands in for a causal flash-attention kernel: records its FLOPs and bytes."""

    counter: _Counter | None = None

    @staticmethod
    def forward(ctx, q, k, v):  # (B, H, T, D)
        B, H, T, D = q.shape
        flops = 2 * B * H * T * T * D  # QK^T and AV, causal half: 2 x (2 B H T^2 D) / 2
        moved = 4 * q.numel() * q.element_size()  # read Q K V, write O
        _FlashAttention.counter.flops["attention"] += flops
        _FlashAttention.counter.bytes["attention"] += moved
        ctx.shape = (flops, moved)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        flops, moved = ctx.shape
        _FlashAttention.counter.flops["attention"] += 2.5 * flops  # dQ dK dV + recompute
        _FlashAttention.counter.bytes["attention"] += 2 * moved  # read Q K V O dO, write dQ dK dV
        return torch.empty_like(grad), torch.empty_like(grad), torch.empty_like(grad)


def count_micro_step(cfg: Config, micro_batch: int) -> tuple[dict[str, float], dict[str, float]]:
    """(FLOPs, bytes) by op class of one micro-batch forward + backward, bf16 compute."""
    model = build_model(cfg.model).to(torch.bfloat16)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)  # recompute is counted
    counter = _Counter()
    _FlashAttention.counter = counter

    def sdpa(q, k, v, **kwargs):
        if k.size(1) != q.size(1):  # grouped-query attention: the kernel reads fewer K / V
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return _FlashAttention.apply(q, k, v)

    tokens = torch.zeros((micro_batch, cfg.model.seq_len + 1), dtype=torch.long, device="meta")
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa
    try:
        with counter:
            loss = plain_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
    finally:
        F.scaled_dot_product_attention = original
    return dict(counter.flops), dict(counter.bytes)


def roofline(
    cfg: Config, micro_batch: int, grad_accum: int, device: str = "H100-SXM", world: int = 2
) -> dict[str, Any]:
    """The per-class roofline of one optimizer step (grad_accum micro-steps + one AdamW step)
    on one GPU of `device`, the MFU each bound implies, and the time DDP's gradient all-reduce
    over `world` GPUs on NVLink needs (overlapped with backward, so not added)."""
    peak, bandwidth = DEVICES[device]
    flops, moved = count_micro_step(cfg, micro_batch)
    n_params = build_model(cfg.model).num_params()
    rows = {}
    for cls in sorted(set(flops) | set(moved)):
        f, b = grad_accum * flops.get(cls, 0.0), grad_accum * moved.get(cls, 0.0)
        rows[cls] = {"flops": f, "bytes": b, "ms": 1e3 * max(f / peak, b / bandwidth)}
    traffic = offload_traffic(cfg, micro_batch, grad_accum, world)
    if traffic:  # the step runs on the CPU; the GPU waits for the copies
        copied = sum(sum(parts.values()) for parts in traffic.values())
        rows[OFFLOAD_ROW] = {
            "flops": 0.0,
            "bytes": copied,
            "ms": 1e3 * copied / PCIE5_X16_BYTES_PER_S,
        }
    else:
        opt_bytes = 28 * n_params  # fused AdamW, fp32: read p g m v, write p m v
        rows["optimizer (AdamW)"] = {
            "flops": 0.0,
            "bytes": opt_bytes,
            "ms": 1e3 * opt_bytes / bandwidth,
        }
    tokens = micro_batch * grad_accum * cfg.model.seq_len
    model_flops = build_model(cfg.model).flops_per_token() * tokens
    eager_ms = sum(r["ms"] for r in rows.values())
    bound = ("matmul", "attention", "optimizer (AdamW)", OFFLOAD_ROW)
    matmul_ms = sum(rows[c]["ms"] for c in bound if c in rows)
    grad_bytes = 4 * n_params  # fp32 gradients (autocast keeps fp32 params)
    ring = 2 * (world - 1) / world * grad_bytes  # bytes each GPU sends in a ring all-reduce
    return {
        "device": device,
        "allreduce_ms": 1e3 * ring / NVLINK_BYTES_PER_S if world > 1 else 0.0,
        "world": world,
        "micro_batch": micro_batch,
        "grad_accum": grad_accum,
        "tokens_per_step": tokens,
        "model_flops_per_step": model_flops,
        "classes": rows,
        "offload_bytes_per_step": traffic,
        "eager_ms": eager_ms,
        "matmul_bound_ms": matmul_ms,
        "mfu_eager": model_flops / (eager_ms / 1e3) / peak,
        "mfu_matmul_bound": model_flops / (matmul_ms / 1e3) / peak,
    }


OFFLOAD_ROW = "offload copies (PCIe)"


def offload_traffic(
    cfg: Config, micro_batch: int, grad_accum: int, world: int
) -> dict[str, dict[str, float]]:
    """Host <-> GPU bytes per optimizer step of ZeRO-1/2 optimizer offload, by direction and
    reason ({} for any other layout)."""
    ds = cfg.parallel.deepspeed
    if cfg.parallel.backend != "deepspeed" or ds.offload_optimizer != "cpu":
        return {}
    if ds.zero_stage not in (1, 2):
        return {}
    plan = dataclasses.replace(
        target_plan(cfg, world), micro_batch_size=micro_batch, grad_accum=grad_accum
    )
    return zero_offload_traffic(ParamCounts.of(cfg.model), layout_of(cfg, plan))


def format_roofline(r: dict[str, Any]) -> str:
    lines = [
        f"roofline on one {r['device']}: micro-batch {r['micro_batch']} x grad_accum "
        f"{r['grad_accum']} = {r['tokens_per_step']:,} tokens per step",
        "| op class | TFLOP | GB moved | ms (max of compute, memory) | bound by |",
        "|---|---|---|---|---|",
    ]
    peak, bandwidth = DEVICES[r["device"]]
    for cls, row in sorted(r["classes"].items(), key=lambda kv: -kv[1]["ms"]):
        by = "compute" if row["flops"] / peak >= row["bytes"] / bandwidth else "memory"
        lines.append(
            f"| {cls} | {row['flops'] / 1e12:.1f} | {row['bytes'] / 1e9:.1f} | "
            f"{row['ms']:.1f} | {by} |"
        )
    for way, parts in r.get("offload_bytes_per_step", {}).items():
        reasons = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in parts.items())
        lines.append(f"offload copies {way}: {sum(parts.values()) / 1e9:.2f} GB ({reasons})")
    if r.get("offload_bytes_per_step"):
        lines.append(
            f"({OFFLOAD_ROW}: at PCIe 5.0 x16's {PCIE5_X16_BYTES_PER_S / 1e9:.0f} GB/s each way, "
            f"one after another; the AdamW step on the CPU is not in the totals)"
        )
    lines.append(
        f"step: {r['eager_ms']:.0f} ms eager (MFU {r['mfu_eager']:.0%}) .. "
        f"{r['matmul_bound_ms']:.0f} ms matmul-bound (MFU {r['mfu_matmul_bound']:.0%}); "
        f"gradient all-reduce over {r['world']} GPUs on NVLink: {r['allreduce_ms']:.1f} ms "
        f"(overlapped with backward by DDP's buckets)"
    )
    return "\n".join(lines)
