"""The run configuration: one tree of dataclasses, loaded from YAML plus dotted CLI overrides.

Precedence is CLI overrides > YAML > dataclass defaults. Every problem (unknown key, wrong type,
impossible value or combination) is collected and reported in one `UserError` that names each key
and the fix, before any model or process group exists.

The sections used by one package keep their schema and checks beside it (`parallel/options.py`,
`data/options.py`); this module holds the rest, assembles the tree, and does the loading, the
overrides, the deprecated-key aliases and the collect-all report. Resolving `auto` against the
launch is `scale_llm.plan`'s job, not this module's.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from scale_llm.data.options import PER_SOURCE_KEYS, DataConfig, validate_data
from scale_llm.errors import UserError
from scale_llm.parallel.options import (
    ActivationCheckpointingConfig,
    DDPConfig,
    DeepSpeedConfig,
    FSDPConfig,
    ParallelConfig,
    validate_activation_checkpointing,
    validate_parallel,
)
from scale_llm.schema import config_key
from scale_llm.train.options import ProfileConfig, validate_profile

__all__ = [  # the section schemas that live beside their owners, re-exported for convenience
    "ActivationCheckpointingConfig",
    "DDPConfig",
    "DataConfig",
    "DeepSpeedConfig",
    "FSDPConfig",
    "ParallelConfig",
]

log = logging.getLogger(__name__)
Precision = Literal["auto", "bf16", "fp16", "fp32"]


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
        "Weights & Biases project to log to (the same scalars, samples and the config; needs "
        "the `wandb` package: `.venv/bin/pip install -e '.[wandb]'` in a checkout); null: no "
        "W&B. A resumed run logs to the same W&B run (its id is kept in "
        "`RUN_DIR/wandb-id.txt`)",
    )
    name: str | None = config_key(None, "the W&B run's display name; null: run.name")
    mode: Literal["online", "offline", "disabled"] = config_key(
        "online",
        "`online`, `offline` (written under `RUN_DIR/wandb/`, `wandb sync` uploads it later) "
        "or `disabled`",
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
        "a local Hugging Face Llama folder (or a `scale-llm export`) whose weights start "
        "a fresh run (continued pretraining); not used when resuming; see "
        "[ecosystem.md](ecosystem.md)",
    )


@dataclass
class TrainConfig:
    micro_batch_size: int = config_key(8, "sequences per forward/backward on each rank")
    grad_accum: int = config_key(
        1, "micro-batches per optimizer step; each micro-loss is divided by it"
    )
    global_batch_size: int | None = config_key(
        None,
        "sequences per step over all ranks; when set, grad_accum = global_batch_size / "
        "(micro_batch_size x world size), and a world size that does not divide it is an "
        "error",
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
        "schedule still runs to max_steps and the next launch resumes",
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
    precision: Precision = config_key(
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
        "`torch.compile` each transformer block (`fullgraph=True`, after activation "
        "checkpointing, before DDP / FSDP / DeepSpeed wrap) and the loss. `auto`: on a GPU "
        "(the toolchain is checked at start-up, by compiling one small function; without a "
        "C++/C compiler, Triton or Python's headers the run goes eager with one warning), "
        "never on the CPU; `true`: always, and a missing toolchain stops the launch naming "
        "what to install; `false`: never. Under DeepSpeed ZeRO-3 the blocks stay eager (its "
        "parameter-gathering hooks sit inside each block), with one warning; the loss is still "
        "compiled. See [training.md](training.md)",
    )
    profile: ProfileConfig = field(default_factory=ProfileConfig)


def compiles(train: TrainConfig, device_type: str, tensor_parallel: int = 1) -> bool:
    """Whether train.compile means compiled blocks on this device type (auto: on a GPU, and
    not under tensor parallelism, whose compiled blocks the config refuses)."""
    if tensor_parallel > 1:
        return False
    return train.compile is True or (train.compile == "auto" and device_type == "cuda")


@dataclass
class EvalConfig:
    every: int = config_key(
        50, "optimizer steps between evaluations (and at the last step); 0 disables"
    )
    steps: int = config_key(
        10,
        "validation batches per evaluation, each the size of a training step's global "
        "batch; the same windows each time, whatever the micro-batch, accumulation or "
        "world size",
    )
    sample_every: int = config_key(
        0,
        "optimizer steps between sample generations (and at the last step): a greedy "
        "continuation of eval.sample_prompt in TensorBoard's text tab, metrics.jsonl and the "
        "console; 0: none",
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
        100,
        "optimizer steps between checkpoints; the last step is always saved; 0 = only the last",
    )
    keep_last: int = config_key(2, "complete checkpoints kept; older ones are deleted")
    resume: str = config_key(
        "auto",
        "`auto`: continue from the newest complete checkpoint in the run dir, if any; "
        "`never`: start fresh (refused if the run dir already has checkpoints); or a "
        "checkpoint directory",
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


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file at `path` (if any), then `key.path=value` overrides."""
    raw: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        raw = read_yaml_with_base(Path(path))
        where = str(path)
    errors: list[str] = []
    for item in overrides or []:
        _apply_override(raw, item, errors)
    if overrides:
        where += " + command-line overrides"
    _move_deprecated_keys(raw, errors)
    cfg = expand_home(_build(Config, raw, "", errors))
    # Check values too, skipping messages about keys that already failed (they hold defaults).
    failed = [msg.split(":", 1)[0] for msg in errors]
    errors.extend(m for m in validate(cfg) if not any(k in m for k in failed))
    if errors:
        raise UserError(format_errors(errors, where))
    return cfg


MAX_CONFIG_BYTES = 1_000_000  # the shipped configs are ~2 KB
MAX_CONFIG_VALUES = 10_000  # scalars + containers after expanding YAML aliases (~150 in 7b.yaml)
MAX_CONFIG_DEPTH = 20  # nesting levels (parallel.deepspeed.config's entries are the deepest)


def short(value: Any, limit: int = 80) -> str:
    """repr(value) for a message, cut to `limit` characters: a config value can be huge."""
    text = repr(value) if len(str(value)) < 10 * limit else repr(str(value)[: 2 * limit])
    return text if len(text) <= limit else text[: limit - 15] + f"... ({len(str(value)):,} chars)"


def shipped_config_dir() -> Path | None:
    """The shipped configs: inside an installed wheel (scale_llm/configs), or the checkout's
    yaml/ folder beside the package."""
    for candidate in (
        Path(__file__).parent / "configs",
        Path(__file__).resolve().parents[1] / "yaml",
    ):
        if candidate.is_dir() and any(candidate.glob("*.yaml")):
            return candidate
    return None


def resolve_config_path(path: str | Path) -> Path:
    """A config path as given, or a shipped config by name (`tiny`, `400m`, `7b.yaml`) when no
    such file exists here."""
    p = Path(path)
    if p.is_file() or len(p.parts) != 1:
        return p
    shipped = shipped_config_dir()
    if shipped is not None:
        for name in (p.name, p.name + ".yaml"):
            if (shipped / name).is_file():
                return shipped / name
    return p


def _shipped_names() -> str:
    shipped = shipped_config_dir()
    names = sorted(q.stem for q in shipped.glob("*.yaml")) if shipped else []
    return f" Shipped configs (by name): {', '.join(names)}." if names else ""


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = resolve_config_path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise UserError(
            f"config file {p} {what}; pass the path of a YAML file or a shipped config's "
            f"name.{_shipped_names()}"
        )
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise UserError(
            f"config file {p} is {size:,} bytes; a config is a few KB of YAML (limit "
            f"{MAX_CONFIG_BYTES:,}): is this the right file?"
        )
    raw_bytes = p.read_bytes()
    try:
        if b"\0" in raw_bytes:
            raise UnicodeDecodeError("utf-8", raw_bytes, 0, 1, "NUL byte")
        text = raw_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(
            f"config file {p} is not UTF-8 text (a binary file?); pass a YAML config"
        ) from None
    try:
        _check_yaml_shape(text, p)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UserError(f"config file {p} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"config file {p} must hold a mapping of sections (run:, model:, ...), "
            f"not a {type(data).__name__}"
        )
    _empty_sections_as_mappings(data, Config)
    return data


def _empty_sections_as_mappings(raw: dict[str, Any], cls: type) -> None:
    """A section written with no keys (`model:` with every line under it commented out) is
    YAML null; read it as an empty section, which changes nothing."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in raw and dataclasses.is_dataclass(hints[f.name]):
            if raw[f.name] is None:
                raw[f.name] = {}
            elif isinstance(raw[f.name], dict):
                _empty_sections_as_mappings(raw[f.name], hints[f.name])


def _check_yaml_shape(text: str, path: Path) -> None:
    """Refuse alias bombs and absurd nesting before anything expands them: count the values
    the document would expand to on the composed node graph (aliases are shared nodes there,
    so this takes time linear in the file, however large the expansion)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise UserError(
            f"config file {path} nests too deeply to read; a config is a few levels of "
            f"sections and keys"
        ) from None
    if root is None:
        return
    sizes: dict[int, int] = {}

    def expanded(node: yaml.Node, depth: int) -> int:
        if depth > MAX_CONFIG_DEPTH:
            raise UserError(
                f"config file {path} nests deeper than {MAX_CONFIG_DEPTH} levels; a config is "
                f"a few levels of sections and keys"
            )
        if id(node) in sizes:
            return sizes[id(node)]
        if isinstance(node, yaml.MappingNode):
            n = 1 + sum(expanded(k, depth + 1) + expanded(v, depth + 1) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n = 1 + sum(expanded(v, depth + 1) for v in node.value)
        else:
            n = 1
        sizes[id(node)] = n
        if n > MAX_CONFIG_VALUES:
            raise UserError(
                f"config file {path} expands to more than {MAX_CONFIG_VALUES:,} values (YAML "
                f"aliases repeating aliases?); a config has a few hundred at most"
            )
        return n

    expanded(root, 0)
    _refuse_duplicate_keys(root, path)  # (a walk the limits above keep short)


def _refuse_duplicate_keys(root: yaml.Node, path: Path) -> None:
    """A key written twice in one mapping (PyYAML silently keeps the last one) is an error
    naming the key and both lines. Walks the composed nodes before anything is constructed,
    once `_check_yaml_shape`'s limits have bounded the walk."""
    todo: list[tuple[yaml.Node, str]] = [(root, "")]
    while todo:
        node, prefix = todo.pop()
        children = node.value if isinstance(node, yaml.SequenceNode) else []
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    line = key.start_mark.line + 1
                    first = seen.get((key.tag, key.value))
                    if first is not None:
                        lines = f"line {line}" if first == line else f"lines {first} and {line}"
                        raise UserError(
                            f"config file {path}: {prefix}{key.value} is written twice ({lines}); "
                            f"YAML would silently keep only the last, so merge the two into one"
                        )
                    seen[(key.tag, key.value)] = line
                    prefix_here = f"{prefix}{key.value}."
                else:
                    prefix_here = prefix
                todo.append((value, prefix_here))
        todo.extend((child, prefix) for child in children)


def read_yaml_with_base(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML file, merged over the file its optional top-level `base:` names (relative to it)."""
    raw = read_yaml(path)
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise UserError(
            f"{path}: base must be the path of another YAML file, not {str(base)[:60]!r}"
        )
    path = resolve_config_path(path)
    base_path = (path.parent / os.path.expanduser(base)).resolve()
    if base_path in seen:
        raise UserError(f"{path}: base: {base} leads back to itself; remove the cycle")
    return deep_merge(read_yaml_with_base(base_path, (*seen, path.resolve())), raw)


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`, section by section (neither is modified)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value), the value parsed as a YAML scalar."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise UserError(
            f"override {short(item)} must look like section.key=value, e.g. --set train.lr=3e-4"
        )
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    return key.strip(), value


INDEXED = re.compile(r"([^\[\]]+)\[(\d+)\]")  # `sources[0]`: an entry of a list key
WHOLE_LIST = "[{name: ..., source: ..., weight: ...}, ...]"


def _apply_override(raw: dict[str, Any], item: str, errors: list[str]) -> None:
    """Set one dotted key in the raw tree. `data.sources[0].weight=3` reaches into an entry of
    a list key; a step that cannot be taken is one error naming the key and the form that works."""
    key, value = parse_override(item)
    parts = key.split(".")
    node: Any = raw
    cls: Any = Config  # the schema of `node`; None below a key it does not know (_build says so)
    for i in range(len(parts)):
        step = _override_step(node, cls, parts, i, item.partition("=")[2])
        if isinstance(step, str):
            errors.append(step)
            return
        holder, name, cls = step
        if i == len(parts) - 1:
            holder[name] = value
            return
        node = holder.setdefault(name, {}) if isinstance(holder, dict) else holder[name]
        if not isinstance(node, dict):
            at = ".".join(parts[: i + 1])
            errors.append(f"{at}: is a value, not a section; cannot set {key}")
            return


def _override_step(
    node: dict[str, Any], cls: Any, parts: list[str], i: int, text: str
) -> tuple[Any, Any, Any] | str:
    """Where parts[i] of an override lives: (the dict or list holding it, its key or index, the
    schema below it), or the message that says why it cannot be set."""
    part, key, at = parts[i], ".".join(parts), ".".join(parts[: i + 1])
    if cls is None:
        return node, part, None  # below an unknown key, which _build names
    hints = typing.get_type_hints(cls)
    indexed = INDEXED.fullmatch(part)
    name = indexed.group(1) if indexed else part
    if not indexed and ("[" in part or "]" in part):
        fixed = ".".join([*parts[:i], part.split("[")[0] + "[0]", *parts[i + 1 :]])
        return (
            f"{key}: {part!r} is not KEY[INDEX]; an index is a whole number from 0, e.g. "
            f"--set '{fixed}={text}'"
        )
    if name not in hints:
        if not indexed:
            return node, part, None  # (_build names the unknown key, with a did-you-mean)
        prefix = at[: len(at) - len(part)]
        return _unknown_key_message(prefix + name, name, list(hints), prefix)
    tp = hints[name]
    if typing.get_origin(tp) is not list:
        if indexed:
            plain = ".".join([*parts[:i], name, *parts[i + 1 :]])
            return (
                f"{key}: {at[: -len(part)]}{name} is not a list, so it takes no [index]; "
                f"--set {plain}={text}"
            )
        return node, name, tp if dataclasses.is_dataclass(tp) else None
    entry = typing.get_args(tp)[0]
    if indexed:
        listed = at[: -len(part)] + name
        return _list_entry(node.get(name), int(indexed.group(2)), key, listed, entry)
    if i + 1 < len(parts):
        return _list_step_problem(key, at, parts[i + 1 :], text)
    return node, name, None


def _list_step_problem(key: str, listed: str, after: list[str], text: str) -> str:
    """`data.sources.0.weight` or `data.sources.weight`: an entry's index goes in brackets."""
    if after[0].isdigit():
        fixed = ".".join([f"{listed}[{after[0]}]", *after[1:]])
        return f"{key}: an entry of a list is written {listed}[{after[0]}]; --set '{fixed}={text}'"
    fixed = ".".join([f"{listed}[0]", *after])
    return (
        f"{key}: {listed} is a list of entries; set a key of one entry by its index from 0 "
        f"(--set '{fixed}={text}'), or give the whole list (--set '{listed}={WHOLE_LIST}')"
    )


def _list_entry(
    entries: Any, index: int, key: str, listed: str, entry: Any
) -> tuple[list[Any], int, Any] | str:
    """Entry `index` of the list `listed` as the config so far holds it: (the list, the index,
    the entries' schema), or why there is no such entry."""
    count = len(entries) if isinstance(entries, list) else 0
    if index < count:
        return entries, index, entry
    if count == 0:
        return (
            f"{key}: {listed} has no entries in this config; give the whole list first "
            f"(--set '{listed}={WHOLE_LIST}')"
        )
    held = f"{count} entr{'y' if count == 1 else 'ies'}, {listed}[0] to {listed}[{count - 1}]"
    return (
        f"{key}: {listed} has {held}; use one of those indices, or give the whole list "
        f"(--set '{listed}={WHOLE_LIST}')"
    )


# Keys that moved: old dotted key -> new dotted key. The old one is still read, with a note.
MOVED = {
    "model.activation_checkpointing": "activation_checkpointing.mode",
    "model.activation_checkpointing_k": "activation_checkpointing.k",
}


def _move_deprecated_keys(raw: dict[str, Any], errors: list[str]) -> None:
    """Rewrite moved keys to their new place, with one deprecation line each; a key given in
    both places is an error naming both."""
    for old, new in MOVED.items():
        old_section, old_key = old.split(".")
        new_section, new_key = new.split(".")
        section = raw.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        value = section.pop(old_key)
        target = raw.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # reported as a malformed section by _build
        if new_key in target:
            errors.append(
                f"{old}: moved to {new}, and both are set ({short(value)} and "
                f"{short(target[new_key])}); keep only {new}"
            )
            continue
        target[new_key] = value
        log.warning("config: %s is deprecated; use %s (read as %s=%s)", old, new, new, value)


def run_defining_keys(cls: type = None, prefix: str = "") -> list[str]:
    """Dotted keys marked `run_defining` in the schema: a checkpoint resumes only if they match."""
    cls = cls or Config
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(run_defining_keys(hints[f.name], f"{prefix}{f.name}."))
        elif f.metadata.get("run_defining"):
            out.append(f"{prefix}{f.name}")
    return out


def get_key(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


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


# Keys that hold a path. `~` in them is expanded once, as the config is loaded, so every reader
# (and the config.yaml written into the run dir) sees the path the run used.
PATH_KEYS = (
    "run.dir",
    "data.dir",
    "data.source",
    "data.tokenizer",
    "model.init_from",
    "checkpoint.resume",
    "eval.tasks_include_path",
)
NOT_PATHS = {"data.source": ("builtin",), "checkpoint.resume": ("auto", "never")}


def path_value(cfg: Config, key: str) -> str | None:
    """The file-system path a path key names, or None (unset, or a word such as `builtin`);
    `hf:PATH` names PATH."""
    value = get_key(cfg, key)
    if value is None or value in NOT_PATHS.get(key, ()):
        return None
    return value[3:] if key == "data.source" and value.startswith("hf:") else value


def expand_home(cfg: Config) -> Config:
    """`~` and `~user` at the start of a path key, expanded (os.path.expanduser)."""
    changes = {}
    for key in PATH_KEYS:
        path = path_value(cfg, key)
        if path is None or not path.startswith("~"):
            continue
        value = get_key(cfg, key)
        changes[key] = value[: len(value) - len(path)] + os.path.expanduser(path)
    return with_changes(cfg, changes) if changes else cfg


# ----------------------------------------------------------------------------- typing


def _build(cls: type, raw: Any, prefix: str, errors: list[str]) -> Any:
    """Instantiate dataclass `cls` from a raw mapping, recording every problem in `errors`."""
    if not isinstance(raw, dict):
        errors.append(f"{prefix.rstrip('.')}: expected a mapping of keys, got {short(raw)}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            errors.append(_unknown_key_message(dotted, str(key), list(fields), prefix))
            continue
        if value is None and fields[key].metadata.get("null_unsets"):
            continue  # unset: the default (over a base: file's value)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{dotted}.", errors)
        elif typing.get_origin(tp) is list:  # a list of entries, each a section (data.sources)
            entry = typing.get_args(tp)[0]
            if isinstance(value, list):
                kwargs[key] = [
                    _build(entry, v, f"{dotted}[{i}].", errors) for i, v in enumerate(value)
                ]
            else:
                errors.append(f"{dotted}: expected a list of mappings, got {short(value)}")
        else:
            ok, converted, expected = _coerce(value, tp)
            if ok:
                kwargs[key] = converted
            else:
                errors.append(f"{dotted}: expected {expected}, got {short(value)}")
    return cls(**kwargs)


def _coerce(value: Any, tp: Any) -> tuple[bool, Any, str]:
    """Check `value` against annotation `tp`: (ok, converted value, what was expected)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        choices = " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
        if any(type(a) is type(value) and a == value for a in args):  # (1 is not true)
            return True, value, f"one of {choices}"
        near = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        return False, value, f"one of {choices}{hint}"
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None:
            return True, None, ""
        ok, converted, expected = _coerce(value, inner[0])
        return ok, converted, f"{expected} or null"
    if tp is bool:
        return isinstance(value, bool), value, "true or false"
    if tp is int:
        if isinstance(value, bool):
            return False, value, "an integer"
        if isinstance(value, int):
            return True, value, "an integer"
        number = _as_float(value)
        if number is not None and number.is_integer():
            return True, int(number), "an integer"
        return False, value, "an integer"
    if tp is float:
        number = None if isinstance(value, bool) else _as_float(value)
        if number is not None and math.isfinite(number):
            return True, number, "a number"
        return False, value, "a finite number"
    if tp is str:
        return isinstance(value, str), value, "a string"
    if tp is dict:
        return isinstance(value, dict), value, "a mapping"
    raise TypeError(f"unsupported config annotation {tp!r}")


def _as_float(value: Any) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # PyYAML reads 3e-4 (no dot) as a string
        try:
            return float(value.replace("_", ""))
        except ValueError:
            return None
    return None


def _unknown_key_message(dotted: str, key: str, names: list[str], prefix: str) -> str:
    kind = "key" if prefix else "section"
    near = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if near:
        return f"{dotted}: unknown {kind}; did you mean {prefix}{near[0]}?"
    elsewhere = [p for p in all_keys() if p.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"{dotted}: unknown {kind} here; it lives at {elsewhere[0]}"
    return f"{dotted}: unknown {kind}; valid {kind}s here: {', '.join(names)}"


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the config tree, e.g. ['run.name', ..., 'parallel.backend']."""
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(all_keys(tp, f"{prefix}{f.name}."))
        else:
            out.append(f"{prefix}{f.name}")
    return out


# ----------------------------------------------------------------------------- validation

MAX_LAYERS = 10_000  # far past any trained model, short of a build that never ends


def validate(cfg: Config) -> list[str]:
    """Values and combinations that type checks cannot catch; each message names key and fix."""
    e: list[str] = []
    m, t = cfg.model, cfg.train

    def positive(key: str, value: float) -> None:
        if value <= 0:
            e.append(f"{key}={value} must be > 0")

    def non_negative(key: str, value: float) -> None:
        if value < 0:
            e.append(f"{key}={value} must be >= 0")

    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len"):
        positive(f"model.{key}", getattr(m, key))
    if m.n_layers > MAX_LAYERS:  # the estimate and the model build walk every block
        e.append(
            f"model.n_layers={m.n_layers}: at most {MAX_LAYERS:,} blocks are accepted (the "
            f"deepest transformers trained have about 1,000); lower model.n_layers"
        )
    defaults = ModelConfig()
    for key in ("norm_eps", "rope_theta", "init_std"):  # 0 or less: NaN or an error in step 1
        if getattr(m, key) <= 0:
            e.append(
                f"model.{key}={getattr(m, key)} must be > 0 (the default is "
                f"{getattr(defaults, key)})"
            )
    for key in ("micro_batch_size", "grad_accum", "max_steps"):
        positive(f"train.{key}", getattr(t, key))
    positive("train.lr", t.lr)
    positive("train.max_bad_steps", t.max_bad_steps)
    if t.gc_every < 0:
        e.append(f"train.gc_every={t.gc_every} must be >= 0 (0: Python's automatic collection)")
    if t.exit_at_step is not None:
        positive("train.exit_at_step", t.exit_at_step)
    if t.global_batch_size is not None:
        positive("train.global_batch_size", t.global_batch_size)
    e.extend(validate_data(cfg.data))
    e.extend(validate_profile(t.profile, t.max_steps))
    positive("logging.every", cfg.logging.every)
    if cfg.logging.peak_tflops is not None and cfg.logging.peak_tflops <= 0:
        e.append(
            f"logging.peak_tflops={cfg.logging.peak_tflops} must be > 0 (the device's dense "
            f"peak TFLOP/s), or null"
        )
    positive("eval.sample_tokens", cfg.eval.sample_tokens)
    e.extend(eval_tasks_problems(cfg))
    positive("checkpoint.keep_last", cfg.checkpoint.keep_last)
    for key, value in (
        ("train.min_lr", t.min_lr),
        ("train.warmup_steps", t.warmup_steps),
        ("train.weight_decay", t.weight_decay),
        ("train.grad_clip", t.grad_clip),
        ("train.eps", t.eps),
        ("eval.every", cfg.eval.every),
        ("eval.steps", cfg.eval.steps),
        ("eval.sample_every", cfg.eval.sample_every),
        ("checkpoint.every", cfg.checkpoint.every),
    ):
        non_negative(key, value)
    if m.d_model > 0 and m.n_heads > 0 and m.d_model % m.n_heads:
        e.append(
            f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; "
            f"{_head_fix(m)}"
        )
    elif m.d_model > 0 and m.n_heads > 0 and (m.d_model // m.n_heads) % 2:
        e.append(
            f"model.d_model / model.n_heads = {m.d_model // m.n_heads} must be even for "
            f"rotary embeddings; {_head_fix(m)}"
        )
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        kv = [d for d in range(1, m.n_heads + 1) if m.n_heads % d == 0][-6:]
        example = (  # (none while n_heads itself is refused above)
            f" (e.g. model.n_kv_heads={kv[-2] if len(kv) > 1 else kv[0]}, among "
            f"{', '.join(map(str, kv))})"
            if kv
            else ""
        )
        e.append(
            f"model.n_kv_heads={m.n_kv_heads} must be > 0 and divide model.n_heads="
            f"{m.n_heads}{example}; use null for plain multi-head attention"
        )
    e.extend(validate_activation_checkpointing(cfg.activation_checkpointing))
    if m.init_from is not None and not m.init_from.strip():
        e.append("model.init_from is empty; give a Hugging Face model folder, or null")
    if m.mlp_hidden is not None and m.mlp_hidden <= 0:
        e.append(f"model.mlp_hidden={m.mlp_hidden} must be > 0, or null for the default")
    if not 0.0 < t.decay_fraction <= 1.0:
        e.append(
            f"train.decay_fraction={t.decay_fraction} must lie in (0, 1] (the share of "
            f"max_steps that train.lr_schedule=wsd spends decaying; e.g. "
            f"train.decay_fraction=0.2)"
        )
    if t.min_lr > t.lr:
        e.append(
            f"train.min_lr={t.min_lr} is above train.lr={t.lr}; set min_lr <= lr, e.g. "
            f"train.min_lr={t.lr / 10:g}"
        )
    if not 0.0 <= t.beta1 < 1.0 or not 0.0 <= t.beta2 < 1.0:
        e.append(f"train.beta1={t.beta1} / train.beta2={t.beta2} must lie in [0, 1)")
    if not 0 <= cfg.run.seed < 2**63:
        e.append(
            f"run.seed={cfg.run.seed} must be an integer in [0, 2**63) (torch and numpy seed "
            f"from it); e.g. run.seed=1337"
        )
    name = cfg.run.name or ""
    if (
        name in ("", ".", "..")
        or name.startswith("-")
        or any(c in "/\\" or ord(c) < 32 for c in name)
    ):
        e.append(
            f"run.name={name[:60]!r} must be a plain name (no path separators, not . or .., "
            f"not starting with '-'); put the parent folder in run.dir"
        )
    else:
        e.extend(path_problems(cfg))
    e.extend(validate_parallel(cfg))
    return e


# Room left for what a command writes below its folder: the run dir's deepest files (e.g.
# checkpoints/.step_00000001.tmp-PID-RANDOM/__0_0.distcp, tensorboard/events.out.tfevents.
# TIME.HOST.PID.N with a host name of up to 64 bytes), data.dir's (.prepare-build/...).
PATH_ROOM = 256
NAME_MAX, PATH_MAX = 255, 4096  # Linux's, where the file system cannot be asked


def _limit(path: str, name: str, default: int) -> int:
    """os.pathconf's limit `name` on the file system `path` would be on (its deepest
    existing folder), or `default` where that cannot be asked."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing) and existing != os.path.dirname(existing):
        existing = os.path.dirname(existing)
    try:
        return os.pathconf(existing, name)
    except (OSError, ValueError):
        return default


def path_problems(cfg: Config) -> list[str]:
    """Paths the file system cannot hold (a NUL character, a name over its NAME_MAX bytes, a
    run dir or data dir whose files would pass PATH_MAX), found here instead of as an OSError
    deep inside a save. Names are counted in bytes, as the file system counts them."""
    e: list[str] = []
    paths = {key: path_value(cfg, key) for key in PATH_KEYS}
    paths["run.name"] = cfg.run.name
    for key, path in paths.items():
        if path is None:
            continue
        try:
            encoded = os.fsencode(path)
        except UnicodeEncodeError:
            e.append(f"{key}={short(path)} cannot be written as a file name (not UTF-8); rename")
            continue
        if b"\0" in encoded:
            e.append(
                f"{key}={short(path)} holds a NUL character, which no file name can; remove it"
            )
            continue
        where = cfg.run.dir if key == "run.name" else path
        most = _limit(where, "PC_NAME_MAX", NAME_MAX)
        for part in Path(path).parts:
            if len(os.fsencode(part)) > most:
                e.append(
                    f"{key}: the name {short(part, 40)} is {len(os.fsencode(part)):,} bytes, over "
                    f"the {most} bytes a file name may have on this file system; shorten it"
                )
                break
    if e:
        return e
    for key, path in (("run.dir / run.name", str(cfg.run_dir)), ("data.dir", cfg.data.dir)):
        full = len(os.fsencode(os.path.abspath(path)))
        most = _limit(path, "PC_PATH_MAX", PATH_MAX)
        if full + PATH_ROOM > most:
            e.append(
                f"{key}: the folder {short(os.path.abspath(path), 60)} is {full:,} bytes long, "
                f"and with the {PATH_ROOM} bytes its files add the paths would pass the "
                f"{most}-byte limit of this file system; use a shorter {key}"
            )
    return e


def eval_tasks_problems(cfg: Config) -> list[str]:
    """eval.tasks' keys, and the backends that can run them (lm-eval reads a whole model)."""
    ev, e = cfg.eval, []
    if ev.tasks_every < 0:
        e.append(f"eval.tasks_every={ev.tasks_every} must be >= 0 (0: the last step only)")
    if ev.tasks_limit is not None and ev.tasks_limit <= 0:
        e.append(f"eval.tasks_limit={ev.tasks_limit} must be > 0, or null for every example")
    if ev.tasks is not None and not any(t.strip() for t in ev.tasks.split(",")):
        e.append(f"eval.tasks={ev.tasks!r} names no task; give task names, or null")
    if ev.tasks and cfg.parallel.backend == "deepspeed":
        e.append(
            "eval.tasks with parallel.backend=deepspeed: not supported (the DeepSpeed engine "
            "gives no whole-model view to evaluate while it trains); evaluate its checkpoints "
            "after training with `scale-llm eval RUN_DIR --tasks ...`, or train with ddp or fsdp"
        )
    return e


MAX_HEADS = 4096  # far past any model's head count: the search stays short for any d_model


def _head_fix(m: ModelConfig) -> str:
    """Values of model.n_heads that pass every rule with this d_model (they divide it, leave an
    even head size for rotary embeddings, and are divisible by n_kv_heads when it is set), or,
    where none does, the nearest d_model that works with this n_heads."""
    kv = m.n_kv_heads if m.n_kv_heads and m.n_kv_heads > 0 else 1
    heads = [
        h
        for h in range(kv, min(m.d_model // 2, MAX_HEADS) + 1, kv)
        if m.d_model % h == 0 and (m.d_model // h) % 2 == 0
    ]
    if heads:
        near = sorted(sorted(heads, key=lambda h: abs(h - m.n_heads))[:8])
        best = min(near, key=lambda h: (abs(h - m.n_heads), h))
        return f"pick n_heads among {', '.join(map(str, near))}, e.g. model.n_heads={best}"
    step = 2 * m.n_heads  # head size even: d_model a multiple of 2 x n_heads
    up = -(-m.d_model // step) * step
    kv_set = f" and model.n_kv_heads={m.n_kv_heads}" if m.n_kv_heads else ""
    return (
        f"no n_heads works with model.d_model={m.d_model}{kv_set}: make d_model a multiple of "
        f"2 x n_heads, e.g. model.d_model={up}"
    )


def format_errors(errors: list[str], where: str) -> str:
    head = f"{len(errors)} problem{'s' if len(errors) > 1 else ''} in the config ({where}):"
    return "\n".join([head] + [f"  - {msg}" for msg in errors])


# ----------------------------------------------------------------------------- output


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    """The config as YAML; a mixture's without the keys of one source (data.source, ...), which
    its entries hold and which a mixture leaves at their defaults."""
    tree = to_dict(cfg)
    if cfg.data.sources:
        for key in PER_SOURCE_KEYS:
            del tree["data"][key]
    return yaml.safe_dump(tree, sort_keys=False, default_flow_style=False)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the config (as the user set it: `auto` stays `auto`; the resolved values go to
    plan.json) atomically; feeding it back to `train` reproduces the run."""
    from scale_llm.files import atomic_write_text

    atomic_write_text(
        path,
        "# scale_llm config as given (defaults filled in); plan.json beside it holds what `auto`\n"
        "# resolved to; `scale-llm train` accepts this file as is\n" + dump_yaml(cfg),
    )
