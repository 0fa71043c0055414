"""`scale-llm bench`: the trainer's optimizer step on synthetic tokens (no data needed): tokens/s,
ms per step, MFU and peak memory. `--reference` times it against a bare loop (of the same model,
or of a GPT-2-style one), compiled against eager, or N processes against one; `--sweep` tabulates
layouts against the memory estimate; `--checkpoint-io` times saves."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import itertools
import logging
import random
import re
import shutil
import statistics
import time
import typing
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scale_llm.analysis.memory import estimate
from scale_llm.analysis.memory.estimate import Estimate, GiB, estimate_layout
from scale_llm.analysis.memory.host import check_host_memory, host_memory_problem
from scale_llm.analysis.memory.pipeline import pipeline_estimate
from scale_llm.components import checkpoint as ck
from scale_llm.components import digests
from scale_llm.components.distributed import barrier, is_distributed, rank_and_world
from scale_llm.components.hardware import cuda_memory_gib, peak_flops
from scale_llm.components.loss import plain_cross_entropy
from scale_llm.components.serialization import background_save, kept_stager
from scale_llm.config import ActivationCheckpointingConfig, Config, compiles, validate, with_changes
from scale_llm.config.plan import RunPlan, launch_problems
from scale_llm.errors import UserError
from scale_llm.files import private_dir
from scale_llm.model import build_model, materialize
from scale_llm.parallel.activation_checkpointing import apply_activation_checkpointing
from scale_llm.parallel.backend import build_backend
from scale_llm.parallel.compile import compile_blocks
from scale_llm.parallel.fp8 import check_fp8
from scale_llm.parallel.step import optimizer_step

log = logging.getLogger(__name__)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh_start(device: torch.device) -> None:
    """Free the last measurement's models (compiled blocks hold reference cycles) and what
    torch.compile saw (other shapes would compile dynamic, each recompile counting to a limit)."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def preflight(cfg: Config, plan: RunPlan, **host: int) -> None:
    """What the trainer's preflight would refuse of a bench (fp8 with its backend and GPU), and
    the host's memory (`host`: check_host_memory's counts), before any model is built."""
    check_fp8(cfg, plan)
    check_host_memory(cfg, plan, **host)


def bench(cfg: Config, plan: RunPlan, steps: int = 10, warmup: int = 3) -> dict[str, Any]:
    preflight(cfg, plan)  # before the model is allocated
    device, m = plan.device, cfg.model
    fresh_start(device)
    backend = build_backend(cfg, plan)
    model = build_model(m)
    flops = {"mfu": model.flops_per_token(), "mfu_causal": model.flops_per_token(causal=True)}
    n_params = model.num_params()
    wrapped = backend.setup(model)
    # drawn on the device: no host-to-device copy (a synchronizing one, from pageable memory)
    # inside the timed steps; the trainer's loader copies from pinned memory without blocking
    gen = torch.Generator(device=device).manual_seed(cfg.run.seed + plan.rank)
    shape = (plan.micro_batch_size, m.seq_len + 1)
    draw = lambda: torch.randint(0, m.vocab_size, shape, generator=gen, device=device)
    batches = lambda: [(t[:, :-1], t[:, 1:]) for t in (draw() for _ in range(plan.grad_accum))]
    step = lambda: optimizer_step(backend, wrapped, batches())[0]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = interleaved_times({"bench": step}, 1, steps, device, warmup=warmup)["bench"][0]
    tokens = plan.tokens_per_step_per_rank
    result: dict[str, Any] = {
        "params": n_params,
        "precision": plan.precision,
        "device": str(device),
        "tokens_per_step_per_rank": tokens,
        "ms_per_step": seconds * 1e3,
        "tokens_per_s_per_rank": tokens / seconds,
    }
    peak = peak_flops(device, plan.precision, cfg.logging.peak_tflops)
    if peak:  # MFU counts attention whole (the convention); mfu_causal, the half computed
        result |= {key: per_token * tokens / seconds / peak for key, per_token in flops.items()}
    result.update(cuda_memory_gib(device))
    return result


def reference_step(
    model: torch.nn.Module, optimizer, batches, grad_clip: float, loss_fn=plain_cross_entropy
) -> torch.Tensor:
    """A bare PyTorch training step: no backend, guards, metrics or schedule."""
    total = torch.zeros((), device=batches[0][0].device)
    for inputs, targets in batches:
        loss = loss_fn(model(inputs), targets) / len(batches)
        loss.backward()
        total += loss.detach()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


class GPT2Block(torch.nn.Module):
    """A GPT-2 block as nanoGPT writes it: pre-LayerNorm, fused qkv, sdpa, GELU MLP, no bias."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = torch.nn.LayerNorm(d, bias=False)
        self.c_attn = torch.nn.Linear(d, 3 * d, bias=False)
        self.c_proj = torch.nn.Linear(d, d, bias=False)
        self.ln_2 = torch.nn.LayerNorm(d, bias=False)
        self.c_fc = torch.nn.Linear(d, 4 * d, bias=False)
        self.mlp_proj = torch.nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (z.view(B, T, self.heads, C // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2Reference(torch.nn.Module):
    """tokens (B, T) -> logits (B, T, vocab): learned positions, tied head, N(0, 0.02) init."""

    def __init__(self, vocab: int, d: int, n_layers: int, heads: int, seq_len: int):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(seq_len, d)
        self.layers = torch.nn.ModuleList(GPT2Block(d, heads) for _ in range(n_layers))
        self.ln_f = torch.nn.LayerNorm(d, bias=False)
        for module in self.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(module.weight, std=0.02)
        self.seq_len, self.d = seq_len, d

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.layers:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)

    def flops_per_token(self) -> int:
        """As the trainer counts: 6 x matmul params (tied head included) + 12 L d T."""
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, torch.nn.Linear))
        matmul += self.wte.weight.numel()
        return 6 * matmul + 12 * len(self.layers) * self.d * self.seq_len


REFERENCES = ("bare", "gpt2", "eager")


def bench_reference(
    cfg: Config,
    plan: RunPlan,
    steps: int = 10,
    warmup: int = 3,
    rounds: int = 5,
    kind: str = "bare",
) -> dict[str, Any]:
    """The framework's step against a reference on the same batches, interleaved, best of
    `rounds` and the median ratio's bootstrap 95% interval: "bare" (the same model in a bare
    loop), "gpt2" (a GPT-2-style model of the same widths, per FLOP), "eager" (uncompiled)."""
    if plan.world_size != 1:
        raise UserError(
            f"bench --reference {kind} compares one process; launch it without torchrun (under "
            f"torchrun, --reference scaling times the processes together against one alone)"
        )
    if kind not in REFERENCES:
        raise UserError(f"bench --reference {kind}: use {', '.join(REFERENCES)} (bare: default)")
    if kind == "eager":
        cfg = with_changes(cfg, {"train.compile": True})
    preflight(cfg, plan, models=2)  # the framework's model and the reference
    device, t, m = plan.device, cfg.train, cfg.model
    fresh_start(device)
    backend = build_backend(cfg, plan)
    ours = build_model(m)
    flops_framework = flops_reference = ours.flops_per_token()  # (gpt2: its own, below)
    framework = backend.setup(ours)
    backend.set_lr(t.lr)
    gen = torch.Generator(device="cpu").manual_seed(cfg.run.seed)
    shape = (plan.micro_batch_size * plan.grad_accum, m.seq_len + 1)
    tokens = torch.randint(0, m.vocab_size, shape, generator=gen).to(device)
    batches = [(b[:, :-1], b[:, 1:]) for b in tokens.split(plan.micro_batch_size)]
    run_framework = lambda: optimizer_step(backend, framework, batches)[0]
    if kind == "eager":  # the same backend and seed, compile off
        eager_backend = build_backend(with_changes(cfg, {"train.compile": False}), plan)
        eager = eager_backend.setup(build_model(m))
        eager_backend.set_lr(t.lr)
        run_reference = lambda: optimizer_step(eager_backend, eager, batches)[0]
    else:
        torch.manual_seed(cfg.run.seed)  # the same initial weights as the backend drew
        if kind == "bare":
            bare = materialize(build_model(m), "cpu").to(device)
            apply_activation_checkpointing(bare, cfg.activation_checkpointing)
        else:
            bare = GPT2Reference(m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.seq_len)
            bare = bare.to(device)
            flops_reference = bare.flops_per_token()
        if compiles(t, device.type):
            compile_blocks(bare)
        optimizer = torch.optim.AdamW(
            bare.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True
        )

        # bare: the framework's own loss function (chunked, or compiled with train.compile),
        # so that the difference is the framework's cost, not its loss; gpt2: the textbook one
        loss_fn = backend.loss_fn if kind == "bare" else plain_cross_entropy

        def run_reference() -> torch.Tensor:
            with backend.precision.autocast():  # (fp32: no autocast)
                return reference_step(bare, optimizer, batches, t.grad_clip, loss_fn)

    fns = {"framework": run_framework, "reference": run_reference}
    first = {name: fn().item() for name, fn in fns.items()}  # same weights, same batch
    times = interleaved_times(fns, rounds, steps, device, warmup=warmup)
    best = {name: min(seconds) for name, seconds in times.items()}
    flops = {"framework": flops_framework, "reference": flops_reference}
    tokens = plan.tokens_per_step
    # time per FLOP of the framework over the reference's, in each round (its two runs were
    # neighbours, so a machine that slows for a while slows both): their median is the
    # steadier figure on a shared machine; best-of-rounds is the classic one
    per_flop = flops_reference / flops_framework
    paired = [f / r * per_flop for f, r in zip(times["framework"], times["reference"])]
    low, high = median_interval(paired)
    return {
        "reference": kind,
        "device": str(device),
        "precision": plan.precision,
        "compile": compiles(t, device.type),
        "activation_checkpointing": cfg.activation_checkpointing.mode,
        "tokens_per_step": tokens,
        **{f"first_loss_{name}": first[name] for name in fns},
        **{f"flops_per_token_{name}": flops[name] for name in fns},
        **{f"ms_per_step_{name}": best[name] * 1e3 for name in fns},
        **{f"model_tflops_{name}": flops[name] * tokens / best[name] / 1e12 for name in fns},
        # bare: time overhead of the framework; gpt2: how much less FLOP/s it gets (< 0: more);
        # eager: compiled step time over eager's (< 0: compiled is faster)
        "overhead_percent": (best["framework"] / best["reference"] * per_flop - 1) * 100,
        "overhead_percent_median_of_rounds": (statistics.median(paired) - 1) * 100,
        "overhead_percent_median_low95": (low - 1) * 100,
        "overhead_percent_median_high95": (high - 1) * 100,
        "rounds": rounds,
        "steps_per_round": steps,
    }


def median_interval(values: list[float]) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of `values` (percentile method, a fixed seed): it
    says whether a few-% difference on a shared machine is there at all."""
    rng, n = random.Random(0), 2000  # resamples
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return medians[int(0.025 * n)], medians[int(0.975 * n) - 1]


def interleaved_times(
    fns: dict[str, Any], rounds: int, steps: int, device: torch.device, before=None, warmup=0
) -> dict[str, list[float]]:
    """Seconds per step of each function in each round after `warmup` calls of each, the order
    reversed every other round (neither always runs on the other's leftovers); `before` runs
    ahead of each (a barrier)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            if before is not None:
                before()
            synchronize(device)
            start = time.perf_counter()
            for _ in range(steps):
                loss = fns[name]()
            loss.item()
            synchronize(device)
            times[name].append((time.perf_counter() - start) / steps)
    return times


def bench_scaling(
    cfg: Config, plan: RunPlan, steps: int = 10, warmup: int = 3, rounds: int = 5
) -> dict[str, Any]:
    """Weak scaling: this launch's step on all N ranks against rank 0 alone (the others wait),
    interleaved as bench_reference; efficiency = time alone / together (1.0: nothing lost).
    Rank 0 holds both models; only DDP's first losses match the one-process backend's."""
    if plan.world_size < 2:
        raise UserError(SCALING_NEEDS_A_WORLD)
    preflight(cfg, plan)
    device, m = plan.device, cfg.model
    fresh_start(device)
    backend = build_backend(cfg, plan)
    model = build_model(m)
    flops_per_token = model.flops_per_token()
    together = backend.setup(model)
    backend.set_lr(cfg.train.lr)
    alone_backend = alone = None
    if plan.is_main:
        solo_cfg, solo = solo_layout(cfg, plan)
        if plan.backend == "deepspeed" and cfg.parallel.deepspeed.zero_stage == 3:
            solo_cfg = with_changes(solo_cfg, {"train.compile": False})  # ZeRO-3's: eager
        alone_backend = build_backend(solo_cfg, solo)
        alone_backend.loss_fn = backend.loss_fn  # (compiled with train.compile)
        alone = alone_backend.setup(build_model(m))  # the same seeded weights
        alone_backend.set_lr(cfg.train.lr)
    gen = torch.Generator(device=device).manual_seed(cfg.run.seed + plan.rank)
    shape = (plan.micro_batch_size * plan.grad_accum, m.seq_len + 1)
    tokens = torch.randint(0, m.vocab_size, shape, generator=gen, device=device)
    batches = [(b[:, :-1], b[:, 1:]) for b in tokens.split(plan.micro_batch_size)]
    idle = torch.zeros((), device=device)
    fns = {
        "together": lambda: optimizer_step(backend, together, batches)[0],
        # the other ranks: nothing (they wait at the barrier)
        "alone": lambda: optimizer_step(alone_backend, alone, batches)[0] if plan.is_main else idle,
    }
    first = {name: fn() for name, fn in fns.items()}  # same weights, same batch
    times = interleaved_times(fns, rounds, steps, device, before=dist.barrier, warmup=warmup)
    dist.barrier()
    best = {name: min(seconds) for name, seconds in times.items()}
    paired = [a / t for a, t in zip(times["alone"], times["together"])]
    low, high = median_interval(paired)
    per_rank = plan.tokens_per_step_per_rank
    result: dict[str, Any] = {
        "reference": "scaling",
        "backend": plan.backend,
        "world_size": plan.world_size,
        "device": str(device),
        "precision": plan.precision,
        "compile": compiles(cfg.train, plan.device.type),
        "activation_checkpointing": cfg.activation_checkpointing.mode,
        "tokens_per_step_per_rank": per_rank,
        "first_loss_together": first["together"].item(),
        "first_loss_alone": first["alone"].item() if plan.is_main else None,
        "ms_per_step_together": best["together"] * 1e3,
        "ms_per_step_alone": best["alone"] * 1e3,
        "tokens_per_s_together": plan.world_size * per_rank / best["together"],
        "tokens_per_s_alone": per_rank / best["alone"],
        "scaling_efficiency": best["alone"] / best["together"],
        "scaling_efficiency_median_of_rounds": statistics.median(paired),
        "scaling_efficiency_median_low95": low,
        "scaling_efficiency_median_high95": high,
        "rounds": rounds,
        "steps_per_round": steps,
    }
    peak = peak_flops(device, plan.precision, cfg.logging.peak_tflops)
    if peak:
        result["mfu_together"] = flops_per_token * per_rank / best["together"] / peak
    return result


SCALING_NEEDS_A_WORLD = (
    "bench --reference scaling times this launch's processes together against one of them "
    "alone: start it with 2 or more, e.g. `torchrun --nproc_per_node 2 -m scale_llm bench "
    "CONFIG --reference scaling`"
)


def solo_layout(cfg: Config, plan: RunPlan) -> tuple[Config, RunPlan]:
    """The config and plan of `plan`'s model run by rank 0 alone (the scaling reference): one
    process, no tensor or pipeline parallelism, on this rank's device."""
    solo = dataclasses.replace(
        plan, backend="single", world_size=1, dp_degree=1, tp_degree=1, replicate_degree=1,
        pp_degree=1, pp_stages_per_rank=1, pp_microbatches=1,
    )  # fmt: skip
    return with_changes(cfg, {"parallel.pipeline_parallel": 1}), solo


BACKENDS = ("single", "ddp", "fsdp", "zero0", "zero1", "zero2", "zero3")


def backend_changes(name: str, world_size: int) -> dict[str, Any]:
    """The config changes that select `--sweep-backend` entry `name` (zeroN: DeepSpeed at ZeRO
    stage N); a UserError before any process group exists for one this launch cannot run."""
    tp = re.fullmatch(r"fsdp-tp(\d+)", name)
    if tp:  # FSDP2 x tensor parallelism of that degree (the rest of the ranks: FSDP2's)
        degree = int(tp[1])
        if degree < 2 or world_size % degree:
            fits = [d for d in range(2, world_size + 1) if world_size % d == 0]
            use = ", ".join(f"fsdp-tp{d}" for d in fits) or "fsdp (one rank has no tp)"
            raise UserError(
                f"--sweep-backend {name}: tensor parallelism {degree} does not divide this "
                f"launch's {world_size} rank(s); use {use}"
            )
        return {"parallel.backend": "fsdp", "parallel.tensor_parallel": degree}
    if name not in BACKENDS:
        raise UserError(
            f"--sweep-backend {name}: not a backend; use {', '.join(BACKENDS)} or fsdp-tpN"
        )
    if name == "single" and world_size > 1:
        raise UserError(
            f"--sweep-backend single: one process only, and this launch has {world_size}; "
            f"sweep ddp, fsdp or zeroN here, single without a launcher"
        )
    if name.startswith("zero"):
        if importlib.util.find_spec("deepspeed") is None:
            raise UserError(f"--sweep-backend {name}: deepspeed is not installed")
        return {
            "parallel.backend": "deepspeed",
            "parallel.deepspeed.zero_stage": int(name[-1]),
            "parallel.tensor_parallel": 1,
        }
    return {"parallel.backend": name, "parallel.tensor_parallel": 1}  # (fsdp-tpN: with it)


CHECKPOINTING_MODES = typing.get_args(
    typing.get_type_hints(ActivationCheckpointingConfig)["mode"]
)  # none, full, every_k, selective
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def sweep_axes(micro: str, modes: str, compiles: str) -> tuple[list[int], list[str], list[bool]]:
    """--sweep-micro, --sweep-ac and --sweep-compile as lists; one UserError, before any process
    group exists, names every flag with an entry that is not accepted and what is."""
    problems: list[str] = []

    def entries(flag: str, text: str, read, what: str, accepted: str) -> list:
        items = [x.strip() for x in text.split(",")]
        values = [read(x) for x in items]
        bad = [repr(x) for x, v in zip(items, values) if v is None]
        if bad:
            problems.append(
                f"{flag} {text!r}: {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not "
                f"{what}; use a comma list of {accepted}"
            )
        return values

    size = lambda x: int(x) if x.isascii() and x.isdigit() and len(x) <= 6 and int(x) >= 1 else None
    mode = lambda x: x if x in CHECKPOINTING_MODES else None
    flag = lambda x: _BOOLS.get(x.lower())
    sizes = entries(
        "--sweep-micro", micro, size, "a micro-batch size", "integers >= 1, e.g. 1,2,4,8"
    )
    ac = entries("--sweep-ac", modes, mode, "a checkpointing mode", ", ".join(CHECKPOINTING_MODES))
    accepted = "true, false (or yes / no, 1 / 0), e.g. false,true"
    compiled = entries("--sweep-compile", compiles, flag, "true or false", accepted)
    if problems:
        raise UserError("; ".join(problems))
    return sizes, ac, compiled


def bench_sweep(
    cfg: Config,
    plan: RunPlan,
    micro_batches: list[int],
    modes: list[str],
    compiles: list[bool],
    steps: int = 5,
    warmup: int = 2,
    backends: list[str] | None = None,
) -> list[dict[str, Any]]:
    """`bench` over backend x micro-batch x checkpointing x compile (grad_accum 1), each row with
    the estimate beside the measured peak; out-of-memory is a row. `backends`: of BACKENDS."""
    from scale_llm.components.distributed import start  # (looked up here: tests replace it)

    rows = []
    sweep = itertools.product(backends or [None], compiles, modes, micro_batches)
    for backend, compile_, mode, mb in sweep:
        changes = {"train.compile": compile_, "activation_checkpointing.mode": mode}
        changes |= {"train.micro_batch_size": mb, "train.grad_accum": 1}
        changes["train.global_batch_size"] = None
        if backend is not None:
            changes.update(backend_changes(backend, plan.world_size))
        c = with_changes(cfg, changes)
        row: dict[str, Any] = {"backend": backend or plan.backend, "micro_batch": mb}
        row |= {"activation_checkpointing": mode, "compile": compile_}
        refused = validate(c) or launch_problems(c, plan.world_size, plan.device.type == "cuda")
        if refused:  # (a pipeline's pieces, a V schedule's checkpointing, fp8 under DDP)
            log.warning("bench: sweep row not run (%s, micro-batch %d): %s", mode, mb, refused[0])
            rows.append({**row, "refused": refused[0]})
            continue
        p = dataclasses.replace(plan, micro_batch_size=mb, grad_accum=1)
        if backend is not None:  # (else the plan's, `auto` resolved)
            tp = c.parallel.tensor_parallel
            p = dataclasses.replace(
                p, backend=c.parallel.backend, tp_degree=tp, dp_degree=plan.world_size // tp
            )
        if p.backend != "single":
            start(p)  # (a no-op once the process group exists)
        est = estimate(c, p)
        row["predicted_gib"] = est.total / GiB
        # max_memory_allocated sees no allocator slack: compare it with the peak itself
        row["predicted_peak_gib"] = est.gpu["peak"] / GiB
        # the estimate's one count read from torch's source, not measured: CUDA's fused RMSNorm
        # saves less than the composite (docs/memory.md); the composite's peak tells which holds
        row["predicted_peak_composite_norm_gib"] = composite_norm_peak(c, p, est) / GiB
        too_big = host_memory_problem(c, p)
        if too_big:  # a row, like a GPU's out-of-memory, not the end of the sweep
            log.warning("bench: sweep row not run (%s, micro-batch %d): %s", mode, mb, too_big)
            rows.append({**row, "oom": True, "host_memory": too_big})
            continue
        try:
            row.update(bench(c, p, steps, warmup))
        except torch.cuda.OutOfMemoryError:
            row["oom"] = True
        rows.append(row)
    return rows


def composite_norm_peak(cfg: Config, plan: RunPlan, est: Estimate) -> float:
    """`est`'s peak bytes with a composite RMSNorm in place of the fused one; under a pipeline
    the worst rank's, each rank's norms its stages' blocks' at its pieces' size."""
    composite = dataclasses.replace(est.layout, fused_norm=False)
    if plan.pp_degree > 1:
        return pipeline_estimate(cfg, plan, composite).gpu["peak"]
    return estimate_layout(cfg.model, cfg.activation_checkpointing, composite).gpu["peak"]


COLUMNS = [
    ("backend", "backend", "{}"),
    ("micro_batch", "micro-batch", "{}"),
    ("activation_checkpointing", "checkpointing", "{}"),
    ("compile", "compile", "{}"),
    ("tokens_per_s_per_rank", "tokens/s", "{:,.0f}"),
    ("ms_per_step", "ms/step", "{:.1f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("peak_alloc_gib", "peak alloc GiB", "{:.2f}"),
    ("predicted_peak_gib", "predicted peak GiB", "{:.2f}"),
    ("predicted_peak_composite_norm_gib", "the same, composite RMSNorm", "{:.2f}"),
    ("predicted_gib", "predicted GiB (+5% allowance)", "{:.2f}"),
]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The sweep as a markdown table (docs/benchmarks.md); OOM rows say so."""
    lines = ["| " + " | ".join(c[1] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]

    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        if row.get(key) is None:
            return "OOM" if row.get("oom") else "-"
        return fmt.format(row[key])

    for row in rows:
        lines.append("| " + " | ".join(cell(row, key, fmt) for key, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def bench_checkpoint(cfg: Config, plan: RunPlan, directory: Path, rounds: int = 2) -> list[dict]:
    """Checkpoint saves timed `rounds` times each in a new private folder in `directory`: "plain"
    (save + fsync), "with record" (as `Checkpointer.save`), "async" / "async_with_pinned_mem"
    (`blocking_s` holds the step, `save_s` until it is published)."""
    preflight(cfg, plan, staging=1)
    backend = build_backend(cfg, plan)
    model = backend.setup(build_model(cfg.model))
    # one real step on a 16-token row, so the optimizer state exists (on every backend)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 17), device=plan.device)
    optimizer_step(backend, model, [(tokens[:, :-1], tokens[:, 1:])])
    with shared_private_dir(directory, "scale-llm-checkpoint-io-", plan.is_main) as private:
        return _time_checkpoints(backend, plan, private, rounds)


FOREGROUND = ("plain", "with record")
BACKGROUND = ("async", "async_with_pinned_mem")  # checkpoint.async_mode's values


def _time_checkpoints(backend, plan: RunPlan, private: Path, rounds: int) -> list[dict]:
    rows, main = [], plan.is_main
    foreground_only = plan.backend == "deepspeed"  # its engine saves in the foreground only
    if foreground_only and main:
        log.info("bench: DeepSpeed saves in the foreground only; no async rows")
    kinds = FOREGROUND if foreground_only else FOREGROUND + BACKGROUND
    background = None if foreground_only else background_save("async", plan.device)
    said = logging.getLogger("scale_llm.components.checkpoint")  # (stdout holds the rows only)
    level = said.level
    said.setLevel(logging.WARNING)
    try:
        for n in range(rounds):
            for kind in kinds:
                directory = private / f"round{n}-{kind.replace(' ', '-')}"
                if main:
                    directory.mkdir()  # new, inside this call's own folder
                barrier()
                if kind in BACKGROUND:
                    row = _time_background_saves(backend, main, directory, background, kind)
                else:
                    row = _time_foreground_save(backend, main, directory, kind)
                if main and "gb" not in row:
                    row["gb"] = _gigabytes(directory)
                rows.append({"kind": kind, **row})
                barrier()
                if main:
                    shutil.rmtree(directory)  # made above, inside this call's own folder
    finally:
        said.setLevel(level)
    return rows


def _time_foreground_save(backend, main: bool, directory: Path, kind: str) -> dict[str, Any]:
    plain = kind == "plain"
    start = time.perf_counter()
    with contextlib.nullcontext() if plain else digests.recording() as hashed:
        backend.save(directory)
    barrier()
    written = time.perf_counter()
    if plain and main:
        ck.fsync_tree(directory)
    elif not plain:  # as Checkpointer.save
        record = ck.finish_record(directory, hashed, main)
        if main:
            ck.write_integrity(directory, record)
    barrier()
    done = time.perf_counter()
    row = {"blocking_s": done - start, "save_s": done - start, "write_s": written - start}
    if kind == "with record":  # (outside the timed save from here on)
        during = ck.gather_records(ck.written_entries(directory, hashed))
        row["hashed_while_writing_gb"] = sum(e["size"] for e in during.values()) / 1e9
        # the wall time the record added: writers stalled on hashing, and what follows
        # the write (the other files hashed, fsync, the record written)
        row["hash_stall_s"] = hashed.stalled_s
        row["after_write_s"] = done - written
        t0 = time.perf_counter()
        ck.gather_records(ck.integrity_record(directory, *rank_and_world()))  # hashing alone
        barrier()
        row["record_alone_s"] = time.perf_counter() - t0
        if main:
            t0 = time.perf_counter()
            assert ck.damage(directory) is None
            row["verify_s"] = time.perf_counter() - t0
    return row


def _time_background_saves(
    backend, main: bool, directory: Path, background, kind: str
) -> dict[str, Any]:
    """A save as the trainer makes it with checkpoint.async_mode=`kind`: until `save` returns
    (`blocking_s`), then until it is published. async_with_pinned_mem's kept copy lives for the
    round only; its first save, which allocates it, is `first_blocking_s`, the next is timed."""
    row: dict[str, Any] = {}
    if kind == "async_with_pinned_mem":
        background = dataclasses.replace(background, stager=kept_stager(backend.plan.device))
    checkpointer = ck.Checkpointer(directory, 1, main, background.group)
    try:
        for step in (1, 2) if background.stager else (1,):
            start = time.perf_counter()
            path = checkpointer.save(
                step, lambda _: None, partial(backend.save, background=background)
            )
            returned = time.perf_counter()
            checkpointer.wait()
            barrier()
            done = time.perf_counter()
            if "blocking_s" in row:
                row["first_blocking_s"] = row["blocking_s"]
            row.update(blocking_s=returned - start, save_s=done - start)
    finally:
        if background.stager is not None:
            background.stager.close()  # the kept copy freed
    if main:
        assert ck.damage(path) is None
        row["gb"] = _gigabytes(path)  # (the last checkpoint: the first one is still there)
    return row


def _gigabytes(directory: Path) -> float:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) / 1e9


@contextlib.contextmanager
def shared_private_dir(parent: Path, prefix: str, is_main: bool) -> Iterator[Path]:
    """`files.private_dir` made and removed by the main rank, its path given to every rank."""
    with contextlib.ExitStack() as stack:
        path = [stack.enter_context(private_dir(parent, prefix)) if is_main else None]
        if is_distributed():
            dist.broadcast_object_list(path, src=0)
        try:
            yield Path(path[0])
        finally:
            barrier()  # every rank is done with it before the main rank removes it
