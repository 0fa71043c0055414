"""Values and combinations of a config that typing cannot catch, each message naming the key
and the fix."""

from __future__ import annotations

import os
from pathlib import Path

from scale_llm.config.data import validate_data
from scale_llm.config.fp8 import validate_fp8
from scale_llm.config.parallel import validate_parallel
from scale_llm.config.profile import validate_profile
from scale_llm.config.schema import bound_problems
from scale_llm.config.sections import Config, ModelConfig, get_key, kv_heads, mlp_hidden_size
from scale_llm.errors import short

PATH_KEYS = tuple(
    "run.dir data.dir data.source data.tokenizer model.init_from checkpoint.resume "
    "eval.tasks_include_path train.profile.folder".split()
)
NOT_PATHS = {"data.source": ("builtin",), "checkpoint.resume": ("auto", "never")}


def path_value(cfg: Config, key: str) -> str | None:
    """The path a path key names (`hf:PATH`: PATH), or None (unset, or a word: `builtin`)."""
    value = get_key(cfg, key)
    if value is None or value in NOT_PATHS.get(key, ()):
        return None
    return value[3:] if key == "data.source" and value.startswith("hf:") else value


MAX_LAYERS = 10_000  # far past any trained model, short of a build that never ends
MAX_SIZE = 1 << 26  # a width, length or count far past any trained model's, short of overflow
# steps, batches read ahead, tokens a sample generates: far past any run's, short of overflow
LOOP_BOUNDS = {"train.max_steps": 10**12, "data.prefetch": 1024, "eval.sample_tokens": 10**6}
LOOP_BOUNDS["parallel.ddp.bucket_cap_mb"] = 2**20  # (1 TiB; torch's DDP refused 2^62 once built)
SIZE_KEYS = (
    *("model.vocab_size", "model.d_model", "model.n_heads", "model.seq_len", "model.mlp_hidden"),
    *("train.micro_batch_size", "train.grad_accum", "train.global_batch_size"),
)


def validate(cfg: Config) -> list[str]:
    """Values and combinations that type checks cannot catch; each message names key and fix."""
    m, t = cfg.model, cfg.train
    e = bound_problems(m, "vocab_size d_model n_layers n_heads", prefix="model.")
    e += bound_problems(
        m, "seq_len", ">= 2 (a window predicts each token after its first)", "model."
    )
    if m.n_layers > MAX_LAYERS:  # the estimate and the model build walk every block
        e.append(
            f"model.n_layers={m.n_layers}: at most {MAX_LAYERS:,} blocks are accepted (the "
            f"deepest transformers trained have about 1,000); lower model.n_layers"
        )
    for key in SIZE_KEYS:  # (the estimate, the roofline and the build count in int64)
        if (value := get_key(cfg, key)) is not None and value > MAX_SIZE:
            e.append(
                f"{key}={short(value, 30)}: at most {MAX_SIZE:,} is accepted (far past any "
                f"trained model's, short of the counts that overflow); lower it"
            )
    for key, most in LOOP_BOUNDS.items():  # (a traceback in the loader, or a loop for ever)
        if (value := get_key(cfg, key)) is not None and value > most:
            e.append(f"{key}={short(value, 30)}: at most {most:,} is accepted; lower it")
    if m.seq_len * t.micro_batch_size > MAX_SIZE << 8:
        e.append(
            f"train.micro_batch_size x model.seq_len = {m.seq_len * t.micro_batch_size:,} tokens "
            f"a micro-batch: at most {MAX_SIZE << 8:,} are accepted; lower either"
        )
    for key in ("norm_eps", "rope_theta", "init_std"):  # 0 or less: NaN or an error in step 1
        e += bound_problems(m, key, f"> 0 (the default is {getattr(ModelConfig, key)})", "model.")
    e += bound_problems(cfg, "train.micro_batch_size train.grad_accum train.max_steps train.lr")
    e += bound_problems(cfg, "train.max_bad_steps")
    e += bound_problems(cfg, "train.gc_every", ">= 0 (0: Python's automatic collection)")
    e += bound_problems(cfg, "train.exit_at_step train.global_batch_size")
    e += [*validate_data(cfg.data), *validate_profile(t.profile, t.max_steps)]
    e += [*validate_fp8(t.fp8), *bound_problems(cfg, "logging.every")]
    peak = "> 0 (the device's dense peak TFLOP/s), or null"
    e += bound_problems(cfg, "logging.peak_tflops", peak)
    e += [*bound_problems(cfg, "eval.sample_tokens"), *eval_tasks_problems(cfg)]
    e += bound_problems(cfg, "checkpoint.keep_last")
    e += bound_problems(t, "min_lr warmup_steps weight_decay grad_clip eps", ">= 0", "train.")
    e += bound_problems(cfg, "eval.every eval.steps eval.sample_every checkpoint.every", ">= 0")
    if m.d_model > 0 and m.n_heads > 0 and m.d_model % (2 * m.n_heads):  # (whole, even heads)
        problem = f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}"
        if m.d_model % m.n_heads == 0:
            head = m.d_model // m.n_heads
            problem = f"model.d_model / model.n_heads = {head} must be even for rotary embeddings"
        e.append(f"{problem}; {_head_fix(m)}")
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        kv = [d for d in range(1, m.n_heads + 1) if m.n_heads % d == 0][-6:]
        example = (  # (the second largest; none while n_heads itself is refused above)
            f" (e.g. model.n_kv_heads={kv[-2:][0]}, among {', '.join(map(str, kv))})" if kv else ""
        )
        e.append(
            f"model.n_kv_heads={m.n_kv_heads} must be > 0 and divide model.n_heads="
            f"{m.n_heads}{example}; use null for plain multi-head attention"
        )
    e += bound_problems(cfg, "activation_checkpointing.k", ">= 1")
    if m.init_from is not None and not m.init_from.strip():
        e.append("model.init_from is empty; give a Hugging Face model folder, or null")
    e += bound_problems(cfg, "model.mlp_hidden", "> 0, or null for the default")
    if not 0.0 < t.decay_fraction <= 1.0:
        e.append(
            f"train.decay_fraction={t.decay_fraction} must lie in (0, 1] (the share of max_steps "
            f"that train.lr_schedule=wsd spends decaying; e.g. train.decay_fraction=0.2)"
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
    if name in ("", ".", "..") or name[0] == "-" or any(c in "/\\" or ord(c) < 32 for c in name):
        e.append(
            f"run.name={name[:60]!r} must be a plain name (no path separators, not . or .., "
            f"not starting with '-'); put the parent folder in run.dir"
        )
    else:
        e.extend(path_problems(cfg))
    return [*e, *validate_parallel(cfg), *tensor_parallel_problems(cfg)]


def tensor_parallel_problems(cfg: Config) -> list[str]:
    """parallel.tensor_parallel against the backend and the model's widths: every rank must hold
    whole heads (q and kv), an equal part of the SwiGLU width and of the vocabulary, and with
    sequence parallelism an equal part of the sequence."""
    tp, backend, m = cfg.parallel.tensor_parallel, cfg.parallel.backend, cfg.model
    if tp < 1:
        return [f"parallel.tensor_parallel={tp} must be >= 1 (1: no tensor parallelism)"]
    if tp == 1:
        return []
    e = []
    if backend != "fsdp":
        e.append(
            f"parallel.tensor_parallel={tp} needs parallel.backend=fsdp (it is {backend}): "
            f"tensor parallelism splits layers with DTensor and composes with FSDP2 over the "
            f"remaining ranks (tensor_parallel = world size: tensor parallelism alone); set "
            f"parallel.backend=fsdp, or parallel.tensor_parallel=1"
        )
    kv = kv_heads(m)
    widths = [
        ("model.n_heads", m.n_heads, "query heads"),
        *([("model.n_kv_heads", kv, "key/value heads")] if m.n_kv_heads else []),
        ("model.mlp_hidden", mlp_hidden_size(m), "SwiGLU width"),
        ("model.vocab_size", m.vocab_size, "vocabulary rows"),
    ]
    if cfg.parallel.sequence_parallel:
        widths.append(("model.seq_len", m.seq_len, "sequence positions"))
    for key, value, what in widths:
        if value > 0 and value % tp:
            near = sorted({tp * max(1, value // tp), tp * (value // tp + 1)})
            if what == "query heads":  # whole heads of an even width (RoPE), kv heads a divisor
                near = [n for n in near if m.d_model % n == 0 and m.d_model // n % 2 == 0]
                near = [n for n in near if n % kv == 0] if m.n_kv_heads else near
            elif what == "key/value heads":
                near = [n for n in near if m.n_heads % n == 0]
            ks = range(2, min(tp, value) + 1)  # (a divisor of value is at most value)
            fits = [f"parallel.tensor_parallel={k}" for k in ks if value % k == 0]
            fix = " or ".join([f"{key}={n}" for n in near] + fits[-1:])
            e.append(
                f"{key}={value} is not divisible by parallel.tensor_parallel={tp} (each rank "
                f"holds an equal part of the {what}): "
                + (fix or f"a {what[:-1]} count divisible by {tp}")
                + (" (sequence_parallel=false lifts this one)" if key == "model.seq_len" else "")
            )
    return e


# Room left for what a command writes below its folder: the run dir's deepest files (e.g.
# checkpoints/.step_00000001.tmp-PID-RANDOM/__0_0.distcp, tensorboard/events.out.tfevents.
# TIME.HOST.PID.N with a host name of up to 64 bytes), data.dir's (.prepare-build/...).
PATH_ROOM = 256
NAME_MAX, PATH_MAX = 255, 4096  # Linux's, where the file system cannot be asked


def _limit(path: str, name: str, default: int) -> int:
    """os.pathconf's `name` for `path`'s deepest existing folder, or `default`."""
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
    paths = {**{key: path_value(cfg, key) for key in PATH_KEYS}, "run.name": cfg.run.name}
    for key, path in paths.items():
        if path is None:
            continue
        if not path.strip():  # (an unset shell variable: the working folder, or nothing at all)
            if key == "checkpoint.resume":
                e.append("checkpoint.resume is empty; give auto, never or a checkpoint folder")
            elif key in ("run.dir", "data.dir", "eval.tasks_include_path"):  # (the others: theirs)
                e.append(f"{key} is empty; give a path (. for the working folder), or leave it out")
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
        most = _limit(cfg.run.dir if key == "run.name" else path, "PC_NAME_MAX", NAME_MAX)
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
    ev = cfg.eval
    e = bound_problems(ev, "tasks_every", ">= 0 (0: the last step only)", "eval.")
    e += bound_problems(ev, "tasks_limit", "> 0, or null for every example", "eval.")
    if ev.tasks is not None and not any(t.strip() for t in ev.tasks.split(",")):
        e.append(f"eval.tasks={ev.tasks!r} names no task; give task names, or null")
    if ev.tasks and cfg.parallel.backend == "deepspeed":
        e.append(
            "eval.tasks with parallel.backend=deepspeed: not supported (the DeepSpeed engine "
            "gives no whole-model view to evaluate while it trains); evaluate its checkpoints "
            "after training with `scale-llm eval RUN_DIR --tasks ...`, or train with ddp or fsdp"
        )
    if ev.tasks and (pp := cfg.parallel.pipeline_parallel) > 1:
        e.append(
            f"eval.tasks={ev.tasks} with parallel.pipeline_parallel={pp}: lm-eval needs the whole "
            f"model in one process; run `scale-llm eval` on a checkpoint instead, or set "
            f"eval.tasks=null"
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
