"""A whole optimizer step measured on the CPU, by category, next to the estimate for that run.

`scale-llm estimate CONFIG --measure` runs one real step of the config's backend in this
process (world size 1, on the CPU, synthetic tokens) under PyTorch's MemTracker
(`torch.distributed._tools.mem_tracker`), which attributes every live tensor storage to
parameters, gradients, optimizer state, activations or temporaries, and reports the bytes of
each category at the step's peak, and each category's own maximum over the step (from the
snapshots MemTracker takes around every module's forward and backward). The estimate it is
compared with is the one for the same
one-process CPU run (`estimate(cfg, plan)`), whose parts are per-category maxima and so add up
to an upper bound of the measured peak.

MemTracker cannot follow a module called twice in one tracked region, so grad_accum > 1 is
measured with grad_accum 1 (the same peak: the micro-steps are alike and gradients are kept).
"""

from __future__ import annotations

from typing import Any

import torch

from scale_llm.config import Config, with_changes
from scale_llm.memory.estimate import estimate
from scale_llm.model import build_model
from scale_llm.parallel.backend import build_backend
from scale_llm.parallel.step import optimizer_step
from scale_llm.plan import Launch, resolve_plan

CATEGORIES = {  # MemTracker's reference types -> the estimate's parts
    "Parameter": "params",
    "Gradient": "grads",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
}


def measure_step(cfg: Config) -> dict[str, Any]:
    """{"measured": {category: bytes at the peak, "total": peak}, "estimated": {...}} of one
    optimizer step of `cfg` in this process on the CPU."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from scale_llm.components.distributed import start

    here = with_changes(cfg, {"train.device": "cpu", "train.grad_accum": 1})
    if here.train.global_batch_size is not None:
        here = with_changes(here, {"train.global_batch_size": None})
    plan = resolve_plan(here, Launch())
    start(plan)
    backend = build_backend(here, plan)
    model = backend.setup(build_model(here.model))
    m = here.model
    gen = torch.Generator().manual_seed(here.run.seed)

    def batches():
        tokens = torch.randint(
            0, m.vocab_size, (plan.micro_batch_size, m.seq_len + 1), generator=gen
        )
        return [(tokens[:, :-1], tokens[:, 1:])]

    optimizer_step(backend, model, batches())  # the optimizer state exists from here on
    tracker = MemTracker()
    tracker.track_external(model, backend.optimizer)
    with tracker:
        optimizer_step(backend, model, batches())
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    measured = _by_category(snapshot)
    measured["total"] = sum(measured.values())
    # each category's own maximum over the step: the snapshots MemTracker takes around every
    # module's forward and backward, and the peak (gradients, say, peak after the backward)
    maxima = dict(measured)
    for stats in tracker.memory_tracking.values():
        for states in getattr(stats, "snapshots", {}).values():
            for per_device in states:
                for device_snapshot in per_device.values():
                    for name, nbytes in _by_category(device_snapshot).items():
                        maxima[name] = max(maxima[name], nbytes)
    maxima.pop("total")
    est = estimate(here, plan)
    estimated = {k: int(v) for k, v in est.gpu.items()}
    return {
        "backend": plan.backend,
        "precision": plan.precision,
        "activation_checkpointing": here.activation_checkpointing.mode,
        "micro_batch_size": plan.micro_batch_size,
        "measured": measured,
        "category_maxima": maxima,
        "estimated": estimated,
    }


def _by_category(snapshot: dict) -> dict[str, int]:
    out = {name: 0 for name in CATEGORIES.values()}
    for kind, nbytes in snapshot.items():
        name = CATEGORIES.get(getattr(kind, "value", str(kind)))
        if name is not None:
            out[name] += int(nbytes)
    return out


def format_measurement(r: dict[str, Any]) -> str:
    gib = 2**30
    lines = [
        f"measured on CPU: one optimizer step, {r['backend']}, {r['precision']}, checkpointing "
        f"{r['activation_checkpointing']}, micro-batch {r['micro_batch_size']}, 1 process "
        f"(bytes at the step's peak, next to the estimate for this run)"
    ]
    lines.append(f"  {'':<12} {'at the peak':>12} {'own maximum':>13}   estimate")
    for part in ("params", "grads", "optimizer", "activations", "temporaries", "total"):
        got = r["measured"].get(part, 0) / gib
        own = r["category_maxima"].get(part)
        own_text = "-" if own is None else f"{own / gib:9.3f} GiB"
        est = r["estimated"].get(part)
        if part == "activations":
            est = r["estimated"].get("activations", 0) + r["estimated"].get("logits", 0)
        if part == "temporaries":
            est = r["estimated"].get("overhead")
        shown = "-" if est is None else f"{est / gib:8.3f} GiB"
        lines.append(f"  {part:<12} {got:8.3f} GiB {own_text:>13}   {shown}")
    return "\n".join(lines)
