"""A whole optimizer step measured on the CPU, by category, next to the estimate for that run.

`scale-llm estimate CONFIG --measure` runs one real step of the config's backend in this
process (on the CPU, synthetic tokens; one process, or each rank under torchrun) under
PyTorch's MemTracker (`torch.distributed._tools.mem_tracker`), which attributes every live
tensor storage to parameters, gradients, optimizer state, activations or temporaries, and
reports the bytes of each category at the step's peak, and each category's own maximum over
the step (from the snapshots MemTracker takes around every module's forward and backward).
The estimate it is compared with is the one for the same CPU run (`estimate(cfg, plan)`):
each part at its own largest, and the peak of the step's phases as the total.

grad_accum > 1 is measured with 2 micro-steps (the later ones are alike: the gradients of the
earlier ones are kept); under torchrun each rank measures its own step of the config's backend.
"""

from __future__ import annotations

from typing import Any

import torch

from scale_llm.config import Config, with_changes
from scale_llm.memory.estimate import estimate
from scale_llm.model import build_model
from scale_llm.parallel.backend import build_backend
from scale_llm.parallel.step import optimizer_step
from scale_llm.plan import launch_env, resolve_plan

CATEGORIES = {  # MemTracker's reference types -> the estimate's parts
    "Parameter": "params",
    "Gradient": "grads",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "optimizer",  # only what measure_step registers: DeepSpeed's fp32 master partitions
}


def measure_step(cfg: Config) -> dict[str, Any]:
    """{"measured": {category: bytes at the peak, "total": peak}, "estimated": {...}} of one
    optimizer step of `cfg` in this process on the CPU."""
    from scale_llm.components.distributed import start

    # MemTracker is a dispatch mode, which torch.compile refuses to trace under: the whole step
    # is measured eager (compiled blocks save less: `measure_activations` counts that)
    here = with_changes(cfg, {"train.device": "cpu", "train.compile": False})
    if here.train.global_batch_size is not None:
        here = with_changes(here, {"train.global_batch_size": None})
    plan = resolve_plan(here, launch_env())
    # micro-steps after the second are alike (the gradients of the earlier ones are kept)
    here = with_changes(here, {"train.grad_accum": min(plan.grad_accum, 2)})
    plan = resolve_plan(here, launch_env())
    start(plan)
    backend = build_backend(here, plan)
    model = backend.setup(build_model(here.model))
    m = here.model
    gen = torch.Generator().manual_seed(here.run.seed)

    def batches():
        tokens = torch.randint(
            0, m.vocab_size, (plan.micro_batch_size, m.seq_len + 1), generator=gen
        )
        out = []
        for _ in range(plan.grad_accum):
            tokens = torch.randint(
                0, m.vocab_size, (plan.micro_batch_size, m.seq_len + 1), generator=gen
            )
            out.append((tokens[:, :-1], tokens[:, 1:]))
        return out

    optimizer_step(backend, model, batches())  # the optimizer state exists from here on
    tracker = _step_tracker()
    optimizer = backend.optimizer
    # DeepSpeed's ZeRO optimizer wraps the torch optimizer that holds its fp32 partitions
    inner = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
    tracker.track_external(model, inner)
    if inner is not optimizer:  # its fp32 master partitions: optimizer-held, not module params
        tracker.track_external(*(p for g in inner.param_groups for p in g["params"]))
    with tracker:
        optimizer_step(backend, model, batches())
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    measured = _by_category(snapshot)
    measured["total"] = sum(measured.values())
    # each category's own maximum over the step: the snapshots MemTracker takes around every
    # module's forward and backward, and the peak (gradients, say, peak after the backward)
    maxima = dict(measured)
    for stats in [*tracker.memory_tracking.values(), *tracker.earlier]:
        for states in getattr(stats, "snapshots", {}).values():
            for per_device in states:
                for device_snapshot in per_device.values():
                    for name, nbytes in _by_category(device_snapshot).items():
                        maxima[name] = max(maxima[name], nbytes)
    maxima.pop("total")
    est = estimate(here, plan)
    estimated = {k: int(v) for k, v in est.gpu.items()}
    return {
        "measured_eager": bool(cfg.train.compile),
        "peak_phase": est.peak_phase,
        "backend": plan.backend,
        "precision": plan.precision,
        "activation_checkpointing": here.activation_checkpointing.mode,
        "micro_batch_size": plan.micro_batch_size,
        "measured": measured,
        "category_maxima": maxima,
        "estimated": estimated,
        "estimated_cpu": {k: int(v) for k, v in est.cpu.items() if v},
    }


def _step_tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        """MemTracker over a whole optimizer step of several micro-steps: MemTracker refuses a
        second forward of the root module in one region, so each new one starts fresh module
        stats, and the earlier ones are kept (`earlier`) for the per-category maxima."""

        def __init__(self) -> None:
            super().__init__()
            self.earlier: list[Any] = []

        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            t = self._mod_tracker
            again = module in self.memory_tracking and not t.is_bw
            if again and set(t.parents) - {t.get_known_fqn(module)} == {"Global"}:
                self.earlier.extend(self.memory_tracking.values())
                self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

    return StepTracker


def _step_tracker() -> Any:
    """A StepTracker (the class is built on first use: MemTracker is imported late)."""
    return _step_tracker_class()()


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
        est = r["estimated"].get("peak" if part == "total" else part)
        shown = "-" if est is None else f"{est / gib:8.3f} GiB"
        lines.append(f"  {part:<12} {got:8.3f} GiB {own_text:>13}   {shown}")
    if r.get("measured_eager"):
        lines.append(
            "  (train.compile is on: the step is measured eager, since MemTracker cannot run "
            "around compiled code; the activation count above is of the compiled blocks)"
        )
    lines.append(
        f"  (estimate: each part at its own largest; total: the peak, at {r['peak_phase']}; "
        f"a GPU adds the {r['estimated']['overhead'] / gib:.3f} GiB allocator allowance)"
    )
    return "\n".join(lines)
