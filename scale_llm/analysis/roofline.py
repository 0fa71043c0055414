"""`scale-llm bench CONFIG --roofline`: where the time of one training step goes, on paper.

One micro-batch forward + backward on the meta device in bf16, every aten op's FLOPs and bytes
counted (attention as a causal flash kernel, the loss as compiled fp32 cross-entropy), plus the
fused AdamW step (or ZeRO-1/2 offload's PCIe copies). Two bounds and a prediction at published
rates (`RATES`, each with its source): docs/performance.md, "How the prediction is made".
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from scale_llm.analysis.memory.activations import checkpointed_count, checkpointed_flags, widths
from scale_llm.analysis.memory.estimate import (
    PCIE5_X16_BYTES_PER_S,
    GiB,
    ParamCounts,
    layout_of,
    zero_offload_traffic,
)
from scale_llm.analysis.memory.gpu import estimate
from scale_llm.analysis.memory.pipeline import RUNTIME_UNSHARDS, rank_actions, runtime_unsharded
from scale_llm.components.loss import plain_cross_entropy
from scale_llm.config import Config, ModelConfig, compiles, load_config, with_changes
from scale_llm.config.load import shipped_config_dir
from scale_llm.config.parallel import V_SCHEDULES
from scale_llm.config.plan import RunPlan, target_plan
from scale_llm.errors import UserError
from scale_llm.model import build_model
from scale_llm.parallel.activation_checkpointing import apply_activation_checkpointing
from scale_llm.parallel.pipeline import stage_blocks, stage_owner

# (name, dense bf16 FLOP/s, HBM bytes/s), from the vendors' data sheets. H100-500W: Meta's Grand
# Teton H100 (96 GB HBM2e at 2.4 TB/s, power-capped at 500 W), torchtitan's benchmark machine;
# MFU against the SXM peak, as torchtitan counts it
DEVICES = {
    "H100-SXM": (989e12, 3.35e12),
    "H100-500W": (989e12, 2.4e12),
    "H200": (989e12, 4.8e12),
    "A100-80GB": (312e12, 2.04e12),
}
# Dense FP8 tensor-core peaks (data sheets): twice bf16's on Hopper; none on an A100
FP8_PEAK = {"H100-SXM": 1979e12, "H100-500W": 1979e12, "H200": 1979e12}
WAYS = ("low", "point", "high")  # a rate's (and a time's) three figures
ByWay = dict[str, float]  # a figure at each of WAYS
Classes = dict[str, ByWay]  # op class -> its ms at each of WAYS
MATMUL_OPS = {"mm", "addmm", "bmm", "matmul", "linear"}
VIEWS = {  # ops that move no data (views, allocations)
    *("view", "_unsafe_view", "expand", "transpose", "t", "detach", "alias", "split"),
    *("split_with_sizes", "slice", "select", "unsqueeze", "squeeze", "permute", "as_strided"),
    *("empty", "empty_like", "new_empty", "unbind", "narrow", "lift_fresh"),
}
ALLOCATIONS = {"empty", "empty_like", "new_empty"}
FUSED = {"element-wise and copies", "rms_norm", "loss"}  # what compile fuses between kernels
FUSED_ROW = "element-wise, norms, loss (fused)"
EAGER_ROW = "element-wise, norms, loss (eager)"
IDLE_ROW = "outside the counted kernels (CALIBRATION.busy)"
FP8_ROW = "FP8 casts and scales"
TP_ROW = "tensor-parallel collectives (exposed)"
FSDP_ROW = "FSDP2 collectives (exposed beyond compute)"
ALLREDUCE_ROW = "gradient all-reduce (exposed beyond the last backward)"
OFFLOAD_ROW = "offload copies (PCIe)"
ADAMW_ROW = "optimizer (AdamW)"
PP_ROW = "pipeline bubble"
P2P_ROW = "pipeline sends (exposed)"
RECOMPUTE_ROW = "recomputation in a split backward's weight half"
NVLINK_BYTES_PER_S = 450e9  # H100 / H200 SXM NVLink 4: 900 GB/s bidirectional per GPU
GPUS_PER_NODE = 8  # an HGX H100 / H200 node: NVLink inside it, the network between nodes
# `bench --network`: each GPU's share of the links between nodes, bytes/s each way
NETWORKS = {
    "ib-ndr": 400e9 / 8,  # InfiniBand NDR, one 400 Gb/s port per GPU (H100 clusters)
    "eth-100g": 100e9 / 8 / GPUS_PER_NODE,  # one 100 Gb/s Ethernet port per node of 8
}
NETWORK_NAMES = {"ib-ndr": "InfiniBand NDR 400 Gb/s per GPU", "eth-100g": "100 Gb/s per node"}


def crosses_nodes(size: int, inner: int) -> bool:
    """Whether a mesh dim of `size` ranks, `inner` apart (tp innermost), spans nodes."""
    return size > 1 and size * inner > GPUS_PER_NODE


def link_of(size: int, inner: int, network: str) -> tuple[float, str]:
    """(bytes/s per GPU, name) of the link a mesh dim's collectives run on: NVLink inside a
    node; across nodes, every GPU at its share of `network` (its slowest hop sets a ring's pace)."""
    if crosses_nodes(size, inner):
        return NETWORKS[network], NETWORK_NAMES[network]
    return NVLINK_BYTES_PER_S, "NVLink"


@dataclasses.dataclass(frozen=True)
class Spread:
    """A rate the sources give: the figure taken (`point`) and the range they span."""

    low: float
    point: float
    high: float

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.point <= self.high:
            raise ValueError(f"a rate needs 0 < low <= point <= high: {self}")


@dataclasses.dataclass(frozen=True)
class Rates:
    """What one GPU kind reaches in practice; the figures and their sources are in RATES."""

    matmul: tuple[tuple[tuple[int, int, int], Spread], ...]  # GEMM (m, n, k) -> FLOP/s
    # head_dim -> seq_len -> TFLOP/s: (FlashAttention-2 causal fwd + bwd, cuDNN causal fwd,
    # cuDNN bwd); None where nothing is published
    attention: dict[int, dict[int, tuple[float, float | None, float | None]]]
    hbm: Spread  # bytes/s of streaming (element-wise) kernels
    # the share of the rated clock tensor-core work keeps (a power cap lowers it); it scales
    # the matmul and attention rates, measured at full power
    clock: Spread = Spread(1.0, 1.0, 1.0)


TERA = 1e12


def _gemms(rows: int, figures: dict[tuple[int, int], tuple[tuple[float, ...], ...]]):
    """Anchors from TFLOP/s at (n, k): the first group's mean (`rows` rows), the extremes."""
    anchors = []
    for (n, k), groups in figures.items():
        every = [x for group in groups for x in group]
        mean = sum(groups[0]) / len(groups[0])
        anchors.append(((rows, n, k), Spread(min(every) * TERA, mean * TERA, max(every) * TERA)))
    return tuple(anchors)


# --- The achieved-rate table: every figure below is a published measurement. -----------------
# Matmuls, H100 SXM (H200: the same SMs and clocks, per ML Engineering's MAMF table): XLA's
# measured sm_90 "bf16xbf16->bf16" GEMMs (github.com/tensorflow/tensorflow, third_party/xla/xla/
# service/gpu/model/matmul_interpolator_data.h, commit 372d578b; up to 808 TFLOP/s: an SXM part),
# batched entries of 16,384 rows (a 400m micro-batch's tokens), both operand orders; the low end
# 8,192 rows (fewer output tiles, as the weight gradients'). Its top agrees with mamf-finder's
# best, 794.5 TFLOP/s (S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md)
# and torchao's 78% of peak for big GEMMs (pytorch/ao, torchao/testing/training/roofline_utils.py).
HOPPER_MATMUL = _gemms(
    16384,
    {  # (n, k): ((16,384 rows: (n, k), (k, n)), (8,192 rows: the same)), TFLOP/s
        (512, 512): ((441.5,), (340.7,)),
        (512, 1024): ((589.0, 542.0), (487.2, 445.5)),
        (1024, 1024): ((673.8,), (598.2,)),
        (1024, 2048): ((720.5, 687.9), (713.4, 680.9)),
        (1024, 4096): ((777.6, 725.5), (750.6, 693.0)),
        (2048, 2048): ((759.3,), (733.3,)),
        (2048, 4096): ((808.7, 764.6), (783.2, 763.0)),
        (4096, 4096): ((793.1,), (807.7,)),
    },
)
# Matmuls, A100 SXM4 80GB: cuBLASLt fp16 GEMMs of square shapes (bf16's peak), Azure's ND A100 v4
# results (github.com/Azure/AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md; 1024^3
# left out: its 64 output tiles leave 44 of 108 SMs idle). High: mamf-finder's best A100 SXM
# shape, 271.2 TFLOP/s at 1024 x 10240 x 5120 (ML Engineering's MAMF table, 788 FLOP/B).
AMPERE_MATMUL = tuple(
    ((n, n, n), Spread(tflops * TERA, tflops * TERA, 271.2 * TERA))
    for n, tflops in ((2048, 221.8), (4096, 228.0), (8192, 253.7), (16384, 256.5))
)
# Attention, causal, forward + backward, TFLOP/s as FlashAttention's benchmarks (and the counter
# above) count them: the causal half of 4 B H T^2 D forward, backward 2.5x. FlashAttention-2,
# which SDPA tries before cuDNN (github.com/huggingface/transformers/pull/48163): its H100 and
# A100 figures (github.com/Dao-AILab/flash-attention, assets/flash2_{h100,a100}_fwd_bwd_
# benchmark.png, "with causal mask"). cuDNN on H100: the FlashAttention-3 paper (arXiv:2407.08608),
# Figure 5 (causal forward) and 6 (backward, unmasked: the high end is optimistic by that much).
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
# head_dim: TFLOP/s at each of SEQ_LENS: FA2 causal fwd+bwd, cuDNN causal fwd (_FWD), bwd (_BWD)
HOPPER_FA2 = {64: (141, 192, 232, 257, 273, 284), 128: (163, 221, 265, 294, 308, 328)}
HOPPER_CUDNN_FWD = {64: (225, 288, 334, 363, 379, 388), 128: (315, 410, 484, 518, 529, 539)}
HOPPER_CUDNN_BWD = {64: (266, 348, 395, 417, 432, 433), 128: (305, 408, 465, 499, 518, 516)}
AMPERE_FA2 = {64: (88, 119, 140, 156, 165, 171), 128: (99, 133, 155, 173, 182, 189)}
HOPPER_ATTENTION = {  # seq_len: (FA2 causal fwd+bwd, cuDNN causal fwd, cuDNN bwd)
    d: dict(zip(SEQ_LENS, zip(HOPPER_FA2[d], HOPPER_CUDNN_FWD[d], HOPPER_CUDNN_BWD[d])))
    for d in HOPPER_FA2
}
AMPERE_ATTENTION = {  # FlashAttention-2 only: nothing published for cuDNN at these shapes
    d: {t: (tflops, None, None) for t, tflops in zip(SEQ_LENS, figures)}
    for d, figures in AMPERE_FA2.items()
}
HOPPER = {"matmul": HOPPER_MATMUL, "attention": HOPPER_ATTENTION}
RATES = {
    "H100-SXM": Rates(
        **HOPPER,
        # Azure ND H100 v5 "HBM Bandwidth" (AI-benchmarking-guide, Azure_Results/
        # ND_H100_v5_results.md, read in the fork github.com/samuel-bohman/AI-benchmarking-guide):
        # Copy 2.90 TB/s (low), Triad 2.97 (point: two reads and a write, as a fused kernel);
        # high: torchao's 92% of peak for pointwise Triton kernels (roofline_utils.py, above)
        hbm=Spread(2.90e12, 2.97e12, 0.92 * 3.35e12),
    ),
    "H100-500W": Rates(
        **HOPPER,
        # Azure's H100 SXM shares of the rated 3.35 TB/s (Copy 87%, Triad 89%, torchao's 92%)
        # applied to the HBM2e's 2.4 TB/s
        hbm=Spread(2.90 / 3.35 * 2.4e12, 2.97 / 3.35 * 2.4e12, 0.92 * 2.4e12),
        # torchtitan: this part's peak "is between SXM and NVL" (benchmarks/
        # llama3_h100_202412_torchtitan.md): the H100 NVL's 835 of 989 TFLOP/s at the low end,
        # the SXM's clock at the high end, the middle taken
        clock=Spread(835 / 989, 0.92, 1.0),
    ),
    # H200: the same kernels on the same SMs (Azure's FlashAttention-2 figure, head dim 128, 8k
    # tokens, is 327.9 TFLOP/s on an H100 and 329.3 on an H200: ND H100 v5 / H200 v5); HBM:
    # Azure ND H200 v5, Copy 4.01, Triad 4.15 TB/s
    "H200": Rates(**HOPPER, hbm=Spread(4.01e12, 4.15e12, 4.15e12)),
    # HBM: Azure ND A100 v4, Copy 1.61, Triad 1.70 TB/s
    "A100-80GB": Rates(AMPERE_MATMUL, AMPERE_ATTENTION, hbm=Spread(1.61e12, 1.70e12, 1.70e12)),
}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The terms the counts alone take as exact, set so PUBLISHED's bf16 runs fall in their
    predicted ranges (docs/performance.md, "Calibration"); "low" is the slow end of each."""

    busy: Spread  # the share of a step the counted kernels fill: launches, host work, kernel
    # tails and collectives nothing hides take the rest
    fused: Spread  # the share of the element-wise traffic compile could remove that it does
    link: Spread  # the share of NVLink's rate tensor parallelism's collectives reach


CALIBRATION = Calibration(
    busy=Spread(0.76, 0.84, 0.90), fused=Spread(0.50, 0.75, 1.0), link=Spread(0.55, 0.70, 0.85)
)


@dataclasses.dataclass(frozen=True)
class Published:
    """A published run the prediction is checked against (yaml/<config>.yaml holds its
    settings): tokens/s per GPU as its authors report it, on `world` GPUs of `device`."""

    config: str
    device: str
    world: int
    tokens_per_s_per_gpu: float
    source: str
    # "every second matmul": torchtitan's per-op selective checkpointing, which this
    # framework's `selective` mode does not do (it keeps every matmul's output)
    recompute: str = ""


YAML = shipped_config_dir() or Path("yaml")
TORCHTITAN_2412 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1"
TORCHTITAN_2506 = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
EVERY_SECOND = "every second matmul"
PUBLISHED = {
    p.config: p
    for p in (
        Published("llama3-8b", "H100-500W", 8, 5762, TORCHTITAN_2412, EVERY_SECOND),
        Published("llama3-8b-compiled", "H100-500W", 8, 6667, TORCHTITAN_2412, EVERY_SECOND),
        Published("llama3-8b-tp8", "H100-500W", 64, 4378, TORCHTITAN_2506, EVERY_SECOND),
        Published("llama3-70b", "H100-500W", 256, 597.3, TORCHTITAN_2506),
        Published("llama3-8b-fp8", "H100-500W", 8, 8532, TORCHTITAN_2412, EVERY_SECOND),
        Published("llama3-70b-fp8", "H100-500W", 256, 809.8, TORCHTITAN_2506),
        Published("nanochat-d32", "H100-SXM", 8, 41693, "karpathy/nanochat run1000.sh, fae3aca"),
    )
}


def predict_published(run: Published) -> dict[str, Any]:
    """The prediction of a published run from its yaml/ config, its figure and their ratio."""
    cfg = load_config(YAML / f"{run.config}.yaml", [])
    plan = target_plan(cfg, run.world)
    r = roofline(cfg, plan.micro_batch_size, plan.grad_accum, run.device, run.world)
    predicted = r["achieved"]["tokens_per_s_per_gpu"]
    return {
        "config": f"yaml/{run.config}.yaml",
        "device": run.device,
        "world": run.world,
        "published": run.tokens_per_s_per_gpu,
        "predicted": predicted,
        "ratio": run.tokens_per_s_per_gpu / predicted["point"],
        "mfu": r["achieved"]["mfu"],
        "source": run.source,
    }


def published_recompute(cfg: Config) -> str:
    """The published run's own recompute policy where cfg is one of PUBLISHED's configs."""
    run = PUBLISHED.get(cfg.run.name)
    return run.recompute if run and cfg.activation_checkpointing.mode == "selective" else ""


def _log_interpolate(points: list[tuple[float, float]], x: float) -> float:
    """y at x on the polyline through `points` (sorted by x) in log x; flat beyond the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)
    return points[-1][1]


def intensity(m: int, n: int, k: int) -> float:
    """FLOP per byte of a 16-bit (m, k) x (k, n) GEMM that reads both operands and writes once."""
    return m * n * k / (m * k + k * n + m * n)


def matmul_rate(device: str, m: int, n: int, k: int) -> Spread:
    """The FLOP/s a GEMM of this shape reaches: the measured rates interpolated by intensity."""
    rates, at = RATES[device], intensity(m, n, k)
    anchors = sorted((intensity(*shape), rate) for shape, rate in rates.matmul)
    ways = [_log_interpolate([(x, getattr(r, w)) for x, r in anchors], at) for w in WAYS]
    return Spread(*(rate * getattr(rates.clock, w) for rate, w in zip(ways, WAYS)))


def attention_rate(device: str, head_dim: int, seq_len: int) -> Spread:
    """Causal forward + backward FLOP/s at the nearest published head_dim, by seq_len."""
    table, clock = RATES[device].attention, RATES[device].clock
    figures = table[min(table, key=lambda d: abs(math.log(d / head_dim)))]
    lengths = sorted(figures)
    fa2 = _log_interpolate([(t, figures[t][0]) for t in lengths], seq_len)
    cudnn = fa2
    if all(figures[t][1] for t in lengths):  # 3.5 units of work: 1 forward, 2.5 backward
        combined = [(t, 3.5 / (1 / figures[t][1] + 2.5 / figures[t][2])) for t in lengths]
        cudnn = _log_interpolate(combined, seq_len)
    low, point, high = min(fa2, cudnn), fa2, max(fa2, cudnn)
    return Spread(low * TERA * clock.low, point * TERA * clock.point, high * TERA * clock.high)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # views share it


class _Counter(TorchDispatchMode):
    """FLOPs and bytes per op class (eager), each GEMM's shape, and the traffic left after
    fusion: the element-wise ops between two other kernels are one kernel (see the module)."""

    def __init__(self, micro_batch: int = 1) -> None:
        super().__init__()
        self.micro_batch = micro_batch
        self.flops: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, float] = defaultdict(float)
        self.gemms: dict[tuple[int, int, int], int] = defaultdict(int)  # (m, n, k) -> calls
        self.fused_bytes = 0.0
        self._kernel = 0  # which fused kernel the element-wise ops run in now
        self._made: dict[int, tuple[int, int]] = {}  # storage -> (kernel, bytes) it came from
        self._written: set[int] = set()
        self._read: set[tuple[int, int]] = set()  # (storage, kernel) already read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if name in VIEWS:
            if name in ALLOCATIONS:  # fresh storage (perhaps at a freed one's address)
                self._forget(tree_flatten(out)[0])
            return out  # no data moves
        cls = _class_of(name)
        if (packet := func._overloadpacket) in flop_registry:
            self.flops[cls] += flop_registry[packet](*args, **kwargs, out_val=out)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.bytes[cls] += sum(t.numel() * t.element_size() for t in inputs + outputs)
        (self._fuse if cls in FUSED else self.boundary)(inputs, outputs)
        if cls == "matmul":  # (m, n, k) of its (m, k) x (k, n); a batch of them counts as m rows
            a, b = (args[1], args[2]) if name == "addmm" else (args[0], args[1])
            self.gemms[math.prod(a.shape[:-1]), b.shape[-1], a.shape[-1]] += 1
        return out

    def _fuse(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        for t in inputs:
            key = _storage(t)
            made = self._made.get(key)
            if made is not None and made[0] == self._kernel:
                continue  # made in this kernel: it never leaves the chip
            if made is not None:
                self._write(key)
            if (key, self._kernel) not in self._read:  # read once per kernel
                self._read.add((key, self._kernel))
                self.fused_bytes += t.numel() * t.element_size()
        for t in outputs:
            key = _storage(t)
            self._made[key] = (self._kernel, t.numel() * t.element_size())
            self._written.discard(key)

    def boundary(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor] = ()) -> None:
        """Another kernel runs: what it reads has been written; the ops after it are the next."""
        for t in inputs:
            if _storage(t) in self._made:
                self._write(_storage(t))
        self._forget(outputs)
        self._kernel += 1

    def _forget(self, outputs: list[torch.Tensor]) -> None:
        for t in outputs:
            if isinstance(t, torch.Tensor):
                self._made.pop(_storage(t), None)

    def _write(self, key: int) -> None:
        if key not in self._written:
            self._written.add(key)
            self.fused_bytes += self._made[key][1]


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
    def _record(flops: float, moved: int, read: list[torch.Tensor]) -> None:
        counter = _FlashAttention.counter
        counter.flops["attention"] += flops
        counter.bytes["attention"] += moved
        counter.boundary(read)

    @staticmethod
    def forward(ctx, q, k, v):  # (B, H, T, D)
        B, H, T, D = q.shape
        flops = 2 * B * H * T * T * D  # QK^T and AV, causal half: 2 x (2 B H T^2 D) / 2
        moved = 4 * q.numel() * q.element_size()  # read Q K V, write O
        _FlashAttention._record(flops, moved, [q, k, v])
        ctx.shape = (flops, moved)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        flops, moved = ctx.shape
        # dQ dK dV + recompute; read Q K V O dO, write dQ dK dV
        _FlashAttention._record(2.5 * flops, 2 * moved, [grad])
        return torch.empty_like(grad), torch.empty_like(grad), torch.empty_like(grad)


def _count(cfg: Config, micro_batch: int) -> _Counter:
    """Run one micro-batch forward + backward, bf16 compute, under the counter."""
    model = build_model(cfg.model).to(torch.bfloat16)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)  # recompute is counted
    _FlashAttention.counter = counter = _Counter(micro_batch)

    def sdpa(q, k, v, **kwargs):
        if k.size(1) != q.size(1):  # grouped-query attention: the kernel reads fewer K / V
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return _FlashAttention.apply(q, k, v)

    tokens = torch.zeros((micro_batch, cfg.model.seq_len + 1), dtype=torch.long, device="meta")
    with mock.patch.object(F, "scaled_dot_product_attention", sdpa), counter:
        loss = plain_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        counter.boundary([])  # backward is another graph: no kernel spans both
        loss.backward()
    # torchtitan's per-op selective checkpointing recomputes every second matmul: of a block's
    # wq wk wv wo w1 w3 w2, the backward recomputes wk, wo and w3
    if published_recompute(cfg) == EVERY_SECOND:
        m, g, rows = cfg.model, widths(cfg.model), micro_batch * cfg.model.seq_len
        for n, k in ((g["dkv"], g["d"]), (g["d"], g["dq"]), (g["F"], g["d"])):  # wk, wo, w3
            counter.gemms[(rows, n, k)] += m.n_layers
            counter.flops["matmul"] += m.n_layers * 2 * rows * n * k
    return counter


def count_micro_step(cfg: Config, micro_batch: int) -> tuple[dict[str, float], dict[str, float]]:
    """(FLOPs, bytes) by op class of one micro-batch forward + backward, bf16 compute."""
    return dict((counter := _count(cfg, micro_batch)).flops), dict(counter.bytes)


def roofline(
    cfg: Config,
    micro_batch: int,
    grad_accum: int,
    device: str = "H100-SXM",
    world: int = 2,
    network: str = "ib-ndr",
) -> dict[str, Any]:
    """The per-class roofline of one optimizer step on one GPU of `device`, the MFU each bound
    implies, and the prediction at achieved rates (`achieved`, which prices FSDP2's and TP's
    traffic); DDP's all-reduce over `world` GPUs is overlapped with backward (stated, not added)."""
    if cfg.train.precision == "fp32":  # (the count is bf16's; fp32 runs far off its peak)
        raise UserError(
            "train.precision=fp32: the roofline prices bf16/fp16 tensor-core work, and fp32 "
            "matmuls run at a fraction of it (no TF32 here); predict train.precision=bf16"
        )
    if cfg.train.fp8.enabled and device not in FP8_PEAK:  # (before the count)
        raise UserError(
            f"train.fp8.enabled=true: {device} has no FP8 tensor cores; predict it for "
            f"{' or '.join(FP8_PEAK)}, or set train.fp8.enabled=false for bf16 on {device}"
        )
    peak, bandwidth = DEVICES[device]
    counter = _count(cfg, micro_batch)
    model = build_model(cfg.model)
    n_params = model.num_params()
    rows = {}
    for cls in sorted(set(counter.flops) | set(counter.bytes)):
        f, b = grad_accum * counter.flops.get(cls, 0.0), grad_accum * counter.bytes.get(cls, 0.0)
        rows[cls] = {"flops": f, "bytes": b, "ms": 1e3 * max(f / peak, b / bandwidth)}
    traffic = offload_traffic(cfg, micro_batch, grad_accum, world)
    if traffic:  # the step runs on the CPU; the GPU waits for the copies
        moved = sum(sum(parts.values()) for parts in traffic.values())
        cls, ms = OFFLOAD_ROW, 1e3 * moved / PCIE5_X16_BYTES_PER_S
    else:
        moved = 28 * n_params  # fused AdamW, fp32: read p g m v, write p m v
        cls, ms = ADAMW_ROW, 1e3 * moved / bandwidth
    rows[cls] = {"flops": 0.0, "bytes": moved, "ms": ms}
    tokens = micro_batch * grad_accum * cfg.model.seq_len
    model_flops = model.flops_per_token() * tokens
    causal_flops = model.flops_per_token(causal=True) * tokens
    eager_ms = sum(r["ms"] for r in rows.values())
    bound = ("matmul", "attention", ADAMW_ROW, OFFLOAD_ROW)
    matmul_ms = sum(rows[c]["ms"] for c in bound if c in rows)
    ring_ms, link = allreduce_ms(cfg.model, world, network)
    mfu = lambda flops, ms: flops / (ms / 1e3) / peak  # noqa: E731
    plan = target_plan(cfg, world)
    return {
        "device": device,
        "network": network,
        "allreduce_ms": ring_ms,
        "not_modelled": not_modelled(cfg),
        "allreduce_link": link,
        "world": world,
        "micro_batch": micro_batch,
        "grad_accum": grad_accum,
        "tokens_per_step_per_dp_rank": tokens,  # (a TP group's, a pipeline's)
        "data_parallel": plan.dp_degree,
        "model_flops_per_step": model_flops,
        "model_flops_per_step_causal": causal_flops,
        "mfu_convention": "mfu: attention over the full T x T (PaLM); mfu_causal: its causal half",
        "classes": rows,
        "offload_bytes_per_step": traffic,
        "eager_ms": eager_ms,
        "matmul_bound_ms": matmul_ms,
        "mfu_eager": mfu(model_flops, eager_ms),
        "mfu_matmul_bound": mfu(model_flops, matmul_ms),
        "mfu_causal_eager": mfu(causal_flops, eager_ms),
        "mfu_causal_matmul_bound": mfu(causal_flops, matmul_ms),
        # under pipeline parallelism: one GPU's step at its stage (the whole model on one GPU
        # runs in no layout of the config: no prediction of it)
        "achieved": achieved(
            cfg, counter, rows, grad_accum, device, (model_flops, causal_flops), world, network
        )
        if plan.pp_degree == 1
        else None,
        "pipeline": pipeline_step(cfg, world, device, network=network)
        if plan.pp_degree > 1
        else None,
    }


def not_modelled(cfg: Config) -> list[str]:
    """What of the layout the prediction leaves out."""
    p, stage = cfg.parallel, cfg.parallel.deepspeed.zero_stage
    zero3 = p.backend == "deepspeed" and stage == 3
    left = [
        (p.backend == "fsdp" and p.fsdp.cpu_offload, "FSDP2's CPU offload (PCIe, CPU AdamW)"),
        (zero3, "ZeRO-3's gathers and reduce-scatters"),
        (zero3 and p.deepspeed.offload_optimizer == "cpu", "ZeRO-3's optimizer offload"),
        (zero3 and p.deepspeed.offload_param == "cpu", "ZeRO-3's parameter offload"),
        (p.pipeline_parallel > 1 and p.fsdp.replicate_degree > 1, "HSDP's replica all-reduce"),
    ]
    return [what for applies, what in left if applies]


def allreduce_ms(model: ModelConfig, ranks: int, network: str) -> tuple[float, str]:
    """(ms, link) of a ring all-reduce of the fp32 gradients (autocast keeps fp32 parameters)
    over `ranks` GPUs: each sends 2 (n - 1) / n of them."""
    rate, link = link_of(ranks, 1, network)
    return 1e3 * 2 * (ranks - 1) / ranks * 4 * ParamCounts.of(model).total / rate, link


def achieved(
    cfg: Config,
    counter: _Counter,
    rows: dict[str, dict[str, float]],
    grad_accum: int,
    device: str,
    model_flops: tuple[float, float],
    world: int = 1,
    network: str = "ib-ndr",
) -> dict[str, Any]:
    """The step at the rates of RATES and the terms of CALIBRATION, per class at the point, low
    and high rates; its MFU and one GPU's tokens/s. Under TP or FSDP2, one GPU's share and the
    step's communication (`_split_over_tp`)."""
    model, plan = cfg.model, target_plan(cfg, world)
    # shards: FSDP2's shard dim (HSDP: not the replicas)
    tp, shards = plan.tp_degree, layout_of(cfg, plan).shards
    attention = attention_rate(device, model.d_model // model.n_heads, model.seq_len)
    compiled = compiles(cfg.train, "cuda")
    elementwise = _elementwise_bytes(rows, grad_accum * counter.fused_bytes, compiled)
    classes: Classes = {}
    fp8 = model.vocab_size if cfg.train.fp8.enabled else None
    for way in WAYS:
        hbm = getattr(RATES[device].hbm, way)
        gemms = _gemm_seconds(counter, device, way, hbm, tp, model.seq_len, fp8)
        times = {"matmul": grad_accum * gemms}
        if fp8 is not None:  # the casts: split over tp below
            times[FP8_ROW] = grad_accum * fp8_cast_seconds(cfg, counter.micro_batch, device, way)
        times["attention"] = rows.get("attention", {}).get("flops", 0.0) / getattr(attention, way)
        times[FUSED_ROW if compiled else EAGER_ROW] = elementwise[way] / hbm
        times |= {c: rows[c]["bytes"] / hbm for c in ("embedding", ADAMW_ROW) if c in rows}
        if OFFLOAD_ROW in rows:
            times[OFFLOAD_ROW] = rows[OFFLOAD_ROW]["ms"] / 1e3
        for cls, seconds in times.items():
            classes.setdefault(cls, {})[way] = 1e3 * seconds
    traffic = None
    stage = cfg.parallel.deepspeed.zero_stage if plan.backend == "deepspeed" else 0
    sharded = plan.backend == "fsdp" or stage > 0
    if tp > 1 or (cfg.parallel.backend == "fsdp" and plan.dp_degree > 1):
        traffic = parallel_traffic(cfg, world, counter.micro_batch, grad_accum, network)
        classes = _split_over_tp(classes, traffic, tp, shards)
    elif shards > 1 and ADAMW_ROW in classes and sharded:  # AdamW over the rank's shard
        classes[ADAMW_ROW] = _divided(classes[ADAMW_ROW], shards)
    if traffic is None and plan.dp_degree > 1 and stage < 3:  # DDP, ZeRO-0..2 (ZeRO-3: not)
        ring, link = allreduce_ms(model, plan.dp_degree, network)
        window = {w: 2 / 3 * t / grad_accum for w, t in _total(classes).items()}  # a backward
        classes[ALLREDUCE_ROW] = {w: max(0.0, ring - t) for w, t in window.items()}
    classes[IDLE_ROW] = _idle(classes)
    ms = _total(classes)
    flops, causal = (f / tp for f in model_flops)  # one GPU's share of the model's FLOPs
    mfu = lambda f, way: f / (ms[way] / 1e3) / DEVICES[device][0]  # noqa: E731
    matmul_flops = sum(calls * 2 * m * n * k for (m, n, k), calls in counter.gemms.items()) / tp
    matmul = classes["matmul"]
    per_s = {w: grad_accum * matmul_flops / (t / 1e3) if t else 0.0 for w, t in matmul.items()}
    tokens = counter.micro_batch * grad_accum * model.seq_len / tp  # one GPU's share
    return {
        "tensor_parallel": tp,
        "parallel_traffic": traffic,
        # low rates give the slow end: "low"/"high" below name the rates a figure comes from
        "rates": {
            "matmul_flops_per_s": per_s,
            "attention_flops_per_s": dataclasses.asdict(attention),
            "hbm_bytes_per_s": dataclasses.asdict(RATES[device].hbm),
        },
        "calibration": dataclasses.asdict(CALIBRATION),
        "recompute": published_recompute(cfg),
        "compiled": compiled,
        "fp8": cfg.train.fp8.recipe if cfg.train.fp8.enabled else None,
        "elementwise_bytes_per_step": elementwise["point"],
        "classes": classes,
        "ms": ms,
        "mfu": {way: mfu(flops, way) for way in ms},
        "mfu_causal": {way: mfu(causal, way) for way in ms},
        "tokens_per_s_per_gpu": {way: tokens / (t / 1e3) for way, t in ms.items()},
    }


def _elementwise_bytes(rows: dict[str, dict[str, float]], fused: float, compiled: bool) -> ByWay:
    """Element-wise, norm and loss bytes of a step: eager pays every op's traffic; compile
    removes CALIBRATION.fused's share of what the fusion rule says it could."""
    eager = sum(rows[c]["bytes"] for c in FUSED if c in rows)
    removable = max(0.0, eager - fused) if compiled else 0.0
    return {way: eager - getattr(CALIBRATION.fused, way) * removable for way in WAYS}


def _idle(classes: Classes) -> ByWay:
    """The time outside the counted kernels (the step is their sum / CALIBRATION.busy); FSDP2's
    and DDP's exposed waits are no kernel's."""
    waits = (FSDP_ROW, ALLREDUCE_ROW)
    kernels = _total({cls: ms for cls, ms in classes.items() if cls not in waits})
    return {w: t * (1 / getattr(CALIBRATION.busy, w) - 1) for w, t in kernels.items()}


def _total(classes: Classes) -> ByWay:
    """The sum of the classes' times at each of WAYS."""
    return {w: sum(c[w] for c in classes.values()) for w in WAYS}


def _gemm_seconds(
    counter: _Counter, device: str, way: str, hbm: float, tp: int, seq_len: int, fp8_except
) -> float:
    """One micro-step's GEMMs on one GPU at a tp rank's shape, each at its rate or traffic;
    `fp8_except`: FP8 for every GEMM but those with this dimension (the vocabulary: the head)."""
    seconds, tokens = 0.0, counter.micro_batch * seq_len
    for shape, calls in counter.gemms.items():
        m, n, k = tp_shape(shape, tp, tokens)
        if fp8_except is not None and fp8_except not in shape:
            seconds += calls * fp8_gemm_seconds(device, way, hbm, m, n, k)
            continue
        rate = getattr(matmul_rate(device, m, n, k), way)
        seconds += calls * max(2 * m * n * k / rate, 2 * (m * k + k * n + m * n) / hbm)
    return seconds


def fp8_gemm_seconds(device: str, way: str, hbm: float, m: int, n: int, k: int) -> float:
    """An FP8 GEMM (bf16 output) at bf16's achieved share of peak, as torchao's roofline takes,
    or its traffic if that is slower."""
    if device not in FP8_PEAK:
        raise ValueError(f"{device} has no FP8 tensor cores: train.fp8 needs an H100 or H200")
    rate = getattr(matmul_rate(device, m, n, k), way) * FP8_PEAK[device] / DEVICES[device][0]
    return max(2 * m * n * k / rate, ((m * k + k * n) + 2 * m * n) / hbm)


# Bytes per element of torchao's casts of one linear's operands over forward + backward
# (torchao/testing/training/roofline_utils.py, get_tensor_memory_traffic_ovhd_s): (input,
# weight, grad_output), each as (unfused, with the amax read fused into the op before).
# Tensorwise: an amax read (2) and a bf16 read with fp8 writes (row- and column-major); rowwise:
# a cast per orientation, the weight's transposed in bf16 between.
FP8_CAST_BYTES = {"tensorwise": ((6, 4), (8, 8), (6, 4)), "rowwise": ((8, 6), (10, 10), (8, 6))}


def fp8_cast_bytes(tokens: int, n: int, k: int, recipe: str, fused: float = 0.0) -> float:
    """Bytes the FP8 casts and scales of one (tokens x k) @ (k x n) linear move per forward +
    backward; `fused`: the share of the fusable amax reads that compile fuses (0..1)."""
    sizes = (tokens * k, k * n, tokens * n)  # input, weight, grad_output
    return sum(
        size * (plain - fused * (plain - merged))
        for size, (plain, merged) in zip(sizes, FP8_CAST_BYTES[recipe])
    )


def fp8_cast_seconds(cfg: Config, micro_batch: int, device: str, way: str) -> float:
    """One micro-step's FP8 casts of every block linear, the whole model's (`achieved` splits
    them over tp)."""
    tokens, g = micro_batch * cfg.model.seq_len, widths(cfg.model)
    fused = getattr(CALIBRATION.fused, way) if compiles(cfg.train, "cuda") else 0.0
    d, f, recipe = g["d"], g["F"], cfg.train.fp8.recipe
    # (out, in) features of wqkv, wo, w1, w3, w2
    linears = [(g["dq"] + 2 * g["dkv"], d), (d, g["dq"]), (f, d), (f, d), (d, f)]
    per_block = sum(fp8_cast_bytes(tokens, n, k, recipe, fused) for n, k in linears)
    return cfg.model.n_layers * per_block / getattr(RATES[device].hbm, way)


def fp8_linear_gain(
    device: str, tokens: int, n: int, k: int, recipe: str = "tensorwise", fused: float = 1.0
) -> float:
    """bf16 time / FP8 time of one linear's three GEMMs (forward, dgrad, wgrad) with FP8's casts,
    at the point rates: below 1, FP8 does not pay (narrow linears: the casts outweigh the GEMMs)."""
    hbm = RATES[device].hbm.point
    shapes = ((tokens, n, k), (tokens, k, n), (k, n, tokens))
    bf16 = sum(2 * a * b * c / matmul_rate(device, a, b, c).point for a, b, c in shapes)
    fp8 = sum(fp8_gemm_seconds(device, "point", hbm, a, b, c) for a, b, c in shapes)
    return bf16 / (fp8 + fp8_cast_bytes(tokens, n, k, recipe, fused) / hbm)


def tp_shape(shape: tuple[int, int, int], tp: int, tokens: int) -> tuple[int, int, int]:
    """One tp rank's part of a (m, n, k) GEMM: 1/tp of the weight, cut along the largest
    dimension that is not the token count (heads, SwiGLU width or vocabulary)."""
    if tp == 1:
        return shape
    cut = max([i for i, d in enumerate(shape) if d != tokens] or [0, 1, 2], key=shape.__getitem__)
    return tuple(d // tp if i == cut else d for i, d in enumerate(shape))


def _divided(ms: ByWay, by: float) -> ByWay:
    return {w: t / by for w, t in ms.items()}


def _split_over_tp(classes: Classes, traffic: dict[str, Any], tp: int, shards: int) -> Classes:
    """One GPU's step under TP x FSDP2: the work over the tp ranks (matmuls already a rank's),
    AdamW over the shard; TP's collectives all exposed, FSDP2's beyond the compute."""
    out = {c: _divided(ms, tp * (shards if c == ADAMW_ROW else 1)) for c, ms in classes.items()}
    out["matmul"] = dict(classes["matmul"])
    compute = _total(out)
    if tp > 1:
        out[TP_ROW] = {w: traffic["tp_ms"] / getattr(CALIBRATION.link, w) for w in compute}
    sent = traffic["fsdp_ms"] + traffic["replica_ms"]  # (HSDP's all-reduce, as its own stream)
    out[FSDP_ROW] = {w: max(0.0, sent - t) for w, t in compute.items()}
    return out


def offload_traffic(
    cfg: Config, micro_batch: int, grad_accum: int, world: int
) -> dict[str, dict[str, float]]:
    """Host <-> GPU bytes per step of ZeRO-1/2 optimizer offload by direction and reason, or {}."""
    ds = cfg.parallel.deepspeed
    offloads = cfg.parallel.backend == "deepspeed" and ds.offload_optimizer == "cpu"
    if not offloads or ds.zero_stage not in (1, 2):
        return {}
    plan = dataclasses.replace(
        target_plan(cfg, world), micro_batch_size=micro_batch, grad_accum=grad_accum
    )
    return zero_offload_traffic(ParamCounts.of(cfg.model), layout_of(cfg, plan))


def format_roofline(r: dict[str, Any]) -> str:
    lines = [
        f"roofline on one {r['device']}: micro-batch {r['micro_batch']} x grad_accum "
        f"{r['grad_accum']} = {r['tokens_per_step_per_dp_rank']:,} tokens a step of one "
        f"data-parallel rank (of {r['data_parallel']}: "
        f"{r['tokens_per_step_per_dp_rank'] * r['data_parallel']:,} tokens a step)",
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
    a = r["achieved"] or {}  # (none under a pipeline)
    if split := a.get("tensor_parallel", 1) > 1 or r["pipeline"] is not None:
        lines.append("(the table and bounds: the whole model's work on one GPU, no communication)")
    allreduce = (
        f"; gradient all-reduce over {r['world']} GPUs on {r['allreduce_link']}: "
        f"{r['allreduce_ms']:.1f} ms (overlapped with the last micro-step's backward; what "
        f"exceeds it is added: '{ALLREDUCE_ROW}')"
        if ALLREDUCE_ROW in a.get("classes", {})
        else ""
    )
    sharded = a.get("parallel_traffic") is not None  # FSDP2: priced below
    lines.append(
        f"bounds: {r['eager_ms']:.0f} ms eager (MFU {r['mfu_eager']:.0%}, causal "
        f"{r['mfu_causal_eager']:.0%}) .. {r['matmul_bound_ms']:.0f} ms matmul-bound (MFU "
        f"{r['mfu_matmul_bound']:.0%}, causal {r['mfu_causal_matmul_bound']:.0%})"
        + ("" if split or sharded or r["world"] < 2 else allreduce)
    )
    lines += format_pipeline(r["pipeline"]) if a == {} else format_achieved(a)
    if r["not_modelled"]:
        lines.append(f"not modelled (the step is longer): {', '.join(r['not_modelled'])}")
    lines.append(
        "MFU counts attention over the full T x T score matrix (6N + 12 L d T per token, PaLM's "
        "convention, as the trainer's mfu); causal: its causal half, the work the kernel does"
    )
    return "\n".join(lines)


def format_achieved(a: dict[str, Any]) -> list[str]:
    """The prediction's lines: rates taken, time per class, the step and its MFU."""
    rates = a["rates"]
    traffic = "after compile's fusion" if a["compiled"] else "eager (train.compile off)"
    lines = [
        "at achieved rates (RATES in scale_llm/analysis/roofline.py, each with its source; point "
        f"[low-high]): matmul {_span(rates['matmul_flops_per_s'], 1e12)} TFLOP/s, attention "
        f"{_span(rates['attention_flops_per_s'], 1e12)} TFLOP/s, HBM "
        f"{_span(rates['hbm_bytes_per_s'], 1e12, '.2f')} TB/s; element-wise traffic {traffic}: "
        f"{a['elementwise_bytes_per_step'] / 1e9:.1f} GB",
        *_ms_table(a["classes"]),
    ]
    if a.get("parallel_traffic"):
        lines += format_traffic(a["parallel_traffic"], a["tensor_parallel"])
    if a.get("fp8"):
        lines.append(
            f"FP8 linears ({a['fp8']}): the blocks' GEMMs at bf16's achieved share of peak times "
            f"the FP8 peak (1979 TFLOP/s), their casts and scales in '{FP8_ROW}'"
        )
    if a.get("recompute"):
        lines.append(f"recomputed as the published run does: {a['recompute']} of each block")
    ms, mfu, causal = a["ms"], a["mfu"], a["mfu_causal"]
    lines.append(
        f"predicted step: {ms['point']:.0f} ms [{ms['high']:.0f}-{ms['low']:.0f}]; MFU "
        f"{_span(mfu, 0.01, '.0f', '%')}, causal {_span(causal, 0.01, '.0f', '%')}; "
        f"{_span(a['tokens_per_s_per_gpu'], 1, ',.0f')} tokens/s per GPU"
    )
    return lines


def _ms_table(classes: Classes) -> list[str]:
    """Each class's time at the three rates, the largest first."""
    return [
        "| op class | ms at achieved rates [at high rates - at low rates] |",
        "|---|---|",
        *(
            f"| {cls} | {ms['point']:.1f} [{ms['high']:.1f}-{ms['low']:.1f}] |"
            for cls, ms in sorted(classes.items(), key=lambda kv: -kv[1]["point"])
        ),
    ]


def format_traffic(t: dict[str, Any], tp: int) -> list[str]:
    """What each GPU sends a step under tensor parallelism and FSDP2, on which link, and how
    it is priced (the rows TP_ROW and FSDP_ROW)."""
    lines = []
    if tp > 1:
        lines.append(
            f"one GPU of tensor parallel {tp}: the counted work / {tp} (matmuls at a rank's "
            f"shapes); per step it sends {t['tp_bytes'] / 1e9:,.1f} GB of tensor-parallel "
            f"collectives on {t['tp_link']}: {t['tp_ms']:,.0f} ms at the full rate, exposed "
            f"('{TP_ROW}': at CALIBRATION.link's share)"
        )
    if t["data_parallel"] > 1:
        backward = " and backward" if t["fsdp_reshard"] else ""
        lines.append(
            f"FSDP2 over {t['data_parallel']} GPUs on {t['fsdp_link']}: all-gathers of the "
            f"parameters (forward{backward}, {t['fsdp_gathers']} a step) and reduce-scatters of "
            f"the fp32 gradients ({t['fsdp_reductions']} a step), {t['fsdp_bytes'] / 1e9:,.1f} GB "
            f"a GPU, {t['fsdp_ms']:,.0f} ms; overlapped with the compute, only what exceeds it "
            f"is added ('{FSDP_ROW}')"
        )
    if t["replicas"] > 1:
        lines.append(
            f"HSDP: the gradient shards all-reduced over {t['replicas']} replicas on "
            f"{t['replica_link']}, {t['replica_bytes'] / 1e9:,.1f} GB a GPU, "
            f"{t['replica_ms']:,.0f} ms, overlapped as FSDP2's (in '{FSDP_ROW}')"
        )
    return lines


def _span(d: ByWay, unit: float, fmt: str = ".0f", suffix: str = "") -> str:
    """'point [low-high]' of a dict of the three."""
    p, lo, hi = (format(d[k] / unit, fmt) for k in ("point", "low", "high"))
    return f"{p}{suffix} [{lo}-{hi}{suffix}]"


def parallel_traffic(
    cfg: Config, world: int, micro_batch: int, grad_accum: int, network: str = "ib-ndr"
) -> dict[str, Any]:
    """Bytes each GPU sends per optimizer step under FSDP2 x TP, and their least time, each on its
    mesh dim's link (tp innermost): TP's 4 collectives of the activations per block forward, 4
    backward, 4 recomputed; FSDP2's all-gathers and reduce-scatters; a ring moves (n - 1) / n."""
    plan = target_plan(cfg, world)
    m, tp, replicas = cfg.model, plan.tp_degree, plan.replicate_degree
    dp = world // (tp * replicas)  # FSDP2's shard dim (HSDP: the replicas all-reduce its shards)
    c = 2 if cfg.train.precision != "fp32" else 4
    activation = c * micro_batch * m.seq_len * m.d_model
    recomputed = checkpointed_count(m, cfg.activation_checkpointing)
    collectives = 8 * m.n_layers + 4 * recomputed  # 4 forward + 4 backward per block
    tp_bytes = grad_accum * collectives * activation * (tp - 1) / tp if tp > 1 else 0.0
    local = ParamCounts.of(m, tp).total
    fsdp = cfg.parallel.fsdp
    gathers = grad_accum * (2 if fsdp.reshard_after_forward else 1)
    reductions = grad_accum if fsdp.reduce_every_micro_step else 1
    fsdp_bytes = (gathers * c + reductions * 4) * local * (dp - 1) / dp if dp > 1 else 0.0
    (tp_rate, tp_link), (fsdp_rate, fsdp_link) = link_of(tp, 1, network), link_of(dp, tp, network)
    replica_bytes = reductions * 4 * local / dp * 2 * (replicas - 1) / replicas  # a ring
    replica_rate, replica_link = link_of(replicas, tp * dp, network)
    return {
        "tp_bytes": tp_bytes,
        "tp_ms": 1e3 * tp_bytes / tp_rate,
        "tp_link": tp_link,
        "fsdp_bytes": fsdp_bytes,
        "fsdp_ms": 1e3 * fsdp_bytes / fsdp_rate,
        "fsdp_link": fsdp_link,
        "fsdp_gathers": gathers,
        "fsdp_reshard": fsdp.reshard_after_forward,
        "fsdp_reductions": reductions,
        "data_parallel": dp,
        "replicas": replicas,
        "replica_bytes": replica_bytes,
        "replica_ms": 1e3 * replica_bytes / replica_rate,
        "replica_link": replica_link,
    }


def pipeline_bubble(
    stages: int, microbatches: int, schedule: str, stages_per_rank: int = 1
) -> float:
    """The share of a pipelined step a rank waits, `stages` ranks deep, `microbatches` pieces a
    step: (N - 1) / (w m + N - 1), w = 1 (1F1B, GPipe), v (interleaved and looped: each rank's
    v stages) or 3 v (ZBV, DualPipeV: ZB-H1's bubble is 1/3 of 1F1B's, arXiv:2401.10241)."""
    n, m, v = stages, microbatches, stages_per_rank
    if n == 1:
        return 0.0
    widths = {"1f1b": 1, "gpipe": 1, "interleaved_1f1b": v, "looped_bfs": v}
    widths |= {"zero_bubble": 3 * v, "dualpipev": 3 * v}
    if schedule not in widths:
        raise ValueError(f"unknown pipeline schedule {schedule!r}")
    return (n - 1) / (widths[schedule] * m + n - 1)


def pipeline_p2p_bytes(
    piece_tokens: int, d_model: int, microbatches: int, stages_per_rank: int, tp: int
) -> float:
    """Bytes one rank sends its neighbours per step: each of its v stages sends each piece's
    (piece_tokens, d_model) bf16 activations forward and gradients back, 1/tp per tp rank."""
    return 2 * microbatches * stages_per_rank * piece_tokens * d_model * 2 / tp


def recomputed_shares(
    cfg: Config, plan: RunPlan, pieces: int, stages_per_rank: int
) -> list[tuple[float, float]]:
    """By pipeline rank: the shares of its blocks a piece's backward recomputes once and a second
    time. torch 2.13 runs a V schedule's backward in an input half "I" and a weight half where its
    schedule says so (ZBV always, DualPipeV in a few pieces), each recomputing a checkpointed block;
    the first stage's "I" does nothing. every_k picks blocks by their one-process index."""
    m, pipe, pp, v = cfg.model, cfg.parallel.pipeline, plan.pp_degree, stages_per_rank
    blocks = stage_blocks(m.n_layers, pp * v, pipe.layers_per_stage)
    flags = checkpointed_flags(m, cfg.activation_checkpointing)
    split = pipe.schedule in V_SCHEDULES  # no other schedule splits a backward
    shares = []
    for rank in range(pp):
        mine = [s for s in range(pp * v) if stage_owner(s, plan, pipe.schedule) == rank]
        halves = Counter(rank_actions(pipe.schedule, pp, v, pieces, rank) if split else ())
        held = sum(len(blocks[s]) for s in mine)
        once = sum(flags[i] for s in mine for i in blocks[s])
        twice = sum(halves["I", s] / pieces * sum(flags[i] for i in blocks[s]) for s in mine if s)
        shares.append((once / held, twice / held))
    return shares


def gathered_params(cfg: Config, plan: RunPlan, pieces: int, stages_per_rank: int) -> list[int]:
    """By pipeline rank: the parameters (one tp rank's) FSDP2 all-gathers in one schedule run as
    torch 2.13 runs it: a backward leaves a stage gathered until its next forward, which reshards
    all but its last block where reshard_after_forward (off under the V schedules); the run's end
    reshards. A re-gather leaves out the block kept gathered."""
    m, pipe, n = cfg.model, cfg.parallel.pipeline, plan.pp_degree * stages_per_rank
    blocks = stage_blocks(m.n_layers, n, pipe.layers_per_stage)
    reshard = cfg.parallel.fsdp.reshard_after_forward and pipe.schedule not in V_SCHEDULES
    out = []
    for rank in range(plan.pp_degree):
        actions = rank_actions(pipe.schedule, plan.pp_degree, stages_per_rank, pieces, rank)
        whole, less_one = _gathers(actions, reshard, pipe.schedule in RUNTIME_UNSHARDS)
        params = 0
        for s in whole.keys() | less_one.keys():
            own = ParamCounts.of(m, plan.tp_degree, s == 0, s == n - 1)
            params += whole[s] * (own.root + len(blocks[s]) * own.block)
            params += less_one[s] * (own.root + (len(blocks[s]) - 1) * own.block)
        out.append(params)
    return out


def _gathers(actions, reshard: bool, runtime: bool) -> tuple[Counter, Counter]:
    """By stage, its whole gathers and those that leave out the block a forward kept gathered
    (reshard_after_forward). torch's runtime (`runtime`: interleaved 1F1B, looped BFS) keeps the
    stages `runtime_unsharded` names gathered and reshards a stage it drops whole
    (`_add_unshard_reshard`): past 3 stages a rank, a stage is gathered again whole."""
    whole, less_one, gathered, kept = Counter(), Counter(), set(), set()
    for i, (kind, s) in enumerate(actions):
        near = runtime_unsharded(actions[i:]) if runtime else [s]
        for u in (gathered | kept) - set(near) if runtime else ():
            gathered.discard(u), kept.discard(u)  # (dropped: resharded whole)
        for u in near:
            if u not in gathered:
                (less_one if u in kept else whole)[u] += 1
                gathered.add(u)
        if kind == "F" and reshard:
            gathered.discard(s), kept.add(s)
    return whole, less_one


def rank_holdings(cfg: Config, plan: RunPlan, stages_per_rank: int) -> list[tuple[int, bool, bool]]:
    """By pipeline rank, what the trainer's split gives it (`stage_blocks`, `stage_owner`): how
    many blocks, whether the embedding (the first stage) and whether the head (the last)."""
    pipe = cfg.parallel.pipeline
    n = plan.pp_degree * stages_per_rank
    blocks = stage_blocks(cfg.model.n_layers, n, pipe.layers_per_stage)
    owner = [stage_owner(s, plan, pipe.schedule) for s in range(n)]
    held = [sum(len(blocks[s]) for s in range(n) if owner[s] == r) for r in range(plan.pp_degree)]
    return [(held[r], owner[0] == r, owner[-1] == r) for r in range(plan.pp_degree)]


def _kernels(a: dict[str, Any]) -> Classes:
    """`achieved`'s classes a piece is made of: not AdamW, FSDP2's wait or the idle time."""
    return {c: t for c, t in a["classes"].items() if c not in (ADAMW_ROW, FSDP_ROW, IDLE_ROW)}


def _weighted(terms: list[tuple[float, Classes]]) -> Classes:
    """The sum of weight x classes over `terms`, class by class; no row where that is 0 (the
    embedding's row of a difference of two models, a term weighing 0)."""
    out: Classes = {}
    for weight, classes in terms:
        for c, t in classes.items():
            if weight:
                row = out.setdefault(c, dict.fromkeys(WAYS, 0.0))
                out[c] = {w: row[w] + weight * t[w] for w in WAYS}
    return {c: t for c, t in out.items() if any(t.values())}


def stage_parts(stage: Config, piece: int, device: str, world: int, network: str) -> dict:
    """One GPU's work of one piece in the parts a pipeline rank may hold (a block, its
    recomputation, the embedding, the head with the final norm and the loss) as differences of a
    one-block and a two-block model's `roofline`; AdamW's time and FSDP2's traffic per parameter."""
    models = {"bare": (1, "none"), "two": (2, "none")}
    if stage.activation_checkpointing.mode != "none":
        models["checkpointed"] = (1, stage.activation_checkpointing.mode)
    a = {
        name: roofline(
            with_changes(stage, {"model.n_layers": n, "activation_checkpointing.mode": mode}),
            *(piece, 1, device, world, network),
        )["achieved"]
        for name, (n, mode) in models.items()
    }
    block = _weighted([(1, _kernels(a["two"])), (-1, _kernels(a["bare"]))])
    root = _weighted([(1, _kernels(a["bare"])), (-1, block)])
    embedding = {"embedding": root.pop("embedding")} if "embedding" in root else {}
    recompute = {}
    if "checkpointed" in a:
        recompute = _weighted([(1, _kernels(a["checkpointed"])), (-1, _kernels(a["bare"]))])
    m, tp = with_changes(stage, {"model.n_layers": 1}).model, target_plan(stage, world).tp_degree
    traffic, c = a["bare"]["parallel_traffic"], 2 if stage.train.precision != "fp32" else 4
    # (one gather of c bytes a parameter and one fp32 reduce-scatter: pipeline_step's stage)
    per_byte = traffic["fsdp_ms"] / (c + 4) / ParamCounts.of(m, tp).total if traffic else 0.0
    return {
        "block": block,
        "recompute": recompute,
        "embedding": embedding,
        "head": _whole_loss(root, m, piece, tp, c, network) if tp > 1 else root,
        "adamw_per_param": _divided(a["bare"]["classes"][ADAMW_ROW], ParamCounts.of(m).total),
        "gather_ms_per_param": c * per_byte,
        "reduce_ms_per_param": 4 * per_byte,
    }


def _whole_loss(
    head: Classes, m: ModelConfig, piece: int, tp: int, c: int, network: str
) -> Classes:
    """A pipeline's head under TP, whose loss the trainer computes whole on every tp rank from the
    gathered logits (`PipelineBackend._piece_loss`): the head's work but its matmul tp times a
    rank's share, and the gather's (tp - 1) / tp of the logits on the TP link (backward: none)."""
    out = {cls: ms if cls == "matmul" else _divided(ms, 1 / tp) for cls, ms in head.items()}
    logits = c * piece * m.seq_len * m.vocab_size * (tp - 1) / tp
    ms = 1e3 * logits / link_of(tp, 1, network)[0]
    out[TP_ROW] = {w: ms / getattr(CALIBRATION.link, w) for w in WAYS}
    return out


def rank_work(
    parts: dict, m: ModelConfig, tp: int, count: int, rank: tuple, runs: int
) -> tuple[Classes, float]:
    """One pipeline rank's step of `count` pieces in `runs` schedule runs without the bubble and
    the sends, `rank` its (`rank_holdings`, `recomputed_shares`, `gathered_params`) entries; its
    FSDP2 traffic's least time: each run's gathers and one reduce-scatter of its gradients
    (torch reduces at every schedule run's end)."""
    (blocks, first, last), (once, twice), gathered = rank
    classes = _weighted(
        [
            (count * blocks, parts["block"]),
            (count * blocks * once, parts["recompute"]),
            (count * first, parts["embedding"]),
            (count * last, parts["head"]),
        ]
    )
    if twice:  # a split backward's second recomputation
        extra = {w: max(0.0, t) for w, t in _total(parts["recompute"]).items()}
        classes[RECOMPUTE_ROW] = {w: count * blocks * twice * t for w, t in extra.items()}
    own = [ParamCounts.of(m, k, first, last) for k in (1, tp)]
    params = [n.root + blocks * n.block for n in own]
    # the optimizer steps once a step, over the rank's parameters
    classes[ADAMW_ROW] = {w: params[0] * t for w, t in parts["adamw_per_param"].items()}
    classes[IDLE_ROW] = _idle(classes)
    fsdp = parts["gather_ms_per_param"] * gathered + parts["reduce_ms_per_param"] * params[1]
    return classes, runs * fsdp


def pipeline_step(
    cfg: Config,
    world: int,
    device: str = "H100-SXM",
    microbatches: int | None = None,
    network: str = "ib-ndr",
) -> dict[str, Any]:
    """One GPU's step under pipeline parallelism x FSDP2 x TP at the slowest pipeline rank
    (`rank_work`, one piece at a time), the schedule's bubble once per accumulation step, and the
    sends between stages on their link. `microbatches` replaces the plan's (a published run's,
    which this framework's checks may refuse: torchtitan ran interleaved 1F1B with fewer)."""
    plan, m = target_plan(cfg, world), cfg.model
    pp, v = plan.pp_degree, plan.pp_stages_per_rank
    pieces = microbatches or plan.pp_microbatches
    stage = {"parallel.pipeline_parallel": 1, "parallel.world_size": None}
    # a stage priced for one gather and one reduce-scatter: rank_work counts them by rank
    for key in ("reshard_after_forward", "reduce_every_micro_step"):
        stage[f"parallel.fsdp.{key}"] = False
    piece = plan.micro_batch_size // pieces
    parts = stage_parts(with_changes(cfg, stage), piece, device, world // pp, network)
    count = pieces * plan.grad_accum  # pieces a step
    held, gathered = rank_holdings(cfg, plan, v), gathered_params(cfg, plan, pieces, v)
    ranks = list(zip(held, recomputed_shares(cfg, plan, pieces, v), gathered))
    # one price per distinct rank (grad_accum schedule runs a step): the step waits for the slowest
    priced = {r: rank_work(parts, m, plan.tp_degree, count, r, plan.grad_accum) for r in set(ranks)}
    work_of = {r: _total(c)["point"] for r, (c, _) in priced.items()}
    slowest = max(ranks, key=work_of.get)
    classes, fsdp = priced[slowest]
    schedule = cfg.parallel.pipeline.schedule
    bubble = pipeline_bubble(pp, pieces, schedule, v)  # each schedule run's fill and drain
    work = _total(classes)
    if fsdp:
        classes[FSDP_ROW] = {w: max(0.0, fsdp - t) for w, t in work.items()}
    # the pieces wait in the fill and drain; AdamW (and its share of the idle) runs after
    pieces_ms = {
        w: t - classes[ADAMW_ROW][w] / getattr(CALIBRATION.busy, w) for w, t in work.items()
    }
    classes[PP_ROW] = {w: t * bubble / (1 - bubble) for w, t in pieces_ms.items()}
    p2p = pipeline_p2p_bytes(piece * m.seq_len, m.d_model, count, v, plan.tp_degree)
    rate, link = link_of(pp, world // pp, network)  # pp outermost: its neighbours
    classes[P2P_ROW] = {w: 1e3 * p2p / rate if pp > 1 else 0.0 for w in WAYS}
    ms = _total(classes)
    tokens = plan.micro_batch_size * plan.grad_accum * m.seq_len * plan.dp_degree / world
    flops = build_model(m).flops_per_token() * tokens  # one GPU's share of the model's FLOPs
    (blocks, first, last), *_ = slowest
    rank = {"rank": ranks.index(slowest), "blocks": blocks, "embedding": first, "head": last}
    return {
        "pipeline": {"stages": pp, "stages_per_rank": v, "schedule": schedule, "pieces": count},
        "slowest_rank": rank,
        "rank_work_ms": [work_of[r] for r in ranks],
        "fsdp_ms": fsdp,
        "bubble": bubble,
        "p2p_bytes": p2p,
        "p2p_link": link,
        "classes": classes,
        "ms": ms,
        "mfu": {w: flops / (t / 1e3) / DEVICES[device][0] for w, t in ms.items()},
        "tokens_per_s_per_gpu": {w: tokens / (t / 1e3) for w, t in ms.items()},
    }


def format_pipeline(p: dict[str, Any]) -> list[str]:
    """The pipeline's lines: one GPU's step at the slowest rank, the bubble and the sends."""
    pipe, rank, ms = p["pipeline"], p["slowest_rank"], p["ms"]
    held = " and ".join(part for part in ("embedding", "head") if rank[part])
    return [
        f"under pipeline parallel {pipe['stages']} ({pipe['schedule']}, {pipe['stages_per_rank']} "
        f"stage(s) a rank, {pipe['pieces']} microbatches a step): the above is the whole model; "
        f"the slowest rank, {rank['rank']}, holds {rank['blocks']} blocks"
        f"{' with the ' + held if held else ''}; "
        f"the stages' sends: {p['p2p_bytes'] / 1e9:,.1f} GB a GPU on {p['p2p_link']}",
        *_ms_table(p["classes"]),
        f"pipelined step: {ms['point']:.0f} ms [{ms['high']:.0f}-{ms['low']:.0f}], bubble "
        f"{p['bubble']:.1%}; MFU {_span(p['mfu'], 0.01, '.0f', '%')}; "
        f"{_span(p['tokens_per_s_per_gpu'], 1, ',.0f')} tokens/s per GPU",
    ]


# Llama 3.1 405B (Meta's config.json) as torchtitan trained it on 512 H100s (benchmarks/
# llama3_h100_202412_torchtitan.md, Table 5): seq 8192, full checkpointing, compiled, Float8
# tensorwise, local batch 32, global 256
LLAMA_405B = [
    *("model.vocab_size=128256", "model.d_model=16384", "model.n_layers=126"),
    *("model.n_heads=128", "model.n_kv_heads=8", "model.mlp_hidden=53248"),
    *("model.seq_len=8192", "model.rope_theta=500000.0", "model.tie_embeddings=false"),
    *("activation_checkpointing.mode=full", "train.compile=true", "parallel.backend=fsdp"),
    *("train.fp8.enabled=true", "train.fp8.recipe=tensorwise"),
]
# (tp, pp, schedule, stages a rank, micro-batch (local batch), microbatches, published
# tokens/s/GPU): torchtitan's two rows first (8 microbatches, its default: the pipeline degree)
PIPELINE_CANDIDATES = (
    (8, 8, "1f1b", 1, 32, 8, 100),
    (8, 8, "interleaved_1f1b", 2, 32, 8, 128),
    (8, 8, "1f1b", 1, 32, 32, None),
    (8, 8, "interleaved_1f1b", 2, 32, 32, None),
    (8, 8, "zero_bubble", 2, 32, 32, None),
    (8, 4, "interleaved_1f1b", 2, 16, 16, None),
    (8, 16, "interleaved_1f1b", 2, 64, 32, None),
)


def pipeline_candidates(world: int = 512, device: str = "H100-500W") -> list[dict[str, Any]]:
    """LLAMA_405B at each PIPELINE_CANDIDATES layout on `world` GPUs: the pipelined step."""
    rows = []
    for tp, pp, schedule, v, local, pieces, published in PIPELINE_CANDIDATES:
        dp = world // (tp * pp)
        keys = {"tensor_parallel": tp, "pipeline_parallel": pp, "pipeline.schedule": schedule}
        keys |= {"pipeline.stages_per_rank": v, "pipeline.microbatches": max(pieces, pp * v)}
        sets = [f"parallel.{k}={x}" for k, x in keys.items()]
        sets += [f"train.micro_batch_size={local}", f"train.global_batch_size={local * dp}"]
        cfg = load_config(None, [*LLAMA_405B, *sets])
        step = pipeline_step(cfg, world, device, microbatches=pieces)
        rows.append({"layout": (dp, tp, pp, schedule, v, pieces), "published": published, **step})
    return rows


# Llama-2-70B (yaml/70b.yaml) on 64 H100s, 8 nodes x 8, 512 sequences a step, full
# checkpointing: (pp, tp, schedule, stages a rank, micro-batch, microbatches). The data-parallel
# ranks are the rest (FSDP2); grad_accum = 512 / (micro-batch x dp). Mesh pp x shard x tp: a
# dim spans nodes when it and the dims inside it hold more than 8 ranks (`crosses_nodes`)
LAYOUTS_70B = (
    (1, 2, "-", 1, 8, 1),  # yaml/70b.yaml: FSDP2 32 x TP 2
    (1, 8, "-", 1, 8, 1),
    (4, 8, "interleaved_1f1b", 2, 32, 32),  # FSDP2 2 across nodes
    (8, 8, "1f1b", 1, 64, 64),  # no data parallelism: one pipeline of 64 ranks
    (8, 4, "interleaved_1f1b", 2, 64, 64),  # FSDP2 2 x TP 4: one node a stage
    (8, 2, "interleaved_1f1b", 2, 64, 64),  # FSDP2 4 x TP 2
    (8, 2, "1f1b", 1, 64, 64),
    (8, 1, "1f1b", 1, 64, 64),  # FSDP2 8 inside a node, no tensor parallelism
    (8, 1, "interleaved_1f1b", 2, 64, 64),
    (8, 1, "zero_bubble", 2, 64, 64),
    (8, 1, "interleaved_1f1b", 2, 32, 32),
    (16, 1, "interleaved_1f1b", 2, 64, 64),  # FSDP2 4 inside half a node
)


def layout_config(pp: int, tp: int, schedule: str, v: int, micro: int, pieces: int) -> Config:
    """yaml/70b.yaml at one LAYOUTS_70B row on 64 GPUs."""
    sets = [f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}"]
    sets += [f"train.micro_batch_size={micro}", f"parallel.sequence_parallel={tp > 1}"]
    if pp > 1:
        pipe = {"schedule": schedule, "microbatches": pieces, "stages_per_rank": v}
        sets += [f"parallel.pipeline.{k}={x}" for k, x in pipe.items()]
    return load_config(YAML / "70b.yaml", sets)


def layout_step(cfg: Config, world: int, device: str, network: str) -> dict[str, Any]:
    """One GPU's predicted step of `cfg` on `world` GPUs (pipelined where pp > 1)."""
    plan = target_plan(cfg, world)
    if plan.pp_degree > 1:
        return pipeline_step(cfg, world, device, network=network)
    r = roofline(cfg, plan.micro_batch_size, plan.grad_accum, device, world, network)
    return {"bubble": 0.0, **r["achieved"]}


def layout_candidates(world: int = 64, device: str = "H100-SXM") -> list[dict[str, Any]]:
    """Each LAYOUTS_70B row: the plan, the estimate's GiB per GPU, the step on each NETWORKS."""
    rows = []
    for layout in LAYOUTS_70B:
        cfg = layout_config(*layout)
        plan = target_plan(cfg, world)
        steps = {n: layout_step(cfg, world, device, n) for n in NETWORKS}
        gib = estimate(cfg, plan).total / GiB
        rows.append({"layout": layout, "plan": plan, "gib": gib, "steps": steps})
    return rows
