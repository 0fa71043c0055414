"""A whole optimizer step measured on the CPU, by category, next to the estimate for that run.

`scale-llm estimate CONFIG --measure` runs one real step of the config's backend in this
process (on the CPU, synthetic tokens; one process, or each rank under torchrun) under
PyTorch's MemTracker (`torch.distributed._tools.mem_tracker`), which attributes every live
tensor storage to parameters, gradients, optimizer state, activations or temporaries, and
reports the bytes of each category at the step's peak, and each category's own maximum over
the step (from the snapshots MemTracker takes around every module's forward and backward).
The estimate it is compared with is the one for the same CPU run (`estimate(cfg, plan)`):
each part at its own largest, and the peak of the step's phases as the total.

The categories come from MemTracker, which sees the tensors that pass through its dispatch mode
or that it is told about. The peak (`allocated_peak`) is that of every tensor storage created
from before the backend builds the model (`_LiveStorages`), so it is what
`torch.cuda.max_memory_allocated` reports on a GPU, buffers MemTracker never sees included
(DeepSpeed's flat partitions, ZeRO-3's gradient buffer and reduce bucket, made at its engine's
construction). torch.profiler's allocation events were tried for this and dropped: a storage
freed on another thread (a gloo collective's) never reports its free there. The peak is taken
on one step and the categories on the next (the steps after the first are alike).

grad_accum > 1 is measured with 2 micro-steps (the later ones are alike: the gradients of the
earlier ones are kept); under torchrun each rank measures its own step of the config's backend.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
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
    m = here.model
    gen = torch.Generator().manual_seed(here.run.seed)

    def batches():
        out = []
        for _ in range(plan.grad_accum):
            tokens = torch.randint(
                0, m.vocab_size, (plan.micro_batch_size, m.seq_len + 1), generator=gen
            )
            out.append((tokens[:, :-1], tokens[:, 1:]))
        return out

    with _LiveStorages() as storages:  # from before the model's storage exists
        backend = build_backend(here, plan)
        model = backend.setup(build_model(here.model))
        optimizer_step(backend, model, batches())  # the optimizer state exists from here on
        with storages.window():
            optimizer_step(backend, model, batches())
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
    measured["allocated_peak"], measured["allocated_before"] = storages.peak, storages.before
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


class _LiveStorages:
    """Every tensor storage created while it is active, with its size at each moment: the live
    bytes after every op, and their peak within `window()`. A dispatch mode sees each op's
    outputs (subclasses such as DTensor flattened to the tensors they hold); a weak reference
    per storage subtracts it when it is freed, on whichever thread that happens; storage
    resizes (FSDP2 frees and refills its gathered parameters so) are followed by wrapping
    `UntypedStorage.resize_`, which no dispatch mode sees. Entered before the backend builds
    the model, it sees every buffer a backend allocates, as an allocator would."""

    def __init__(self) -> None:
        from torch.distributed._tools.common_utils import get_untyped_storages
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        from torch.utils.weak import WeakIdKeyDictionary

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._add(out)
                return out

        self._mode = Mode()
        self._leaves, self._storages = tree_leaves, get_untyped_storages  # (imported late)
        self._token: Any = WeakIdKeyDictionary()  # storage -> its key in _size
        self._size: dict[int, int] = {}
        self._tokens = itertools.count()
        self.live = self.peak = self.before = 0
        self._in_window = False

    def _add(self, out: Any) -> None:
        for t in self._leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            for st in self._storages(t):
                if st.device.type == "meta":  # a size without memory
                    continue
                if st not in self._token:
                    self._token[st] = token = next(self._tokens)
                    self._size[token] = 0
                    weakref.finalize(st, self._freed, token)
                self._resized(st)

    def _resized(self, st: Any) -> None:
        token = self._token[st]
        self.live += st.nbytes() - self._size[token]
        self._size[token] = st.nbytes()
        if self._in_window:
            self.peak = max(self.peak, self.live)

    def _freed(self, token: int) -> None:  # the storage itself is gone
        self.live -= self._size.pop(token)

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        self.before = self.peak = self.live
        self._in_window = True
        try:
            yield
        finally:
            self._in_window = False

    def __enter__(self) -> _LiveStorages:
        tracker, original = self, torch.UntypedStorage.resize_
        self._original_resize = original

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            result = original(st, size)
            if st in tracker._token:
                tracker._resized(st)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]


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
        if part == "total":  # every storage's peak: what max_memory_allocated would say
            got = r["measured"]["allocated_peak"] / gib
        own = r["category_maxima"].get(part)
        own_text = "-" if own is None else f"{own / gib:9.3f} GiB"
        est = r["estimated"].get("peak" if part == "total" else part)
        shown = "-" if est is None else f"{est / gib:8.3f} GiB"
        lines.append(f"  {part:<12} {got:8.3f} GiB {own_text:>13}   {shown}")
    tracked = r["measured"]["total"] / gib
    lines.append(
        f"  (total: the peak of every tensor storage, counted from before the model was built, "
        f"as max_memory_allocated counts on a GPU; the parts, as MemTracker attributes what it "
        f"sees, sum to {tracked:.3f} GiB at its own peak)"
    )
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
