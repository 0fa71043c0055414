"""The config tree: one dataclass per section, each key declared with its default and help
(`schema.config_key`); an area's sections live in their own module (data, parallel, profile,
fp8), this one holds the rest and assembles `Config`."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from scale_llm.config.data import DataConfig
from scale_llm.config.fp8 import Fp8Config
from scale_llm.config.parallel import ActivationCheckpointingConfig, ParallelConfig
from scale_llm.config.profile import ProfileConfig
from scale_llm.config.schema import config_key


@dataclass
class RunConfig:
    name: str = config_key(
        "defaults",  # not tiny.yaml's "tiny": a run without a config never shares its directory
        "name of the run; the run directory is `<run.dir>/<run.name>`; a plain name (no "
        "separators, not `.`/`..`, no leading `-`). The no-config default is `defaults` "
        "(yaml/tiny.yaml's run is `tiny`)",
    )
    dir: str = config_key("runs", "parent directory of run directories")
    seed: int = config_key(
        1337, "seeds weight init and the data order; part of a run's identity", run_defining=True
    )


@dataclass
class WandbConfig:
    project: str | None = config_key(
        None,
        "Weights & Biases project to log to (the same scalars, samples and the config; needs the "
        "`wandb` package: `.venv/bin/pip install -e '.[wandb]'` in a checkout); null: no W&B. A "
        "resumed run logs to the same W&B run (its id is kept in `RUN_DIR/wandb-id.txt`), a new "
        "one where it rewrites logged steps (W&B drops steps that do not increase) or starts from "
        "another run's checkpoint; no git "
        "state is recorded (W&B would run git in the run dir, and git the commands a "
        "`.git/config` there names)",
    )
    name: str | None = config_key(None, "the W&B run's display name; null: run.name")
    mode: Literal["online", "offline", "disabled"] = config_key(
        "online",
        "`online` (the node's API key, from `wandb login` or WANDB_API_KEY, is looked for "
        "before any work), `offline` (written under `RUN_DIR/wandb/`, or `RUN_DIR/.wandb/` where "
        "that folder exists; `wandb sync` uploads it later) or `disabled`",
    )


@dataclass
class LoggingConfig:
    every: int = config_key(
        10,
        "optimizer steps between metric rows (metrics.jsonl, TensorBoard, console); each "
        "launch's first step and the run's last are logged too",
    )
    tensorboard: bool = config_key(
        True, "also write TensorBoard event files to `RUN_DIR/tensorboard`"
    )
    peak_tflops: float | None = config_key(  # the built-in table: components/hardware.py
        None,
        "dense peak TFLOP/s per device, for MFU on devices the built-in table does not "
        "know (it knows H100 SXM / PCIe / NVL, H200 SXM / NVL, A100, L40S, L40, L4, RTX 4090, "
        "RTX A6000, MI300X); on a CPU MFU is reported only with this set",
    )
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ModelConfig:
    vocab_size: int = config_key(
        4096,
        "tokenizer size; `prepare` trains a tokenizer of exactly this size and `train` "
        "refuses data whose tokenizer differs",
        run_defining=True,
    )
    d_model: int = config_key(256, "residual width", run_defining=True)
    n_layers: int = config_key(4, "transformer blocks", run_defining=True)
    n_heads: int = config_key(
        4,
        "attention heads; must divide d_model, head size must be even (rotary)",
        run_defining=True,
    )
    n_kv_heads: int | None = config_key(
        None, "key/value heads for grouped-query attention; null = n_heads", run_defining=True
    )
    seq_len: int = config_key(256, "context length in tokens", run_defining=True)
    mlp_hidden: int | None = config_key(
        None,
        "SwiGLU hidden width; null = 8/3 d_model rounded up to a multiple of 128",
        run_defining=True,
    )
    tie_embeddings: bool = config_key(
        True, "output head reuses the token embedding matrix", run_defining=True
    )
    attention: Literal["sdpa", "eager"] = config_key(
        "sdpa",
        "`sdpa` (`scaled_dot_product_attention`, fused kernels) or `eager` (materializes "
        "the (B, n_heads, T, T) score matrix; for teaching and memory comparisons)",
    )
    attention_mask: Literal["causal", "document"] = config_key(
        "causal",
        "`causal`: a token attends to every earlier token of its sequence; `document`: only to "
        "those of its own document in the packed sequence (documents end at "
        "`model.document_end_id`), as if each were run alone; see data.md",
        run_defining=True,
    )
    document_end_id: int = config_key(
        2,
        "`attention_mask: document` only: the id that ends a document in the shards (the EOS "
        "of data.dir's tokenizer: 2 for the one prepare trains); checked at the start of a run",
    )
    norm_eps: float = config_key(1e-5, "RMSNorm epsilon", run_defining=True)
    rope_theta: float = config_key(10000.0, "rotary base", run_defining=True)
    init_std: float = config_key(
        0.02, "init std; residual output projections use init_std / sqrt(2 n_layers)"
    )
    init_from: str | None = config_key(
        None,
        "a local Hugging Face Llama folder (or a `scale-llm export`) whose weights start a fresh "
        "run (continued pretraining); not used when resuming; see [ecosystem.md](ecosystem.md)",
    )


WIDTH_MULTIPLE = 128  # tensor-core friendly widths: the MLP default; vocab sizes are checked


def mlp_hidden_size(m: ModelConfig) -> int:
    """SwiGLU hidden width: model.mlp_hidden, or 8/3 * d_model (the parameters of a 4x GELU
    MLP) rounded up to a multiple of 128 so that the MLP matmuls tile evenly on tensor cores."""
    if m.mlp_hidden is not None:
        return m.mlp_hidden
    return WIDTH_MULTIPLE * math.ceil(8 * m.d_model / 3 / WIDTH_MULTIPLE)


def kv_heads(m: ModelConfig) -> int:
    """Key/value heads: model.n_kv_heads, or n_heads (multi-head attention) where it is null."""
    return m.n_kv_heads or m.n_heads


# The model keys whose null stands for a value computed from others: a run is the same run
# whether its config says null or that value.
RESOLVED_KEYS = {"model.n_kv_heads": kv_heads, "model.mlp_hidden": mlp_hidden_size}


def same_resolved(key: str, a: ModelConfig, b: ModelConfig) -> bool:
    """Whether `key`, one of RESOLVED_KEYS, stands for the same value in both models."""
    resolve = RESOLVED_KEYS.get(key)
    return resolve is not None and resolve(a) == resolve(b)


@dataclass
class TrainConfig:
    micro_batch_size: int = config_key(8, "sequences per forward/backward on each rank")
    grad_accum: int = config_key(
        1, "micro-batches per optimizer step; each micro-loss is divided by it"
    )
    global_batch_size: int | None = config_key(
        None,
        "sequences per step over all ranks; when set, grad_accum = global_batch_size / "
        "(micro_batch_size x world size), and a world size that does not divide it is an error",
    )
    max_steps: int = config_key(200, "optimizer steps")
    max_bad_steps: int = config_key(
        20, "stop (exit 3) after this many consecutive skipped (non-finite) steps"
    )
    gc_every: int = config_key(
        50,
        "Python's garbage collector runs only at the end of every gc_every-th step, on every "
        "rank at the same step (a collection pausing one rank mid-step would stall the others at "
        "their next collective), plus a full collection before each checkpoint; what exists when "
        "training starts is frozen out of its scans. 0: Python's automatic collection",
    )
    exit_at_step: int | None = config_key(
        None,
        "save a checkpoint and exit after this step (for time-limited jobs); the LR "
        "schedule still runs to max_steps. The next launch resumes with it raised or null (a "
        "launch resuming at or past it is refused)",
    )
    lr: float = config_key(1e-3, "peak learning rate")
    min_lr: float = config_key(1e-4, "learning rate at the end of the decay")
    warmup_steps: int = config_key(20, "linear warmup steps")
    lr_schedule: Literal["cosine", "linear", "wsd", "constant"] = config_key(
        "cosine",
        "after warmup: `cosine`, `linear` (both to min_lr at max_steps), `wsd` (hold lr, "
        "decay linearly over the last decay_fraction; extends without a jump), `constant`",
    )
    decay_fraction: float = config_key(0.2, "`wsd`: share of max_steps spent decaying to min_lr")
    weight_decay: float = config_key(
        0.1, "AdamW decay on matrices (not on norms, biases, embeddings)"
    )
    grad_clip: float = config_key(1.0, "max global gradient norm per step; 0 disables clipping")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = config_key(
        "auto",
        "`auto` (bf16 on a bf16-capable GPU, fp32 on CPU), `bf16` (autocast, no scaler), "
        "`fp16` (autocast + GradScaler), `fp32`",
    )
    beta1: float = config_key(0.9, "AdamW beta1")
    beta2: float = config_key(0.95, "AdamW beta2")
    eps: float = config_key(1e-8, "AdamW epsilon")
    device: Literal["auto", "cpu", "cuda"] = config_key(
        "auto", "`auto` (CUDA if visible), `cpu`, `cuda`"
    )
    compile: Literal["auto", True, False] = config_key(
        "auto",
        "`torch.compile` each transformer block (`fullgraph=True`, after activation checkpointing, "
        "before DDP / FSDP / DeepSpeed wrap) and the loss. `auto`: on a GPU (the toolchain is "
        "checked at start-up, by compiling one small function; without a C++/C compiler, Triton or "
        "Python's headers the run goes eager with one warning), never on the CPU; `true`: always, "
        "and a missing toolchain stops the launch naming what to install; `false`: never. Under "
        "DeepSpeed ZeRO-3 the blocks stay eager (its parameter-gathering hooks sit inside each "
        "block), with one warning; the loss is still compiled. See [training.md](training.md)",
    )
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)


def compiles(train: TrainConfig, device_type: str) -> bool:
    """Whether train.compile means compiled blocks on this device type (auto: on a GPU)."""
    return train.compile is True or (train.compile == "auto" and device_type == "cuda")


def measures_compiled(cfg: Config, device_type: str) -> bool:
    """`compiles` for `estimate --measure`'s saved activations, but never under selective
    checkpointing, whose cache lives outside autograd (its blocks are counted eager)."""
    return compiles(cfg.train, device_type) and cfg.activation_checkpointing.mode != "selective"


@dataclass
class EvalConfig:
    every: int = config_key(
        50, "optimizer steps between evaluations (and at the last step); 0 disables"
    )
    steps: int = config_key(
        10,
        "validation batches per evaluation, each the size of a training step's global batch; the "
        "same windows each time, whatever the micro-batch, accumulation or world size",
    )
    sample_every: int = config_key(
        0,
        "optimizer steps between sample generations (and at the last step): a greedy continuation "
        "of eval.sample_prompt in TensorBoard's text tab, metrics.jsonl and the console; 0: none",
    )
    sample_prompt: str = config_key(
        "", "prompt of the samples (after BOS); empty: a document's start"
    )
    sample_tokens: int = config_key(48, "tokens generated per sample")
    tasks: str | None = config_key(
        None,
        "lm-evaluation-harness tasks to run while training, comma-separated as `scale-llm "
        "eval --tasks` takes them (e.g. `hellaswag,arc_easy`); scores go to metrics.jsonl and "
        "TensorBoard as `eval/<task>/<metric>`. Not with parallel.backend=deepspeed. See "
        "[ecosystem.md](ecosystem.md); null: none",
    )
    tasks_every: int = config_key(
        0, "optimizer steps between eval.tasks runs (and at the last step); 0: the last only"
    )
    tasks_include_path: str | None = config_key(
        None, "a folder of extra task YAMLs for eval.tasks (as `scale-llm eval --include-path`)"
    )
    tasks_limit: int | None = config_key(
        None, "examples per task (lm-eval's `--limit`); null: all of them"
    )


@dataclass
class CheckpointConfig:
    every: int = config_key(
        100, "optimizer steps between checkpoints; the last step is always saved; 0 = only the last"
    )
    keep_last: int = config_key(2, "complete checkpoints kept; older ones are deleted")
    resume: str = config_key(
        "auto",
        "`auto`: continue from the newest complete checkpoint in the run dir, if any; `never`: "
        "start fresh (refused if the run dir already has checkpoints); or a checkpoint directory",
    )
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = config_key(
        "disabled",
        "`disabled`: a save holds the step until its files are written; `async`: the step "
        "waits only while model and optimizer are copied to host memory, the files are written "
        "in a background thread and the checkpoint is published when they are (one save in "
        "flight; costs a host copy of this rank's model + optimizer state during the write); "
        "`async_with_pinned_mem`: as async, into a host copy kept for the whole run "
        "(page-locked on a GPU). Not with parallel.backend=deepspeed",
    )


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name


def get_key(cfg: Any, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), cfg)
