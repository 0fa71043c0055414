"""The `parallel:` and `activation_checkpointing:` config sections, with their checks (only
`schema` imported, so `sections.py` can assemble the tree from it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from scale_llm.config.schema import bound_problems, config_key

if TYPE_CHECKING:
    from scale_llm.config import Config


@dataclass
class ActivationCheckpointingConfig:
    mode: Literal["none", "full", "every_k", "selective"] = config_key(
        "none",
        "`none`, `full` (every block recomputes its forward in backward), `every_k` (blocks 0, k, "
        "2k, ...), `selective` (keep matmul and attention outputs, recompute element-wise ops); "
        "numerics identical in all modes; see [memory.md](memory.md)",
    )
    k: int = config_key(2, "k for `every_k`")


@dataclass
class DDPConfig:
    bucket_cap_mb: int = config_key(25, "DDP gradient bucket size")
    gradient_as_bucket_view: bool = config_key(
        True, "gradients alias DDP's buckets (one copy less)"
    )
    # (static: the graph never changes, so DDP skips its per-step bookkeeping)
    static_graph: bool = config_key(False, "DDP static-graph optimizations")


@dataclass
class FSDPConfig:
    reshard_after_forward: bool = config_key(  # (false trades memory for less communication)
        True,
        "true: free gathered params after forward (ZeRO-3-like); false: keep them until "
        "backward (ZeRO-2-like)",
    )
    cpu_offload: bool = config_key(
        False, "params, grads and optimizer state in CPU memory (needs a GPU)"
    )
    replicate_degree: int = config_key(
        1,
        "HSDP: shard within groups, replicate across this many groups (usually the node "
        "count); must divide the world size",
    )
    reduce_every_micro_step: bool = config_key(  # (true is torchtitan's way)
        True,
        "with grad_accum > 1: true reduce-scatters every micro-step's gradients into the "
        "shards; false accumulates them unsharded in fp32 (4 B/param more per GPU) and "
        "reduces once per step (less traffic)",
    )


@dataclass
class DeepSpeedConfig:
    zero_stage: int = config_key(2, "ZeRO stage 0-3")
    offload_optimizer: Literal["none", "cpu"] = config_key(
        "none", "`cpu`: optimizer state and step on the CPU (ZeRO >= 1)"
    )
    offload_param: Literal["none", "cpu"] = config_key(
        "none", "`cpu`: parameters in CPU memory (ZeRO-3 only)"
    )
    config: dict | None = config_key(
        None,
        "raw ds_config entries merged over the generated ones: the engine's own settings "
        "(zero_optimization, data_types, ...); keys the framework owns and other sections are "
        "refused",
    )


V_SCHEDULES = ("zero_bubble", "dualpipev")  # two stages a rank, in a V (first and last)
LOOPED_SCHEDULES = ("interleaved_1f1b", "looped_bfs", *V_SCHEDULES)  # several stages a rank


@dataclass
class PipelineConfig:
    schedule: Literal[
        "1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "dualpipev", "looped_bfs"
    ] = config_key(
        "1f1b",
        "with pipeline_parallel > 1: torch.distributed.pipelining's schedule: `1f1b`, `gpipe`, "
        "`interleaved_1f1b` (several stages a rank: a smaller bubble), `zero_bubble` (ZBV), "
        "`dualpipev` or `looped_bfs`; see [backends.md](backends.md#pipeline-parallelism)",
    )
    microbatches: int | None = config_key(
        None,
        "pieces each micro-batch is cut into for the pipeline (train.micro_batch_size must be "
        "a multiple); null: the number of stages, a count every schedule runs",
    )
    stages_per_rank: int | None = config_key(
        None,
        "model chunks each pipeline rank holds: 1 for `1f1b` / `gpipe`, 2 for `zero_bubble` / "
        "`dualpipev`, 2 or more for `interleaved_1f1b` / `looped_bfs`; null: the schedule's "
        "smallest",
    )
    layers_per_stage: int | None = config_key(
        None,
        "transformer blocks in each stage (stages x layers_per_stage = model.n_layers); null: "
        "balanced, the embedding and the output head each weighed as one block",
    )


@dataclass
class ParallelConfig:
    backend: Literal["auto", "single", "ddp", "fsdp", "deepspeed"] = config_key(
        "auto",
        "`auto` (`single` when run as one process, `ddp` when a launcher starts several; the "
        "resolved name is in the run dir's `plan.json`), `single` (one process, no process group), "
        "`ddp`, `fsdp` (FSDP2) or `deepspeed`; see [backends.md](backends.md)",
    )
    world_size: int | None = config_key(
        None,
        "the ranks (GPUs) this config is laid out for, e.g. 64 in yaml/70b.yaml: `estimate` "
        "predicts for it when no --world-size is given; `train` runs on the ranks its launcher "
        "starts (one warning when they differ); null: not stated",
    )
    tensor_parallel: int = config_key(
        1,
        "ranks that split each layer's matmuls (Megatron-style tensor parallelism on "
        "DTensor, consecutive ranks: inside a node); must divide the world size, the rest is "
        "data parallel (FSDP2's shard, or HSDP's replicate x shard); needs "
        "parallel.backend=fsdp; see [backends.md](backends.md#tensor-parallelism)",
    )
    sequence_parallel: bool = config_key(
        True,
        "with tensor_parallel > 1: norms and residuals hold 1/tensor_parallel of the sequence "
        "on each rank (activations divided too); false keeps them whole on every rank",
    )
    pipeline_parallel: int = config_key(
        1,
        "pipeline degree: the blocks are split into consecutive stages held by this many groups "
        "of ranks (the outermost mesh dimension: across nodes); must divide the world size; "
        "needs parallel.backend=fsdp; see [backends.md](backends.md#pipeline-parallelism)",
    )
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)


# one process, whatever backend, tensor and pipeline parallelism a config is laid out for
# (`eval` and `generate` run a trained run's config so, `check` its sweep and bare loop)
ONE_PROCESS = {
    "parallel.backend": "single",
    "parallel.tensor_parallel": 1,
    "parallel.pipeline_parallel": 1,
}


# ds_config entries the framework owns -> the YAML key that sets them
OWNED = {
    "train_batch_size": "train.micro_batch_size x train.grad_accum x world size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "gradient_clipping": "train.grad_clip",
    "bf16": "train.precision",
    "fp16": "train.precision",
    "optimizer": "train.lr / train.weight_decay / train.beta1 / train.beta2 (the framework "
    "builds AdamW and sets the LR each step)",
    "scheduler": "train.warmup_steps / train.min_lr (the framework sets the LR each step)",
    "zero_optimization.stage": "parallel.deepspeed.zero_stage",
    "zero_optimization.offload_optimizer": "parallel.deepspeed.offload_optimizer",
    "zero_optimization.offload_param": "parallel.deepspeed.offload_param",
    "zero_optimization.cpu_offload": "parallel.deepspeed.offload_optimizer",  # (their old names)
    "zero_optimization.cpu_offload_param": "parallel.deepspeed.offload_param",
    # off, the engine reports no norm: every step would count as skipped (the finite check)
    "zero_optimization.compute_grad_norm": "the framework (the gradient norm is its finite "
    "check and its grad_norm metric)",
    "data_types.param_dtype": "train.precision",
    # quantized weights or gradients in communication (ZeRO++): not the one-process curve
    **dict.fromkeys(
        (f"zero_optimization.zero_quantized_{x}" for x in ("weights", "gradients")),
        "train.precision (the framework communicates in the training dtypes)",
    ),
    "zero_optimization.zero_quantized_nontrainable_weights": "train.precision (the framework "
    "communicates in the training dtypes)",
    "zero_optimization.legacy_stage1": "parallel.deepspeed.zero_stage (DeepSpeed runs no legacy "
    "stage 1)",
    # top-k selective updates (ZenFlow's CPU Adam): not the one-process AdamW curve
    "zero_optimization.zenflow": "train.* (the framework's AdamW updates every parameter)",
}
DS_DTYPES = {  # the dtype names DeepSpeed's DtypeEnum reads (int8: no training dtype)
    *("fp16", "float16", "half", "torch.float16", "fp32", "float32", "float", "torch.float32"),
    *("bf16", "bfloat16", "torch.bfloat16"),
}
DATA_TYPES = ("grad_accum_dtype", "buffer_dtype", "keep_in_fp32_modules")  # (param_dtype: owned)


# the ds_config sections the pass-through takes, with the kinds of value each takes: the engine's
# ZeRO, dtype and logging settings (DeepSpeed's model judges zero_optimization's entries). Its
# other sections duplicate the framework's own work, and some make DeepSpeed read, import or
# write what the config names (REFUSED says which)
PASSTHROUGH: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("zero_optimization", "data_types", "comms_logger"), (dict,)),
    "communication_data_type": (str,),
    "gradient_predivide_factor": (float, int),
    "steps_per_print": (int,),
    **dict.fromkeys(("prescale_gradients", "wall_clock_breakdown", "memory_breakdown"), (bool,)),
    **dict.fromkeys(("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"), (bool,)),
}
_WRITES = "DeepSpeed writes files at the paths it names (the run dir holds the framework's logs)"
REFUSED = {
    "checkpoint": "DeepSpeed's universal-checkpoint loading (load_universal) reads the "
    "checkpoint's files with pickle, past the framework's checks, and can run code planted in "
    "them (checkpoints are the framework's: checkpoint.*)",
    "torch_autocast": "DeepSpeed imports the modules its lower_precision_safe_modules names, "
    "which can run any code beside the config (precision is train.precision)",
    "wandb": "DeepSpeed logs the run's metrics to the W&B project it names (logging.wandb.*)",
    "comet": "DeepSpeed sends the run's metrics to the account it names",
    **dict.fromkeys(("tensorboard", "csv_monitor", "flops_profiler"), _WRITES),
    "autotuning": f"{_WRITES}, then ends the run",
}


def passthrough_problems(raw: dict[str, Any], zero_stage: int = 2) -> list[str]:
    """Entries of parallel.deepspeed.config that would contradict a framework key, and
    sections outside the pass-through's."""
    problems = []
    for key, instead in OWNED.items():
        head, _, tail = key.partition(".")
        if head in raw and (not tail or (isinstance(raw[head], dict) and tail in raw[head])):
            problems.append(f"parallel.deepspeed.config.{key}: set by {instead}; remove it here")
    takes = ", ".join(PASSTHROUGH)
    for key, value in raw.items():
        kinds = PASSTHROUGH.get(key, ())
        if value is None and kinds and dict not in kinds and key != "gradient_predivide_factor":
            continue  # (null: DeepSpeed's own default)
        if kinds and (not isinstance(value, kinds) or isinstance(value, bool) > (bool in kinds)):
            names = {dict: "a mapping", str: "a string", bool: "true or false", int: "an integer"}
            kind = names.get(kinds[0])
            problems.append(
                f"parallel.deepspeed.config.{key}: {value!r:.60} is not {kind or 'a number'}; "
                f"give one, or remove it here"
            )
        elif not kinds and key not in OWNED:
            why = REFUSED.get(key, f"not among the sections the pass-through takes ({takes})")
            problems.append(f"parallel.deepspeed.config.{key}: {why}; remove it here")
        elif kinds and (said := _value_problem(key, value, raw, zero_stage)):
            problems.append(f"parallel.deepspeed.config.{key}: {said}")
    return problems


def _value_problem(key: str, value: Any, raw: dict[str, Any], zero_stage: int) -> str | None:
    """What DeepSpeed would stop at (in its engine or first step) in an entry of the right kind."""
    zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}
    # ZeRO-2/3 reduce-scatter their gradients unless told not to (DeepSpeed's default: on);
    # ZeRO-1 keeps whole gradients (it all-reduces them)
    scattered = zero_stage in (2, 3) and zero.get("reduce_scatter", True) is not False
    if key == "steps_per_print" and value is not None and value < 1:
        return (
            f"{value} is not a count of steps (DeepSpeed prints at each step its count divides: "
            f"0 divides by zero, a negative one divides as its size does); give a count >= 1, or "
            f"remove it (quiet)"
        )
    reads = ("fp32", "fp16", "bf16")  # (DeepSpeed's communication dtypes, in any case)
    if key == "communication_data_type" and value is not None and value.lower() not in reads:
        return f"{value!r:.40} is not a dtype DeepSpeed reduces in; give fp32, bf16 or fp16"
    if key == "gradient_predivide_factor":
        if value is None or not math.isfinite(value) or value <= 0:
            return f"{value!r:.40} divides the gradients; give a number > 0, or remove it for 1.0"
        if value != 1 and scattered:
            return (
                f"{value!r:.40}: DeepSpeed's ZeRO-{zero_stage} takes only 1.0 with reduce-scatter "
                f"on; set zero_optimization.reduce_scatter: false too, or remove it"
            )
    if key == "prescale_gradients" and value and scattered:
        return (
            f"true: DeepSpeed's ZeRO-{zero_stage} cannot prescale with reduce-scatter on; set "
            f"zero_optimization.reduce_scatter: false too, or remove it"
        )
    if key == "data_types" and value is not None:
        if unknown := sorted(map(str, set(value) - set(DATA_TYPES) - {"param_dtype"})):
            return f"{unknown[0]!r:.40} is not one of its keys ({', '.join(DATA_TYPES)})"
        for name in ("grad_accum_dtype", "buffer_dtype"):
            v = value.get(name)  # (as written)
            if v is not None and not (isinstance(v, str) and v in DS_DTYPES):
                return f"{name}: {v!r:.40} is not a dtype; give fp32, bf16 or fp16"
        if value.get("grad_accum_dtype") is not None and zero_stage <= 1:
            return (
                f"grad_accum_dtype under zero_stage={zero_stage}: DeepSpeed's engine stops on "
                f"most mixes, and fp32 under bf16 swaps in its BF16_Optimizer, whose "
                f"checkpoints no other backend, convert or generate reads; zero_stage 2 or 3 "
                f"accumulate in fp32 (the default), or remove it"
            )
        keep = value.get("keep_in_fp32_modules", "auto")
        if keep != "auto" and not (
            isinstance(keep, list) and all(isinstance(n, str) for n in keep)
        ):
            return f'keep_in_fp32_modules: {keep!r:.40} is not "auto" or a list of name patterns'
    return None


def validate_parallel(cfg: Config) -> list[str]:
    """Backend options that only make sense with one backend, or not at all together."""
    e, p, backend = [], cfg.parallel, cfg.parallel.backend
    ds, fsdp = p.deepspeed, p.fsdp
    if not 0 <= ds.zero_stage <= 3:
        e.append(
            f"parallel.deepspeed.zero_stage={ds.zero_stage} must be 0, 1, 2 or 3 (e.g. "
            f"parallel.deepspeed.zero_stage=2)"
        )
    split = max(p.tensor_parallel, 1) * max(p.pipeline_parallel, 1)
    if p.world_size is not None and (p.world_size < 1 or p.world_size % split):
        e.append(
            f"parallel.world_size={p.world_size} must be >= 1 and a multiple of "
            f"parallel.tensor_parallel={p.tensor_parallel} x parallel.pipeline_parallel="
            f"{p.pipeline_parallel} (the ranks the layout is written for), or null"
        )
    e += bound_problems(fsdp, "replicate_degree", ">= 1", "parallel.fsdp.")
    e += bound_problems(p.ddp, "bucket_cap_mb", prefix="parallel.ddp.")  # (torch takes 0, -5)
    if fsdp.cpu_offload and backend != "fsdp":
        e.append(
            f"parallel.fsdp.cpu_offload=true needs parallel.backend=fsdp (it is {backend}): "
            f"e.g. parallel.backend=fsdp; with deepspeed use "
            f"parallel.deepspeed.offload_optimizer/offload_param"
        )
    offloads = [k for k in ("offload_optimizer", "offload_param") if getattr(ds, k) != "none"]
    if offloads and backend != "deepspeed":
        e.append(
            f"parallel.deepspeed.{offloads[0]}=cpu needs parallel.backend=deepspeed (it is "
            f"{backend}): e.g. parallel.backend=deepspeed; with fsdp use "
            f"parallel.fsdp.cpu_offload=true"
        )
    if ds.offload_param != "none" and ds.zero_stage != 3:
        e.append(
            f"parallel.deepspeed.offload_param=cpu needs parallel.deepspeed.zero_stage=3 "
            f"(it is {ds.zero_stage}); parameters are only partitioned under ZeRO-3, e.g. "
            f"parallel.deepspeed.zero_stage=3"
        )
    if ds.offload_optimizer != "none" and ds.zero_stage == 0:
        e.append(
            "parallel.deepspeed.offload_optimizer=cpu needs parallel.deepspeed.zero_stage "
            ">= 1, e.g. parallel.deepspeed.zero_stage=2 (ZeRO-Offload moves the partitioned "
            "optimizer state)"
        )
    if ds.config and backend != "deepspeed":
        e.append(
            f"parallel.deepspeed.config needs parallel.backend=deepspeed (it is {backend}): "
            f"its entries go to the DeepSpeed engine alone; remove it, or use deepspeed"
        )
    elif ds.config:
        e.extend(passthrough_problems(ds.config, ds.zero_stage))
    e.extend(pipeline_problems(cfg))
    if (mode := cfg.checkpoint.async_mode) != "disabled" and backend == "deepspeed":
        e.append(
            f"checkpoint.async_mode={mode} is not available with parallel.backend=deepspeed "
            f"(the DeepSpeed engine writes its own checkpoint files, which have no background "
            f"save); set checkpoint.async_mode=disabled, or use parallel.backend=fsdp (its "
            f"sharding is ZeRO-3's)"
        )
    return e


def stages_per_rank(pipe: PipelineConfig) -> int:
    """parallel.pipeline.stages_per_rank, or its schedule's fewest (2: looped and V, else 1)."""
    fewest = 2 if pipe.schedule in LOOPED_SCHEDULES else 1
    return fewest if pipe.stages_per_rank is None else pipe.stages_per_rank


def pipeline_microbatches(p: ParallelConfig) -> int:
    """parallel.pipeline.microbatches, or the stages' count (one every schedule runs)."""
    m = p.pipeline.microbatches
    return p.pipeline_parallel * stages_per_rank(p.pipeline) if m is None else m


def pipeline_problems(cfg: Config) -> list[str]:
    """parallel.pipeline_parallel against the backend, the model and the batch."""
    pp = cfg.parallel.pipeline_parallel
    if pp < 1:
        return [f"parallel.pipeline_parallel={pp} must be >= 1 (1: no pipeline parallelism)"]
    if pp == 1:
        return []
    e = [*_pipeline_companions(cfg), *_pipeline_stage_problems(cfg)]
    return e or _pipeline_batch_problems(cfg)


def _pipeline_companions(cfg: Config) -> list[str]:
    """Settings pipeline parallelism does not compose with, each with its fix."""
    p, m = cfg.parallel, cfg.model
    pp, e = p.pipeline_parallel, []
    if p.backend != "fsdp":
        e.append(
            f"parallel.pipeline_parallel={pp} needs parallel.backend=fsdp (it is {p.backend}): "
            f"each pipeline stage is sharded with FSDP2 over its data-parallel ranks (DDP and "
            f"DeepSpeed wrap the whole model); set parallel.backend=fsdp, or "
            f"parallel.pipeline_parallel=1"
        )
    if m.tie_embeddings:
        e.append(
            f"model.tie_embeddings=true with parallel.pipeline_parallel={pp}: the embedding "
            f"lives on the first stage and the output head on the last, so one tied matrix "
            f"cannot be both; set model.tie_embeddings=false, or parallel.pipeline_parallel=1"
        )
    if m.attention_mask == "document":
        e.append(
            f"model.attention_mask=document with parallel.pipeline_parallel={pp}: the "
            f"document bounds come from the tokens, which only the first stage sees; set "
            f"model.attention_mask=causal, or parallel.pipeline_parallel=1"
        )
    if p.pipeline.schedule in V_SCHEDULES and cfg.activation_checkpointing.mode == "selective":
        e.append(
            f"activation_checkpointing.mode=selective with parallel.pipeline.schedule="
            f"{p.pipeline.schedule}: its backward runs in two halves (inputs, then weights) "
            f"that each recompute a checkpointed block, and a selective block is recomputed "
            f"for one backward only (PyTorch fails the second); set "
            f"activation_checkpointing.mode=full or every_k, or another "
            f"parallel.pipeline.schedule"
        )
    if not p.fsdp.reduce_every_micro_step:
        e.append(
            f"parallel.fsdp.reduce_every_micro_step=false with parallel.pipeline_parallel={pp}: "
            f"a pipeline stage reduce-scatters its gradients after each schedule run; set "
            f"parallel.fsdp.reduce_every_micro_step=true"
        )
    return e


def _pipeline_stage_problems(cfg: Config) -> list[str]:
    """The schedule's stages a rank, and the blocks each stage holds."""
    pipe, n, pp = cfg.parallel.pipeline, cfg.model.n_layers, cfg.parallel.pipeline_parallel
    name, chunks = pipe.schedule, stages_per_rank(pipe)
    allowed = [1]
    if name in LOOPED_SCHEDULES:
        allowed = [2] if name in V_SCHEDULES else list(range(2, max(2, n // pp) + 1))
    if chunks not in allowed:
        return [
            f"parallel.pipeline.stages_per_rank={chunks} does not fit "
            f"parallel.pipeline.schedule={name}: use parallel.pipeline.stages_per_rank={allowed[0]}"
            + (f" (up to {allowed[-1]})" if len(allowed) > 1 else "")
            + ", or null (the schedule's own)"
        ]
    stages, per = pp * chunks, pipe.layers_per_stage
    if per is not None and per * stages != n:
        fits = [k for k in range(2, n + 1) if n % (k * chunks) == 0]
        return [
            f"parallel.pipeline.layers_per_stage={per} x {stages} stages (pipeline_parallel "
            f"{pp} x stages_per_rank {chunks}) is not model.n_layers={n}: use "
            + (f"parallel.pipeline.layers_per_stage={n // stages}, " if n % stages == 0 else "")
            + "parallel.pipeline.layers_per_stage=null (balanced)"
            + (f", or parallel.pipeline_parallel={fits[0]}" if fits and n % stages else "")
        ]
    if n < stages:
        return [
            f"model.n_layers={n} is fewer than the {stages} pipeline stages (pipeline_parallel "
            f"{pp} x stages_per_rank {chunks}): each stage holds at least one block; use "
            f"parallel.pipeline_parallel={max(1, n // chunks)} or more layers"
        ]
    return []


def _pipeline_batch_problems(cfg: Config) -> list[str]:
    """The microbatches against the schedule's rule (torch 2.13's: `microbatches_fit`) and
    train.micro_batch_size; each suggestion is a count that meets both."""
    p, mb = cfg.parallel, cfg.train.micro_batch_size
    pp, name, m = p.pipeline_parallel, p.pipeline.schedule, pipeline_microbatches(p)
    most = min(mb, 1 << 16)  # (counts past that are no suggestion; a huge batch is still read)
    fits = [k for k in range(1, most + 1) if mb % k == 0 and microbatches_fit(name, k, pp)]
    use = f"use parallel.pipeline.microbatches={_nearest(fits, m)}" if fits else ""
    if not microbatches_fit(name, m, pp):
        least = _least_microbatches(name, pp)
        if m < least:
            return [
                f"parallel.pipeline.microbatches={m} is fewer than the {least} that parallel."
                f"pipeline.schedule={name} needs here (one a stage); "
                + (use or f"use train.micro_batch_size={least} and microbatches={least}")
            ]
        return [
            f"parallel.pipeline.microbatches={m} is not a multiple of its {max(1, m // pp)} "
            f"rounds (parallel.pipeline.schedule={name} runs microbatches // pipeline_parallel "
            f"rounds of equal size); "
            + (use or f"use parallel.pipeline.microbatches={pp} and train.micro_batch_size={pp}")
        ]
    if mb % m:
        return [
            f"train.micro_batch_size={mb} cannot be cut into parallel.pipeline.microbatches={m} "
            f"equal pieces: "
            + _either(
                f"train.micro_batch_size={-(-mb // m) * m}" if m <= 1 << 16 else "",
                f"parallel.pipeline.microbatches={_nearest(fits, m)}" if fits else "",
            )
        ]
    return []


def _either(*fixes: str) -> str:
    """`use A or B` of the fixes given (none: fewer microbatches)."""
    given = [f for f in fixes if f]
    return f"use {' or '.join(given)}" if given else "use fewer parallel.pipeline.microbatches"


def _least_microbatches(schedule: str, pp: int) -> int:
    """The fewest microbatches `schedule` runs on `pp` pipeline ranks (torch 2.13): 1F1B one
    per stage, DualPipeV one per stage of its V (2 x pp), the others one."""
    return {"1f1b": pp, "dualpipev": 2 * pp}.get(schedule, 1)


def microbatches_fit(schedule: str, m: int, pp: int) -> bool:
    """Whether torch 2.13's `schedule` runs `m` microbatches on `pp` ranks: the least above,
    and interleaved 1F1B's rounds (max(1, m // pp) of them) of equal size."""
    if m < _least_microbatches(schedule, pp):
        return False
    return schedule != "interleaved_1f1b" or m % max(1, m // pp) == 0


def _nearest(values: list[int], target: int) -> int:
    """The value closest to `target`, the larger one on a tie (more microbatches: less bubble)."""
    return min(values, key=lambda v: (abs(v - target), -v))
