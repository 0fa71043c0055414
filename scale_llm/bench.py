"""`scale-llm bench`: training throughput of a config on synthetic tokens (no data needed).

Runs the same optimizer step as the trainer (same backend, precision, accumulation and
checkpointing) on random tokens, and reports tokens/s, ms per step, MFU and peak memory.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from scale_llm.components.hardware import cuda_memory_gib, peak_flops
from scale_llm.config import Config
from scale_llm.model import build_model
from scale_llm.parallel.backend import build_backend
from scale_llm.parallel.step import optimizer_step
from scale_llm.plan import RunPlan

log = logging.getLogger(__name__)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(cfg: Config, plan: RunPlan, steps: int = 10, warmup: int = 3) -> dict[str, Any]:
    device = plan.device
    backend = build_backend(cfg, plan)
    model = build_model(cfg.model)
    flops_per_token = model.flops_per_token()
    n_params = model.num_params()
    wrapped = backend.setup(model)
    m = cfg.model
    gen = torch.Generator(device="cpu").manual_seed(cfg.run.seed + plan.rank)

    def batches():
        out = []
        for _ in range(plan.grad_accum):
            tokens = torch.randint(
                0, m.vocab_size, (plan.micro_batch_size, m.seq_len + 1), generator=gen
            )
            tokens = tokens.to(device)
            out.append((tokens[:, :-1], tokens[:, 1:]))
        return out

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        optimizer_step(backend, wrapped, batches())
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        loss, _ = optimizer_step(backend, wrapped, batches())
    loss.item()
    synchronize(device)
    seconds = (time.perf_counter() - start) / steps
    tokens = plan.tokens_per_step_per_rank
    result: dict[str, Any] = {
        "params": n_params,
        "precision": plan.precision,
        "device": str(device),
        "tokens_per_step_per_rank": tokens,
        "ms_per_step": seconds * 1e3,
        "tokens_per_s_per_rank": tokens / seconds,
    }
    peak = peak_flops(device)
    if peak:
        result["mfu"] = flops_per_token * tokens / seconds / peak
    result.update(cuda_memory_gib(device))
    return result
