"""Per-GPU memory: a prediction before training (`scale-llm estimate`, `train --report-memory`),
a plan that fits a budget (`--fit 80GiB`), and a CPU measurement that keeps the prediction honest.

The estimate is a sum of parts, per GPU, in bytes:

  params       the parameter storage the backend keeps (fp32 master weights, 16-bit copies,
               sharded or gathered)
  grads        gradient storage (full, or sharded, in the precision the backend accumulates in)
  optimizer    AdamW's two moments (and DeepSpeed's fp32 master copy), full or partitioned
  activations  what the forward pass saves for backward, for the attention implementation and
               checkpointing mode, plus what backward needs on top: one checkpointed block
               recomputed at a time, and autocast's 16-bit weight copies
  logits       the B x T x vocab buffers of the loss: fp32 log-probabilities and their gradient
  overhead     a stated allowance: 5% of the rest for temporaries and allocator slack

The activation formula follows this project's model op by op (see `block_activation_bytes`); it
is checked against `measure_saved_bytes`, which counts what autograd really saves on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from scale_llm.config import Config, ModelConfig
from scale_llm.errors import UserError
from scale_llm.model import mlp_hidden_size

GiB = 1 << 30
OVERHEAD_FRACTION = 0.05


# ----------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class Numerics:
    """How tensors are stored in the forward pass.

    compute: bytes of matmul inputs/outputs (2 under bf16/fp16, 4 in fp32)
    residual: bytes of the residual stream (4 with fp32 params + autocast; 2 when the whole module
              runs in 16 bits, as under FSDP's MixedPrecisionPolicy or DeepSpeed bf16/fp16)
    autocast: matmul inputs and weights are cast per op (and the casts saved for backward)
    """

    compute: int
    residual: int
    autocast: bool


def numerics_for(precision: str, backend: str) -> Numerics:
    if precision == "fp32":
        return Numerics(4, 4, False)
    if backend in ("fsdp", "deepspeed"):
        return Numerics(2, 2, False)
    return Numerics(2, 4, True)


def _dims(m: ModelConfig) -> dict[str, int]:
    head_dim = m.d_model // m.n_heads
    kv_heads = m.n_kv_heads or m.n_heads
    return {
        "d": m.d_model,
        "dq": m.n_heads * head_dim,
        "dkv": kv_heads * head_dim,
        "F": mlp_hidden_size(m),
        "D": head_dim,
        "H": m.n_heads,
        "V": m.vocab_size,
    }


def block_matmul_params(m: ModelConfig) -> int:
    g = _dims(m)
    return g["d"] * (g["dq"] + 2 * g["dkv"]) + g["dq"] * g["d"] + 3 * g["d"] * g["F"]


def block_activation_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """Bytes one transformer block saves for backward without checkpointing.

    Per RMSNorm: an fp32 copy of its input and of input * rsqrt (2 x 4 B x N x d) plus the rsqrt
    (4 B x N). Attention (sdpa): q, k, the fused qkv output that v views, the output and the
    log-sum-exp. Attention (eager): contiguous q, k, v and output copies, the causal mask, the
    fp32 softmax (B x heads x T x T) and, under 16 bits, its cast (at batch 1 without GQA, v
    stays a view of the fused qkv output, which is kept whole). MLP: w1 and w3 outputs, SiLU
    output and the product (4 x N x mlp_hidden). Autocast saves each matmul's 16-bit input
    (w1 and w3 cast theirs separately) and 16-bit weight copies.
    """
    g, a, T = _dims(m), num.compute, m.seq_len
    N = batch * T
    norms = 2 * (8 * N * g["d"] + 4 * N)
    norm_outputs = a * N * g["d"] * (3 if num.autocast else 2)
    if m.attention == "eager":
        scores = batch * g["H"] * T * T
        attention = a * N * 4 * g["dq"] + T * T + 4 * scores + (a * scores if a != 4 else 0)
        if batch == 1 and g["dkv"] == g["dq"]:  # v reaches the matmul as a view of qkv
            attention += a * N * 2 * g["dkv"]
    else:
        attention = a * N * (3 * g["dq"] + 3 * g["dkv"]) + 4 * batch * g["H"] * T
    mlp = 4 * a * N * g["F"]
    weight_copies = 2 * block_matmul_params(m) if num.autocast else 0
    return norms + norm_outputs + attention + mlp + weight_copies


def selective_block_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """Selective checkpointing keeps the block input and every matmul / attention output."""
    g, a, T = _dims(m), num.compute, m.seq_len
    N = batch * T
    matmuls = a * N * ((g["dq"] + 2 * g["dkv"]) + g["d"] + 2 * g["F"] + g["d"])  # qkv wo w1 w3 w2
    if m.attention == "eager":
        attention = a * batch * g["H"] * T * T + a * N * g["dq"]  # q @ k^T and probs @ v
    else:
        attention = a * N * g["dq"] + 4 * batch * g["H"] * T  # output and log-sum-exp
    return num.residual * N * g["d"] + matmuls + attention


def head_activation_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """Outside the blocks: token ids and targets, rotary tables, the final norm and head input,
    autocast's copy of the output weight, and the fp32 log-probabilities of the loss."""
    g, T = _dims(m), m.seq_len
    N = batch * T
    tokens = 8 * batch * (T + 1) + 8 * N
    rope = 4 * T * g["D"]
    final_norm = 8 * N * g["d"] + 4 * N + num.compute * N * g["d"]
    head_copy = 2 * g["V"] * g["d"] if num.autocast else 0
    return tokens + rope + final_norm + head_copy + 4 * N * g["V"]


def checkpointed_count(m: ModelConfig) -> int:
    from scale_llm.parallel.checkpointing import checkpointed_blocks

    return len(checkpointed_blocks(m))


def saved_activation_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """Everything the forward pass (with loss) saves for backward: what `measure_saved_bytes`
    counts on the CPU."""
    full = block_activation_bytes(m, batch, num)
    kept = m.n_layers - checkpointed_count(m)
    if m.activation_checkpointing == "selective":
        per_ckpt = selective_block_bytes(m, batch, num)
    else:
        per_ckpt = num.residual * batch * m.seq_len * m.d_model  # only the block input
    return kept * full + checkpointed_count(m) * per_ckpt + head_activation_bytes(m, batch, num)


def recompute_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """Extra during backward: the one checkpointed block whose forward is being recomputed."""
    if checkpointed_count(m) == 0:
        return 0
    full = block_activation_bytes(m, batch, num)
    if m.activation_checkpointing == "selective":
        return full - selective_block_bytes(m, batch, num)
    return full


# ----------------------------------------------------------------------------- model states


@dataclass(frozen=True)
class Layout:
    """The settings that decide per-GPU memory."""

    backend: str
    precision: str  # bf16 | fp16 | fp32 (auto is taken as bf16: the estimate is for GPUs)
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


def layout_of(cfg: Config, world: int) -> Layout:
    p, t = cfg.parallel, cfg.train
    precision = "bf16" if t.precision == "auto" else t.precision
    return Layout(
        backend=p.backend,
        precision=precision,
        world=world,
        micro_batch=t.micro_batch_size,
        grad_accum=t.grad_accum,
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
    weights (16-bit modes) plus two moments, partitioned by stage."""
    P, W, s = n.total, lay.world, lay.zero_stage
    optim = (12 if half else 8) * P
    params = c * P / W if s >= 3 else c * P
    grads = c * P / W if s >= 2 else c * P
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
            "activation_checkpointing": self.model.activation_checkpointing,
            "attention": self.model.attention,
        }


def estimate_layout(m: ModelConfig, lay: Layout) -> Estimate:
    n = ParamCounts.of(m)
    num = numerics_for(lay.precision, lay.backend)
    gpu, cpu = state_bytes(n, lay)
    saved = saved_activation_bytes(m, lay.micro_batch, num)
    logits_saved = 4 * lay.micro_batch * m.seq_len * m.vocab_size
    gpu["activations"] = saved - logits_saved + recompute_bytes(m, lay.micro_batch, num)
    gpu["logits"] = 2 * logits_saved  # fp32 log-probs and, in backward, their gradient
    gpu["overhead"] = OVERHEAD_FRACTION * sum(gpu.values())
    gpu["total"] = sum(gpu.values())
    return Estimate(n.total, lay, m, gpu, cpu)


def estimate(cfg: Config, world: int) -> Estimate:
    return estimate_layout(cfg.model, layout_of(cfg, world))


# ----------------------------------------------------------------------------- measurement


def measure_saved_bytes(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    autocast: contextlib.AbstractContextManager | None = None,
) -> int:
    """Bytes of the distinct storages the forward pass and loss keep for backward.

    saved_tensors_hooks see everything autograd saves (checkpointed blocks save only their
    inputs). Selective checkpointing keeps matmul outputs in its own cache rather than through
    autograd, so a dispatch mode also records every op output and counts those still alive
    after the forward pass. Parameters are not activations and are left out.
    """
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    from scale_llm.train.trainer import cross_entropy

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    outputs: dict[int, tuple[StorageWeakRef, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    st = t.untyped_storage()
                    outputs[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
            return out

    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Outputs():
        with autocast or contextlib.nullcontext():
            logits = model(inputs)
        loss = cross_entropy(logits, targets)
    del logits
    alive = {
        ptr: nbytes
        for ptr, (ref, nbytes) in outputs.items()
        if not ref.expired() and ptr not in params
    }
    alive.pop(loss.untyped_storage().data_ptr(), None)
    total = sum({**alive, **saved}.values())
    del loss
    return total


def measure_activations(cfg: Config) -> tuple[int, int]:
    """(counted, predicted) saved bytes for cfg's model at its micro-batch, on the CPU, with the
    precision the config's backend would use (autocast, fp32 or a 16-bit module)."""
    from scale_llm.model import build_model
    from scale_llm.parallel.checkpointing import apply_activation_checkpointing

    precision = "bf16" if cfg.train.precision == "auto" else cfg.train.precision
    num = numerics_for(precision, cfg.parallel.backend)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, "cpu")
    if num.compute == 2 and not num.autocast:
        model = model.to(torch.bfloat16)
    apply_activation_checkpointing(model, cfg.model)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if num.autocast else None
    mb = cfg.train.micro_batch_size
    tokens = torch.randint(0, cfg.model.vocab_size, (mb, cfg.model.seq_len + 1))
    return measure_saved_bytes(model, tokens, autocast), saved_activation_bytes(cfg.model, mb, num)


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


def _ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)


# ----------------------------------------------------------------------------- report and hints


_DESCRIPTIONS = {
    "params": "parameter storage (fp32 master weights, 16-bit copies, shards or gathered blocks)",
    "grads": "gradients",
    "optimizer": "AdamW moments (and DeepSpeed's fp32 master weights)",
    "activations": "saved for backward, incl. one recomputed block and autocast weight copies",
    "logits": "B x T x vocab fp32 log-probs and their gradient",
    "overhead": f"allowance: {OVERHEAD_FRACTION:.0%} of the rest for temporaries and slack",
}


def with_changes(cfg: Config, changes: dict[str, Any]) -> Config:
    """A copy of cfg with dotted keys replaced (values already typed)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        parts = key.split(".")
        sections.setdefault(".".join(parts[:-1]), {})[parts[-1]] = value
    out = cfg
    for path, values in sections.items():
        names = path.split(".")
        parents = [out]
        for name in names:
            parents.append(getattr(parents[-1], name))
        node = dataclasses.replace(parents[-1], **values)
        for parent, name in zip(reversed(parents[:-1]), reversed(names)):
            node = dataclasses.replace(parent, **{name: node})
        out = node
    return out


def format_overrides(changes: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    return " ".join(f"--set {k}={fmt(v)}" for k, v in changes.items())


def hints(cfg: Config, world: int) -> list[tuple[str, float]]:
    """(flags, predicted total) for the usual ways to save memory from this config."""
    t, m, p = cfg.train, cfg.model, cfg.parallel
    options: list[tuple[str, dict[str, Any]]] = []
    if m.activation_checkpointing != "full":
        options.append(("--grad-checkpointing", {"model.activation_checkpointing": "full"}))
    if m.activation_checkpointing in ("none", "every_k"):
        options.append(
            (
                "--set model.activation_checkpointing=selective",
                {"model.activation_checkpointing": "selective"},
            )
        )
    if t.micro_batch_size > 1:
        mb = t.micro_batch_size // 2
        accum = t.grad_accum * t.micro_batch_size // mb
        if mb * accum == t.micro_batch_size * t.grad_accum:
            options.append(
                (
                    f"--batch_size {mb} --grad-accum {accum}",
                    {"train.micro_batch_size": mb, "train.grad_accum": accum},
                )
            )
    if p.backend in ("single", "ddp") and world > 1:
        options.append(("--set parallel.backend=fsdp", {"parallel.backend": "fsdp"}))
    if p.backend == "deepspeed" and p.deepspeed.zero_stage < 3:
        stage = p.deepspeed.zero_stage + 1
        options.append(
            (
                f"--set parallel.deepspeed.zero_stage={stage}",
                {"parallel.deepspeed.zero_stage": stage},
            )
        )
    return [(flags, estimate(with_changes(cfg, ch), world).total) for flags, ch in options]


def format_report(est: Estimate, cfg: Config, world: int, source: str) -> str:
    m, lay = est.model, est.layout
    lines = [
        f"memory estimate for {source}: {est.params / 1e6:.1f}M parameters; {lay.describe()}",
        f"  micro_batch {lay.micro_batch} x seq_len {m.seq_len}, attention {m.attention}, "
        f"activation_checkpointing {m.activation_checkpointing}"
        + (
            f" (k={m.activation_checkpointing_k})"
            if m.activation_checkpointing == "every_k"
            else ""
        ),
        "per GPU:",
    ]
    for key in ("params", "grads", "optimizer", "activations", "logits", "overhead"):
        lines.append(f"  {key:<12} {gib(est.gpu[key]):>12}   {_DESCRIPTIONS[key]}")
    lines.append(f"  {'total':<12} {gib(est.total):>12}")
    cpu = {k: v for k, v in est.cpu.items() if v}
    if cpu:
        lines.append(
            "per rank in CPU memory (offloaded): "
            + ", ".join(f"{k} {gib(v)}" for k, v in cpu.items())
        )
    options = hints(cfg, world)
    if options:
        lines.append("to reduce:")
        for flags, total in sorted(options, key=lambda o: o[1]):
            lines.append(f"  {flags:<48} total {gib(total)} ({gib(total - est.total)})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- fit plan

# Rough throughput cost of each choice (1.0 = free); the plan picks the cheapest layout that fits.
_AC_COST = {"none": 1.0, "selective": 1.1, "every_k": 1.17, "full": 1.33}  # recompute share


def _micro_batch_cost(mb: int) -> float:
    return {1: 1.25, 2: 1.1}.get(mb, 1.0)  # small micro-batches leave a GPU underused


def _shard_options(cfg: Config) -> list[tuple[dict[str, Any], float]]:
    """Backend settings from least to most memory-saving, with their rough cost."""
    b = cfg.parallel.backend
    fsdp = [
        ({"parallel.backend": "fsdp", "parallel.fsdp.reshard_after_forward": False}, 1.02),
        ({"parallel.backend": "fsdp", "parallel.fsdp.reshard_after_forward": True}, 1.1),
        (
            {
                "parallel.backend": "fsdp",
                "parallel.fsdp.reshard_after_forward": True,
                "parallel.fsdp.cpu_offload": True,
            },
            1.6,
        ),
    ]
    ds = [
        ({"parallel.backend": "deepspeed", "parallel.deepspeed.zero_stage": s}, c)
        for s, c in ((0, 1.0), (1, 1.0), (2, 1.02), (3, 1.1))
    ]
    ds += [
        (
            {
                "parallel.backend": "deepspeed",
                "parallel.deepspeed.zero_stage": 2,
                "parallel.deepspeed.offload_optimizer": "cpu",
            },
            1.5,
        ),
        (
            {
                "parallel.backend": "deepspeed",
                "parallel.deepspeed.zero_stage": 3,
                "parallel.deepspeed.offload_optimizer": "cpu",
            },
            1.6,
        ),
    ]
    last = (
        {
            "parallel.backend": "deepspeed",
            "parallel.deepspeed.zero_stage": 3,
            "parallel.deepspeed.offload_optimizer": "cpu",
            "parallel.deepspeed.offload_param": "cpu",
        },
        2.0,
    )
    if b == "deepspeed":
        return [*ds, last]
    if b == "fsdp":
        return [*fsdp, last]
    return [({"parallel.backend": b}, 1.0), *fsdp, last]


@dataclass
class Plan:
    changes: dict[str, Any]
    estimate: Estimate
    cost: float


def fit(cfg: Config, world: int, budget: int) -> Plan:
    """The cheapest layout (by the rough cost model above) whose estimate fits in `budget`.

    Keeps the sequences per step: micro_batch x grad_accum stays the same.
    """
    per_rank = cfg.train.micro_batch_size * cfg.train.grad_accum
    micro_batches = [d for d in range(per_rank, 0, -1) if per_rank % d == 0]
    best: Plan | None = None
    smallest: Plan | None = None
    for shard, shard_cost in _shard_options(cfg):
        for mode, ac_cost in _AC_COST.items():
            for mb in micro_batches:
                changes = {
                    **shard,
                    "model.activation_checkpointing": mode,
                    "train.micro_batch_size": mb,
                    "train.grad_accum": per_rank // mb,
                }
                if mode == "every_k":
                    changes["model.activation_checkpointing_k"] = 2
                est = estimate(with_changes(cfg, changes), world)
                plan = Plan(changes, est, shard_cost * ac_cost * _micro_batch_cost(mb))
                if smallest is None or est.total < smallest.estimate.total:
                    smallest = plan
                if est.total <= budget and (best is None or plan.cost < best.cost):
                    best = plan
    if best is None:
        raise UserError(
            f"nothing fits in {gib(budget)} per GPU, even with DeepSpeed ZeRO-3, optimizer and "
            f"parameter offload, full activation checkpointing and micro-batch 1: the smallest "
            f"total reachable is {gib(smallest.estimate.total)} "
            f"({format_overrides(smallest.changes)}). "
            f"Use more GPUs (--world-size), a shorter model.seq_len or a smaller model"
        )
    best.changes = _only_changed(cfg, best.changes)
    return best


def _only_changed(cfg: Config, changes: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in changes.items():
        node: Any = cfg
        for part in key.split("."):
            node = getattr(node, part)
        if node != value:
            out[key] = value
    return out
