"""A whole optimizer step measured on the CPU, by category, next to the estimate for that run:
real steps of the config's backend (each rank its own under torchrun), every tensor storage
counted from before the model is built (`LiveStorages`; PyTorch's MemTracker missed 14% of
ZeRO-3's bf16 step, torch.profiler misses frees on other threads): docs/memory.md."""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from scale_llm.analysis.memory.estimate import PARTS, GiB
from scale_llm.analysis.memory.gpu import estimate
from scale_llm.config import Config, with_changes
from scale_llm.config.plan import launch_env, resolve_plan
from scale_llm.model import build_model
from scale_llm.parallel.backend import build_backend
from scale_llm.parallel.step import optimizer_step


def measure_step(cfg: Config) -> dict[str, Any]:
    """{"measured": {category: bytes at the peak, "total": peak}, "estimated": {...}} of one
    optimizer step of `cfg` in this process on the CPU."""
    from scale_llm.components.distributed import start

    # the count is a dispatch mode, which torch.compile refuses to trace under: the whole step
    # is measured eager (compiled blocks save less: `measure_activations` counts that)
    eager_cpu = {"train.device": "cpu", "train.compile": False, "train.global_batch_size": None}
    here = with_changes(cfg, eager_cpu)
    plan = resolve_plan(here, launch_env())
    # micro-steps after the second are alike (the gradients of the earlier ones are kept)
    here = with_changes(here, {"train.grad_accum": min(plan.grad_accum, 2)})
    plan = resolve_plan(here, launch_env())
    start(plan)
    m = here.model
    gen = torch.Generator().manual_seed(here.run.seed)

    def batches():
        shape, n = (plan.micro_batch_size, m.seq_len + 1), plan.grad_accum
        rows = [torch.randint(0, m.vocab_size, shape, generator=gen) for _ in range(n)]
        return [(t[:, :-1], t[:, 1:]) for t in rows]

    with LiveStorages() as storages:  # from before the model's storage exists
        backend = build_backend(here, plan)
        model = backend.setup(build_model(here.model))
        measured = measured_steps(storages, backend, model, batches)
    est = estimate(here, plan)
    worst = est.pipeline_rank
    est = est.pipeline_ranks[plan.pp_rank] if est.pipeline_ranks else est  # (this rank's)
    return {
        "pipeline_rank": plan.pp_rank,
        "worst_pipeline_rank": worst,
        "measured_eager": cfg.train.compile is not False,  # (auto: compiled on the GPU target)
        "peak_phase": est.peak_phase,
        "backend": plan.backend,
        "precision": plan.precision,
        "activation_checkpointing": here.activation_checkpointing.mode,
        "micro_batch_size": plan.micro_batch_size,
        "measured": measured,
        "estimated": {k: int(v) for k, v in est.gpu.items()},
        "estimated_peak_parts": {k: int(v) for k, v in est.peak_parts.items()},
        "estimated_cpu": {k: int(v) for k, v in est.cpu.items() if v},
    }


# code of the backends (its frames name what they are doing: gathering parameters, reducing
# gradients), the optimizers, activation checkpointing's recomputation, autograd's engine
_BACKEND_CODE = ("/deepspeed/", "/torch/distributed/", "/torch/nn/parallel/")
# a backend's compute, not its bookkeeping: ZeRO-3's linear layer, DTensor's op dispatch and
# the collectives its redistributions run (tensor parallelism's activations and their gradients)
_TRANSPARENT = (
    "/deepspeed/runtime/zero/linear.py",
    "/torch/distributed/tensor/",
    "/torch/distributed/_functional_collectives.py",
)
_GATHERING = re.compile("gather|unshard|fetch")
_REDUCING = re.compile("reduce|grad|bucket|ipg")
_PIPELINE_CODE = "/torch/distributed/pipelining/"
_OPTIMIZER_CODE = "/torch/optim/"
_RECOMPUTE_CODE = "/torch/utils/checkpoint.py"
_ENGINE_CODE = "/torch/autograd/graph.py"
_OWN_CODE = "/scale_llm/"
_MADE_IN_PHASE = {"construction": "params", "forward": "activations"}  # else temporaries


def measured_steps(
    storages: LiveStorages, backend: Any, model: torch.nn.Module, batches: Any
) -> dict[str, int]:
    """Three optimizer steps under `storages`: the first makes the optimizer state, the second
    gives the peak, the third what is alive at it, by category ({part: bytes, "total",
    "allocated_peak", "allocated_before": the live bytes as the second step began})."""
    optimizer = backend.optimizer
    # DeepSpeed's ZeRO optimizer wraps the torch optimizer that holds its fp32 partitions
    inner = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
    _follow_phases(storages, backend, model)
    storages.owners = _owners(model, optimizer, inner)
    optimizer_step(backend, model, batches())  # the optimizer state exists from here on
    with storages.window():
        optimizer_step(backend, model, batches())
    with storages.classifying(0.98 * storages.peak):  # the largest moment from just below it
        optimizer_step(backend, model, batches())
    peaks = {"allocated_peak": storages.peak, "allocated_before": storages.before}
    return {**storages.parts, "total": storages.parts_live, **peaks}


def in_phase(storages: LiveStorages, phase: str, fn: Any) -> Any:
    """`fn`, with `storages.phase` set to `phase` while it runs."""

    def run(*args: Any, **kwargs: Any) -> Any:
        before, storages.phase = storages.phase, phase
        try:
            return fn(*args, **kwargs)
        finally:
            storages.phase = before

    return run


def _follow_phases(storages: LiveStorages, backend: Any, model: torch.nn.Module) -> None:
    """Set `storages.phase` around the model's forward, the loss, the backward and the step."""
    phased = functools.partial(in_phase, storages)
    backend.loss_fn = phased("loss", backend.loss_fn)
    backend.backward = phased("backward", backend.backward)
    backend.clip_and_step = phased("step", backend.clip_and_step)
    # before any hook of the backend's (FSDP2's root gathers its parameters in one)
    model.register_forward_pre_hook(lambda *_: setattr(storages, "phase", "forward"), prepend=True)
    model.register_forward_hook(lambda *_: setattr(storages, "phase", "other"), always_call=True)
    storages.phase = "other"


def _owners(model: torch.nn.Module, optimizer: Any, inner: torch.optim.Optimizer) -> Any:
    """() -> {category: tensors}: what the model, the optimizer and the backend hold now:
    parameters and gradients in every form (FSDP2's shards and gathered copies, ZeRO-3's
    partitions), the optimizer's state, and a ZeRO optimizer's tensors by their names."""
    held = lambda obj: ((name, t) for name, v in vars(obj).items() for t in _tensors_in(v))

    def owners() -> dict[str, list[torch.Tensor]]:
        params, grads, optim = [], [], []  # (tensors)
        for p in model.parameters():
            params.append(p)
            if isinstance(getattr(p, "ds_tensor", None), torch.Tensor):
                params.append(p.ds_tensor)
            if p.grad is not None:
                grads.append(p.grad)
        for module in model.modules():
            group = getattr(module, "_get_fsdp_state", None)
            group = group()._fsdp_param_group if group else None
            for fsdp_param in group.fsdp_params if group else ():
                for name, t in held(fsdp_param):
                    (grads if "grad" in name else params).append(t)
                    if t.grad is not None:
                        grads.append(t.grad)
        for state in inner.state.values():
            optim.extend(t for v in state.values() for t in _tensors_in(v))
        own = {id(p) for p in params}
        for group in inner.param_groups:
            for p in group["params"]:
                if id(p) not in own:  # a ZeRO optimizer's fp32 master partition
                    optim.append(p)
                if p.grad is not None:
                    grads.append(p.grad)
        if inner is not optimizer:  # DeepSpeed's ZeRO optimizer
            for name, t in held(optimizer):
                low = name.lower()
                if "grad" in low or "ipg" in low:
                    grads.append(t)
                elif "fp32" in low or "single_partition" in low:
                    optim.append(t)
                else:
                    params.append(t)
        return {"params": params, "optimizer": optim, "grads": grads}

    return owners


def _tensors_in(value: Any, depth: int = 3) -> Iterator[torch.Tensor]:
    """The tensors in `value`: in lists, tuples, dicts and DeepSpeed's own small objects (its
    ZeRO-3 reduce bucket is one), `depth` levels down."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth and isinstance(value, (list, tuple, dict)):
        for v in value.values() if isinstance(value, dict) else value:
            yield from _tensors_in(v, depth - 1)
    elif depth and _deepspeed_object(value):
        for v in vars(value).values():
            yield from _tensors_in(v, depth - 1)


def _deepspeed_object(value: Any) -> bool:
    ours = type(value).__module__.startswith("deepspeed.") and hasattr(value, "__dict__")
    return ours and not isinstance(value, torch.nn.Module)


class LiveStorages:
    """Every tensor storage made while active, with its size: the live bytes after every op and
    their peak within `window()`, seen by a dispatch mode (outputs), a weak reference (frees, on
    any thread) and a wrapped `UntypedStorage.resize_` (FSDP2's). Each storage gets a category
    where it is made (`_made_as`); `classify()` gives live bytes by it, `owners` first."""

    def __init__(self, fake: bool = False) -> None:
        """fake: the tensors are fake (FakeTensorMode, entered first): their storages are on
        the meta device and count; the nested fake modes DTensor propagates shapes in do not."""
        tracker = self
        wait = torch.ops._c10d_functional.wait_tensor.default

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if active_fake_mode() is not tracker._fake_mode:
                    return out
                if tracker._fake and func is wait:
                    # a collective's wait returns its input, the fake one a new tensor: count
                    # none, and keep the input's storage alive as long as its stand-in
                    out._waited_on = args[0]
                else:
                    tracker._add(out)
                return out

        self._mode = Mode()
        self._fake = fake
        self._fake_mode = active_fake_mode() if fake else None
        self._token: Any = WeakIdKeyDictionary()  # storage -> its key in _size
        self._size: dict[int, int] = {}
        self._tokens = itertools.count()
        self.live = self.peak = self.before = 0
        self._in_window = self._classifying = False
        self._made: dict[int, str] = {}  # token -> the category it was made as
        self.phase = "construction"
        self.owners: Any = None  # () -> {category: tensors held now}, set by measure_step
        self._classify_from: float | None = None  # live bytes from which to classify
        self.parts: dict[str, int] = {}  # by category, at the largest live from _classify_from
        self.parts_live = 0

    def _add(self, out: Any) -> None:
        for t in tree_leaves(out):
            # a fake tensor's device is the one it stands for: one on meta (a meta-device
            # model's tensor-parallel shards, made inside the fake mode) holds no memory
            if not isinstance(t, torch.Tensor) or (self._fake and t.device.type == "meta"):
                continue
            for st in get_untyped_storages(t):
                if st.device.type == "meta" and not self._fake:  # a size without memory
                    continue  # (DeepSpeed makes a meta copy of every parameter)
                if st not in self._token:
                    self._token[st] = token = next(self._tokens)
                    self._size[token] = 0
                    self._made[token] = self._made_as()
                    weakref.finalize(st, self._freed, token)
                self._resized(st)

    def _resized(self, st: Any) -> None:
        token = self._token[st]
        self.live += st.nbytes() - self._size[token]
        self._size[token] = st.nbytes()
        if self._in_window:
            self.peak = max(self.peak, self.live)
        start = self._classify_from
        if start is None or self._classifying or self.live < start or self.live <= self.parts_live:
            return
        self._classifying = True
        try:
            self.parts, self.parts_live = self.classify(), self.live
        finally:
            self._classifying = False

    def _freed(self, token: int) -> None:  # the storage itself is gone
        self.live -= self._size.pop(token)
        self._made.pop(token, None)

    def _made_as(self) -> str:
        """The category of a storage being made now, by the innermost frame of a backend's
        code (gathering: parameters, reducing: gradients, else by phase), an optimizer's
        (temporaries), a recomputation's (activations), or else by the phase alone."""
        phase = self.phase
        frame = sys._getframe(3)
        backend_default = None
        while frame is not None:
            code = frame.f_code
            name = code.co_filename.replace("\\", "/")
            if any(part in name for part in _TRANSPARENT):
                pass
            elif _PIPELINE_CODE in name and backend_default is None:
                return "activations"  # a stage's receive buffers: pieces' inputs, gradients
            elif any(part in name for part in _BACKEND_CODE):
                if _GATHERING.search(code.co_name):
                    return "params"
                if _REDUCING.search(code.co_name):
                    return "grads"
                backend_default = "grads" if phase in ("backward", "step") else "params"
            elif backend_default is not None:  # left the backend's code: nothing named it
                return backend_default
            elif _OPTIMIZER_CODE in name:
                return "temporaries"
            elif _RECOMPUTE_CODE in name and phase == "backward":
                return "activations"
            elif _ENGINE_CODE in name or (_OWN_CODE in name and phase != "backward"):
                break  # autograd's own work in the backward; this project's code otherwise
            frame = frame.f_back
        return backend_default or _MADE_IN_PHASE.get(phase, "temporaries")

    def classify(self) -> dict[str, int]:
        """Live bytes by category: what `owners()` names (parameters, gradients, optimizer
        state, in every form a backend holds them) by that, the rest as it was made."""
        claimed: dict[int, str] = {}
        for part, tensors in (self.owners() if self.owners else {}).items():
            for t in tensors:
                for st in get_untyped_storages(t):
                    token = self._token.get(st)
                    if token is not None:
                        claimed[token] = part
        out = dict.fromkeys(PARTS, 0)
        for token, nbytes in list(self._size.items()):
            out[claimed.get(token) or self._made.get(token, "temporaries")] += nbytes
        return out

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        self.before = self.peak = self.live
        self._in_window = True
        try:
            yield
        finally:
            self._in_window = False

    @contextlib.contextmanager
    def classifying(self, from_bytes: float) -> Iterator[None]:
        """Classify what is alive (`parts`) at each new high from `from_bytes` on, within."""
        self._classify_from = from_bytes
        try:
            yield
        finally:
            self._classify_from = None

    def __enter__(self) -> LiveStorages:
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


def parts_table(r: dict[str, Any], total_note: str = "") -> list[str]:
    """The lines of a measurement's (or trace's) table: each part at the peak, the estimate's
    peak phase and the estimate's own largest, then the peak measured and estimated."""
    got, est = r["measured"], r["estimated_peak_parts"]
    lines = [f"  {'':<12} {'at the peak':>12} {'estimated':>12} {'own largest (est.)':>19}"]
    for part in PARTS:
        at, at_est, own = got[part] / GiB, est[part] / GiB, r["estimated"][part] / GiB
        lines.append(f"  {part:<12} {at:8.3f} GiB {at_est:8.3f} GiB {own:15.3f} GiB")
    peak, predicted = got["allocated_peak"] / GiB, r["estimated"]["peak"] / GiB
    total = f"{peak:8.3f} GiB {predicted:8.3f} GiB ({predicted / peak - 1:+.1%}{total_note})"
    return [*lines, f"  {'total':<12} {total}"]


def format_measurement(r: dict[str, Any]) -> str:
    lines = [
        f"measured on CPU: one optimizer step, {r['backend']}, {r['precision']}, checkpointing "
        f"{r['activation_checkpointing']}, micro-batch {r['micro_batch_size']}, this process "
        f"(what is alive at the step's peak, next to the estimate of its peak, {r['peak_phase']})",
        *parts_table(r),
        "  (total: the peak of every tensor storage, counted from before the model was built, "
        "as max_memory_allocated counts on a GPU; the parts: each storage alive at that peak, "
        "by what holds it or, for the rest, what made it: docs/memory.md)",
    ]
    if r.get("measured_eager"):
        lines.append(
            "  (train.compile is on: the step is measured eager, since the dispatch mode that "
            "counts cannot run around compiled code; the activation count above is of the "
            "compiled blocks)"
        )
    lines.append(
        f"  (own largest: each part of the estimate at its largest over the step, as the "
        f"report lists them; a GPU adds the {r['estimated']['overhead'] / GiB:.3f} GiB allocator "
        f"allowance)"
    )
    return "\n".join(lines)
