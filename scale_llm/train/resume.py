"""What a resume checks in a checkpoint's trainer state before the trainer uses any of it: what
only a resume reads (`read_trainer_state` checks what every reader uses), and whether the
checkpoint belongs to the run that resumes it. Pure checks: nothing is restored here."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scale_llm.components.checkpoint import (
    DEEPSPEED_DIR,
    TRAINER_STATE,
    Checkpointer,
    CheckpointWeights,
    is_count,
    read_trainer_state,
    resolve_resume,
    saved_model_config,
    saved_section,
)
from scale_llm.components.optim import SCHEDULE_KEYS, lr_at
from scale_llm.components.zero_weights import ZeroWeights
from scale_llm.config import (
    Config,
    DataConfig,
    RunConfig,
    TrainConfig,
    get_key,
    run_defining_keys,
    short,
    to_dict,
)
from scale_llm.config.plan import RunPlan
from scale_llm.config.sections import same_resolved
from scale_llm.data.mixture import tokenizer_sha256
from scale_llm.data.prepare_source import Kept
from scale_llm.errors import UserError
from scale_llm.model import build_model
from scale_llm.parallel.backend import checkpoint_layout

MT_KEYS = 624  # numpy's MT19937 state: 624 words and a position in [0, 624]


def check_resume_state(
    state: dict[str, Any], ckpt: Path, cfg: Config, tokenizer_sha256: str, checkpoints: Path
) -> None:
    """Refuse a trainer state no run could have saved, or another run's (config, tokenizer)."""
    if problems := resume_state_problems(state):
        raise UserError(
            f"{ckpt / TRAINER_STATE} holds values no run could have saved (damaged, or not "
            f"scale_llm's):\n  - " + "\n  - ".join(problems) + "\nResume from another "
            "checkpoint (checkpoint.resume=auto picks the newest good one)."
        )
    if problems := run_mismatches(state, cfg, tokenizer_sha256):
        raise UserError(
            f"cannot resume {ckpt}: it belongs to a different run.\n  - "
            + "\n  - ".join(problems)
            + f"\nUse the original settings to continue it, or start a new run: --run-name NAME "
            f"(the run.name key; or checkpoint.resume=never after deleting {checkpoints})."
        )


# Keys that say how a run is carried out, not what it trains (so are train.profile.*): the rest
# of WHAT describes the experiment. A resume reads the checkpoint's weights, not init_from's.
HOW_NOT_WHAT = (
    "train.device",
    "train.compile",
    "train.gc_every",
    "train.exit_at_step",
    "train.max_bad_steps",
    "model.init_from",
    "model.attention",  # (sdpa or eager: the same attention, another kernel)
    "train.micro_batch_size",  # (the batch is compared: the same batch split otherwise)
    "train.grad_accum",
    "train.global_batch_size",
)
WHAT = ("model.", "train.", "data.dir", "run.seed")


def changed_settings(state: dict[str, Any], cfg: Config, plan: RunPlan | None = None) -> list[str]:
    """`key: old -> new` for each experiment key the checkpoint records and `cfg` changes; the
    batch as sequences a step where the checkpoint's plan and `plan` say (over every rank)."""
    saved, now = flat(state["config"]), flat(to_dict(cfg))
    changed = [
        f"{key}: {short(saved[key], 40)} -> {short(value, 40)}"
        for key, value in now.items()
        if key.startswith(WHAT) and key not in HOW_NOT_WHAT and key in saved
        if not key.startswith("train.profile.") and saved[key] != value
        if not same_resolved(key, saved_model_config(state), cfg.model)
    ]
    split = ("train.micro_batch_size", "train.grad_accum")
    sequences = state.get("plan", {}).get("sequences_per_step")
    if plan is not None and is_count(sequences):  # the batch, however it is split
        if sequences != plan.sequences_per_step:
            changed.append(f"sequences a step: {sequences} -> {plan.sequences_per_step}")
    elif all(isinstance(saved.get(k), int) for k in split):
        before, after = saved[split[0]] * saved[split[1]], now[split[0]] * now[split[1]]
        if before != after:
            changed.append(f"train.micro_batch_size x train.grad_accum: {before} -> {after}")
    return changed


def check_finished_run(state: dict[str, Any], ckpt: Path, cfg: Config, plan: RunPlan) -> None:
    """A finished run relaunched with other settings (it would train nothing) is refused."""
    if state["step"] < cfg.train.max_steps or not (changed := changed_settings(state, cfg, plan)):
        return  # unfinished; or the same run relaunched, which the trainer says is complete
    run_dir = ckpt.parent.parent
    raise UserError(
        f"{run_dir} holds a finished run (step {state['step']} of its "
        f"train.max_steps={lookup(state['config'], 'train.max_steps')}, checkpoint {ckpt.name}), "
        f"and this command's settings differ from it ({'; '.join(changed[:6])}"
        f"{f'; and {len(changed) - 6} more' if len(changed) > 6 else ''}), so it would train "
        f"nothing. To run these settings, start a new run: --run-name NAME (the run.name key; "
        f"its directory is {Path(cfg.run.dir) / 'NAME'}); to train {run_dir} further, raise "
        f"train.max_steps above {state['step']}"
    )


def flat(tree: dict[str, Any], prefix: str = "", tracker: bool = False) -> dict[str, Any]:
    """A config as {dotted key: value}, a raw `*config` dict (ds_config) kept whole. For a
    `tracker` (TensorBoard's hparams, W&B): every dict of str keys is opened, and None and
    containers become JSON strings."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        opens = isinstance(value, dict) and (
            bool(value) and all(isinstance(k, str) for k in value)
            if tracker
            else not key.endswith("config")
        )
        if opens:
            out.update(flat(value, f"{name}.", tracker))
        elif tracker and not isinstance(value, bool | int | float | str):
            out[name] = json.dumps(value)
        else:
            out[name] = value
    return out


def resume_state_problems(state: dict[str, Any]) -> list[str]:
    """One line per field only a resume reads that holds an impossible value."""
    step = state["step"]
    out = _data_problems(state["data"])
    for key in ("skipped_steps", "bad_streak"):
        value = state[key]
        if not is_count(value) or value > step:
            out.append(f"{key}: {short(value, 40)} is not a count of steps within 0..{step}")
    if not is_count(state.get("tokens", 0)):
        out.append(f"tokens: {short(state['tokens'], 40)} is not a count of tokens")
    for key in ("data_fingerprint", "data_shards"):
        if not isinstance(state.get(key, ""), str):
            out.append(f"{key}: {short(state[key], 40)} is not a digest")
    out += _rng_problems(state["rng"])
    backend = state["backend"]
    parts = [backend.get(k) for k in ("layout", "scaler")] if isinstance(backend, dict) else [0]
    if not all(isinstance(part, dict) for part in parts):
        out.append(f"backend: {short(backend, 40)} is not a backend state with a layout")
    elif not _layout_ok(layout := parts[0]):
        out.append(
            f"backend.layout: {short(layout, 60)} is not a checkpoint layout ({{format: dcp}}, "
            f"or {{format: deepspeed, zero_stage: 0..3, world_size: N}})"
        )
    elif parts[1] and not _scaler_ok(parts[1]):
        out.append(
            f"backend.scaler: {short(parts[1], 60)} is not fp16's GradScaler state (a finite "
            f"scale and factors above 0, a growth interval and tracker counting steps)"
        )
    for cls, name in ((TrainConfig, "train"), (RunConfig, "run"), (DataConfig, "data")):
        saved = state["config"].get(name)  # read by the rules of a user config
        if not isinstance(saved, dict):
            out.append(f"config.{name}: {short(saved, 40)} is not the saved {name} section")
        else:
            out += [f"config.{msg}" for msg in saved_section(cls, name, saved)[1]]
    return out


def _layout_ok(layout: dict) -> bool:
    """What `parallel.backend.checkpoint_layout` writes."""
    if layout == {"format": "dcp"}:
        return True
    stage, world = layout.get("zero_stage"), layout.get("world_size")
    return (  # (one saved without its precision or offload: saved_layout fills them)
        layout.keys() - {"precision", "offload_optimizer"} == {"format", "zero_stage", "world_size"}
        and layout.get("precision", "fp32") in ("bf16", "fp16", "fp32")
        and layout.get("offload_optimizer", "none") in ("none", "cpu")
        and layout["format"] == "deepspeed"
        and stage in (0, 1, 2, 3)
        and not isinstance(stage, bool)
        and is_count(world)
        and world >= 1
    )


def _scaler_ok(scaler: dict) -> bool:
    """What torch.amp.GradScaler.state_dict writes (an fp16 run's; {} otherwise)."""
    factors = [scaler.get(k) for k in ("scale", "growth_factor", "backoff_factor")]
    counts = [scaler.get(k) for k in ("growth_interval", "_growth_tracker")]
    return (
        scaler.keys()
        == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
        and all(isinstance(f, float) and math.isfinite(f) and f > 0 for f in factors)
        and all(is_count(c) for c in counts)
        and counts[0] > 0
    )


def _data_problems(data: Any) -> list[str]:
    if not isinstance(data, dict):
        return [f"data: {short(data, 40)} is not the data loader's position"]
    out = [
        f"data.{key}: {short(data.get(key), 40)} is not an integer in 0..2^62"
        for key in ("position", "seed", "num_windows")
        if not is_count(value := data.get(key)) or value > 1 << 62  # (numpy's int64 takes it)
    ]
    sources = data.get("sources")  # a mixture's: {name: [weight, sequences drawn]}
    pairs = sources.items() if isinstance(sources, dict) else [(None, None)]
    if sources is not None and not all(
        isinstance(name, str) and isinstance(v, list | tuple) and len(v) == 2 for name, v in pairs
    ):
        out.append(f"data.sources: {short(sources, 40)} is not {{source: [weight, drawn]}}")
    counts = data.get("period_counts")  # a mixture's: each source's sequences in a period
    if counts is not None and not (isinstance(counts, list) and all(map(is_count, counts))):
        out.append(f"data.period_counts: {short(counts, 40)} is not a list of counts")
    return out


def _rng_problems(states: Any) -> list[str]:
    """Each rank's generator states must have the shapes `train.rng.restore_for_rank` sets."""
    if not isinstance(states, list):
        return [f"rng: {short(states, 40)} is not a list of every rank's generator states"]
    if not states:
        return ["rng: an empty list (one entry per rank was saved)"]
    for rank, s in enumerate(states):
        where = f"rng[{rank}]"
        if not isinstance(s, dict):
            return [f"{where}: {short(s, 40)} is not a generator state"]
        numpy, python = s.get("numpy"), s.get("python")
        cpu = s.get("torch")
        for key in ("torch", "cuda"):
            if (key == "torch" or key in s) and not _cpu_tensor(s[key], torch.uint8, 1):
                return [
                    f"{where}.{key}: not a torch generator state (a contiguous 1-D uint8 tensor "
                    f"on the CPU)"
                ]
        if cpu.numel() != (size := torch.get_rng_state().numel()):
            return [f"{where}.torch: {cpu.numel()} bytes, not the {size} of a CPU generator's"]
        keys = numpy.get("keys") if isinstance(numpy, dict) else None
        if not (
            _cpu_tensor(keys, torch.int64, 1)
            and tuple(keys.shape) == (MT_KEYS,)
            and 0 <= keys.min().item() <= keys.max().item() < 1 << 32  # (uint32 words)
            and is_count(numpy.get("pos"))
            and numpy["pos"] <= MT_KEYS
            and type(numpy.get("has_gauss")) is int
            and numpy["has_gauss"] in (0, 1)
            and isinstance(numpy.get("gauss"), float)
        ):
            return [
                f"{where}.numpy: not a numpy MT19937 state ({MT_KEYS} int64 keys in 0..2^32-1 "
                f"and a position)"
            ]
        if not (
            isinstance(python, dict)
            and type(python.get("version")) is int
            and python["version"] == random.Random.VERSION
            and isinstance(python.get("state"), list | tuple)
            and len(python["state"]) == MT_KEYS + 1
            and all(is_count(x) and x < 1 << 32 for x in python["state"])
            and python["state"][-1] <= MT_KEYS  # (the position in the keys)
            and isinstance(python.get("gauss"), float | None)
        ):
            return [f"{where}.python: not a Python random state ({MT_KEYS + 1} integers)"]
    return []


def _cpu_tensor(value: Any, dtype: torch.dtype, dim: int) -> bool:
    """A plain tensor of `dtype` and `dim` dimensions, as a generator state is set from: dense,
    contiguous, on the CPU, needing no grad."""
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == dtype
        and value.dim() == dim
        and value.layout == torch.strided
        and value.device.type == "cpu"
        and value.is_contiguous()
        and not value.requires_grad
    )


def kept_data(cfg: Config) -> Kept | None:
    """data.dir's tokenizer when the checkpoint this run would resume from (the newest under
    checkpoint.resume=auto, or the one it names) was trained with it: what the launchers'
    prepare keeps. Read-only; none readable keeps nothing (train then says why)."""
    if cfg.checkpoint.resume == "never" or (sha := tokenizer_sha256(cfg.data.dir)) is None:
        return None
    if cfg.checkpoint.resume == "auto":  # (the newest readable: auto falls back past damage)
        found = Checkpointer(cfg.run_dir, cfg.checkpoint.keep_last, is_main=False).complete()
        candidates = [path for _, path in reversed(found)]
    else:
        candidates = [Path(cfg.checkpoint.resume)]
    for ckpt in candidates:
        with contextlib.suppress(UserError, OSError):
            trained = read_trainer_state(ckpt)["tokenizer_sha256"]
            return Kept(sha, ckpt) if trained == sha else None
    return None


def run_mismatches(state: dict[str, Any], cfg: Config, tokenizer_sha256: str) -> list[str]:
    """Each run-defining key (and the tokenizer) that differs between the checkpoint and now."""
    problems = []
    for key in run_defining_keys():
        old, new = lookup(state["config"], key), get_key(cfg, key)
        if isinstance(new, list):  # data.sources: entries as the checkpoint saved them
            new = [dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x for x in new]
        if old != new and not same_resolved(key, saved_model_config(state), cfg.model):
            problems.append(f"{key}: the checkpoint has {old!r}, the config says {new!r}")
    if state["tokenizer_sha256"] != tokenizer_sha256:
        problems.append(
            f"data.dir={cfg.data.dir}: its tokenizer differs from the one "
            f"the checkpoint was trained with"
        )
    return problems


def lookup(tree: dict[str, Any], dotted: str) -> Any:
    """A dotted key of a saved config dict (None where that checkpoint has no such key)."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def schedule_change(state: dict[str, Any], now: TrainConfig, step: int) -> str | None:
    """A resume with another schedule (a raised train.max_steps) goes on from the new LR: what
    to say when it is not the one the checkpoint's run would have used, else None."""
    before = saved_section(TrainConfig, "train", state["config"]["train"])[0]
    old, new = lr_at(step, before), lr_at(step, now)
    if math.isclose(old, new, rel_tol=1e-9, abs_tol=0.0):
        return None
    changed = [
        f"train.{k}: {getattr(before, k)} -> {getattr(now, k)}"
        for k in SCHEDULE_KEYS
        if getattr(before, k) != getattr(now, k)
    ]
    wsd = "; train.lr_schedule=wsd extends a run without a jump while it has not begun its decay"
    wsd = "" if now.lr_schedule == "wsd" else wsd
    return (
        f"the LR schedule changed ({', '.join(changed) or 'settings'}): the LR at step {step} "
        f"is {new:.3g}, not the {old:.3g} the checkpoint's settings give{wsd}"
    )


def optimizer_change(
    state: dict[str, Any], optimizer: torch.optim.Optimizer, cfg: TrainConfig
) -> str | None:
    """The config's betas, eps and weight decay into an optimizer a checkpoint was loaded into
    (its groups bring the saved ones, which a resume that changed them kept silently); what
    changed since the checkpoint's run, or None. The decay group is the first (`param_groups`)."""
    for i, group in enumerate(optimizer.param_groups):
        group.update(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        group["weight_decay"] = cfg.weight_decay if i == 0 else group["weight_decay"]
    before = saved_section(TrainConfig, "train", state["config"]["train"])[0]
    said = ", ".join(
        f"train.{k}: {getattr(before, k)} -> {getattr(cfg, k)}"
        for k in ("beta1", "beta2", "eps", "weight_decay")
        if getattr(before, k) != getattr(cfg, k)
    )
    return f"the optimizer's settings changed ({said}): the new ones apply" if said else None


def data_change(state: dict[str, Any], prepared: str, shards: str) -> str | None:
    """data.dir's shards other than the checkpoint's (prepared again from changed files, the
    run's tokenizer kept): the same stream position reads other batches. What to say, or None.
    The shards' contents where both sides hashed every one; else prepare's fingerprints."""
    if state.get("data_shards") and shards:
        if state["data_shards"] == shards:
            return None
    elif state.get("data_fingerprint", prepared) == prepared:
        return None
    return (
        "data.dir's shards changed since the checkpoint (prepared again from changed files): "
        "the steps from here read other batches than the checkpoint's run would have, and its "
        "validation split may hold documents it trained on"
    )


def batch_change(state: dict[str, Any], plan: RunPlan) -> str | None:
    """A resume whose step takes another number of tokens than the checkpoint's run goes on, on
    another curve: what to say, else None."""
    tokens, now = state["plan"].get("tokens_per_step"), plan.tokens_per_step
    if not is_count(tokens) or tokens == now:
        return None
    return (
        f"a step now takes {now:,} tokens, not the {tokens:,} of the checkpoint's run (micro "
        f"{plan.micro_batch_size} x seq_len {plan.seq_len} x grad_accum {plan.grad_accum} x "
        f"data-parallel {plan.dp_degree}): from here on the curve is not the one its settings "
        f"give; keep micro_batch_size x grad_accum x data-parallel ranks "
        f"(train.global_batch_size) to continue it exactly"
    )


@dataclass(frozen=True)
class Resume:
    """The checkpoint a launch continues: its trainer state (every field checked) and whether
    this backend restores model and optimizer from its files exactly (else the weights only)."""

    checkpoint: Path
    state: dict[str, Any]
    exact: bool

    @property
    def step(self) -> int:
        return int(self.state["step"])


def choose_resume(cfg: Config, plan: RunPlan, manifest: dict[str, Any]) -> Resume | None:
    """checkpoint.resume's choice, its state read and checked; None for a fresh start."""
    checkpoints = Checkpointer(cfg.run_dir, cfg.checkpoint.keep_last, plan.is_main)
    ckpt = resolve_resume(cfg.checkpoint.resume, checkpoints)
    if ckpt is None:
        return None
    state = read_trainer_state(ckpt)
    check_resume_state(state, ckpt, cfg, manifest["tokenizer"]["sha256"], checkpoints.dir)
    check_finished_run(state, ckpt, cfg, plan)  # other settings: a new run
    layout = saved_layout(state)
    same = layout == checkpoint_layout(cfg, plan)
    if not same or layout["format"] == "dcp":
        # the weights' names and shapes against the model (a meta model: no memory): damage, or
        # a state naming another model than its files hold, stops it here. (DCP: its metadata;
        # DeepSpeed's files are read so only across formats: every rank's partitions)
        CheckpointWeights(ckpt, build_model(cfg.model).state_dict())
    if same:  # model and optimizer restored exactly
        return Resume(ckpt, state, True)
    # read across formats: model and optimizer move exactly between DCP and DeepSpeed ZeRO 1-3
    # (ZeRO-0 keeps no partitions: weights only)
    exact = _partitioned(layout) and _partitioned(checkpoint_layout(cfg, plan))
    if exact and layout["format"] == "deepspeed":
        ZeroWeights(ckpt / DEEPSPEED_DIR).check_optimizer_state()
    return Resume(ckpt, state, exact)


def saved_layout(state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's layout; a DeepSpeed one saved without its precision or its optimizer
    offload (the layout names them from 2026-12-07) takes its plan's and its config's, so the
    engine's own files are read as they were."""
    layout = state["backend"]["layout"]
    if layout["format"] != "deepspeed":
        return layout
    parallel = state["config"].get("parallel")
    ds = parallel.get("deepspeed") if isinstance(parallel, dict) else None
    offload = ds.get("offload_optimizer", "none") if isinstance(ds, dict) else "none"
    offload = offload if offload in ("none", "cpu") else "none"
    return {"precision": state["plan"].get("precision"), "offload_optimizer": offload, **layout}


def _partitioned(layout: dict[str, Any]) -> bool:
    return layout.get("format") == "dcp" or (
        layout.get("format") == "deepspeed" and layout.get("zero_stage") in (1, 2, 3)
    )
