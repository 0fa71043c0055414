"""`scale-llm` / `python -m scale_llm`: one command per job (`scale-llm COMMAND --help`).

A UserError prints one message and exits 2; anything else keeps its traceback: it is a bug to fix.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import json
import logging
import math
import os
import re
import select
import signal
import sys
from pathlib import Path

from scale_llm.config import Config, RunConfig, dump_yaml, load_config, with_changes
from scale_llm.config.parallel import ONE_PROCESS
from scale_llm.config.sections import measures_compiled
from scale_llm.errors import (
    Stopped,
    UserError,
    install_hint,
    stop_signals_raise,
    wrapped_interrupt,
)
from scale_llm.log import setup_logging
from scale_llm.version import __version__

log = logging.getLogger("scale_llm")
KEYS_EPILOG = (
    "every config key, with its type, default and meaning: scale-llm config --keys; the "
    "config a command would run with: scale-llm config CONFIG [--set ...]"
)


class HelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default where it has one (not `None` or `False`: an
    option without one says in its help what leaving it out means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        silent = default is None or default is False or default in ("", [], argparse.SUPPRESS)
        if "%(default)" in text or silent or not (action.option_strings or action.nargs == "?"):
            return text
        return f"{text} (default: %(default)s)"


def _command(sub, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand's parser: its summary both in `scale-llm --help` and atop its own help."""
    return sub.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter)


def _flag(p: argparse.ArgumentParser, name: str, help: str) -> None:
    p.add_argument(name, action="store_true", help=help)


def _add_set(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help
    )


def _add_config_args(p: argparse.ArgumentParser, training: bool = True) -> None:
    """CONFIG and --set (and with `training`, the seed's familiar flags as aliases of keys)."""
    p.epilog = KEYS_EPILOG
    p.add_argument("config", nargs="?", help="YAML config (default: the built-in tiny defaults)")
    over = "override any config key (scale-llm config --keys lists them), e.g. --set "
    over += "train.lr=3e-4 (repeatable; --train.lr 3e-4 and --train.lr=3e-4 work too)"
    _add_set(p, over)
    name = "alias of run.name: the run directory is <run.dir>/NAME, e.g. --run-name tiny-lr3e-4 "
    name += "for a new experiment beside a finished run (default: the config's run.name)"
    p.add_argument("--run-name", metavar="NAME", help=name)
    # the deepspeed launcher appends --local_rank=N; the rank is read from the environment
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    p.set_defaults(grad_accum=None, grad_checkpointing=False, amp=False, amp_dtype=None)
    p.set_defaults(batch_size=None, train_steps=None)
    if not training:
        return
    p.add_argument("--grad-accum", type=int, metavar="N", help="alias of train.grad_accum")
    _flag(p, "--grad-checkpointing", "alias of activation_checkpointing.mode=full")
    _flag(p, "--amp", "mixed precision (bf16 unless --amp-dtype)")
    amp_dtype = "alias of train.precision (fp16 adds a GradScaler)"
    p.add_argument("--amp-dtype", choices=["bf16", "fp16"], help=amp_dtype)
    for flag, key in (("batch_size", "micro_batch_size"), ("train_steps", "max_steps")):
        names = (f"--{flag}", f"--{flag.replace('_', '-')}")  # (dest: the first, flag)
        p.add_argument(*names, type=int, metavar="N", help=f"alias of train.{key}")


def alias_overrides(args: argparse.Namespace) -> list[str]:
    """The seed project's familiar flags as dotted overrides; explicit --set comes after them."""
    name = None if args.run_name is None else json.dumps(args.run_name)  # (2024 stays a string)
    aliases = [
        ("run.name", name),
        ("train.grad_accum", args.grad_accum),
        ("activation_checkpointing.mode", "full" if args.grad_checkpointing else None),
        ("train.precision", args.amp_dtype or ("bf16" if args.amp else None)),
        ("train.micro_batch_size", args.batch_size),
        ("train.max_steps", args.train_steps),
    ]
    return [f"{key}={value}" for key, value in aliases if value is not None] + list(args.overrides)


def config_from_args(args: argparse.Namespace) -> Config:
    return load_config(args.config, alias_overrides(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scale-llm", description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"scale_llm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for _, add_parser, _ in _COMMANDS:
        add_parser(sub)
    return parser


def _config_parser(sub) -> None:
    p = _command(sub, "config", "print the resolved config; --keys lists every key")
    _add_config_args(p, training=False)
    _flag(p, "--keys", "list every key with its type, default and meaning")
    _flag(p, "--markdown", "--keys as docs/config.md's generated tables")
    where = "where the shipped configs and launchers are (in a checkout or an installed wheel)"
    _flag(p, "--paths", where)
    preflight = "run train's preflight for this machine (data, run dir, resume, init_from, memory, "
    preflight += "toolchain, eval.tasks) and print its verdict; writes nothing"
    _flag(p, "--preflight", preflight)
    world = "--preflight as rank 0 of a launch of N processes (default: $WORLD_SIZE, else "
    world += "parallel.world_size, else 1)"
    p.add_argument("--world-size", type=int, metavar="N", help=world)


def cmd_config(args: argparse.Namespace) -> int:
    """The config as `train` would read it (YAML, defaults filled in), or the key reference."""
    keys = "--keys" if args.keys else "--markdown" if args.markdown else None
    listing = "--paths" if args.paths else keys
    read = {"CONFIG": args.config, "--set": alias_overrides(args), "--preflight": args.preflight}
    read["--world-size"] = args.world_size is not None
    if listing and (ignored := [name for name, given in read.items() if given]):
        raise UserError(
            f"{listing} reads no config, but {', '.join(ignored)} given; drop "
            f"{'it' if len(ignored) == 1 else 'them'}, or run `scale-llm config` without {listing}"
        )
    if args.paths:
        from scale_llm.config import shipped_config_dir

        here = Path(__file__).resolve().parent
        found = [d for d in (here / "launch", here.parent / "launch") if (d / "_env.sh").is_file()]
        print(f"configs: {shipped_config_dir()}\nlaunchers: {found[0] if found else None}")
        return 0
    if args.keys or args.markdown:
        from scale_llm.config.keys import markdown_keys, text_keys

        print(markdown_keys() if args.markdown else text_keys())
        return 0
    cfg = config_from_args(args)
    if args.world_size is not None and not args.preflight:
        raise UserError("--world-size: only with --preflight (the config holds no world size)")
    if not args.preflight:
        print(dump_yaml(cfg), end="")
        return 0
    from scale_llm.config.plan import Launch, resolve_plan
    from scale_llm.train.preflight import preflight

    # what `train` would find before any work, as rank 0 of its launch; the report if not
    world, _ = _target_world(args, lambda: (cfg.parallel.world_size or 1, None))
    spec = preflight(cfg, resolve_plan(cfg, Launch(world_size=world)))
    if spec.resume is None:
        start = "a fresh run" + (f" from {spec.init_from}" if spec.init_from else "")
    elif spec.complete:
        start = f"nothing to do: {spec.resume.checkpoint} is at train.max_steps"
    else:
        start = f"resumes {spec.resume.checkpoint} at step {spec.resume.step}"
    print(f"preflight: ok: {start}; run dir {cfg.run_dir}")
    return 0


BENCH_MB = 16.0  # prepare --bench's text


def _prepare_parser(sub) -> None:
    p = _command(sub, "prepare", "train the tokenizer and write token shards")
    _add_config_args(p, training=False)
    _flag(p, "--force", "rebuild even if up to date")
    bench = "only measure tokens/s of the pipeline vs a plain encode loop (writes nothing)"
    _flag(p, "--bench", bench)
    p.add_argument("--bench-mb", type=float, default=BENCH_MB, help="MB of text for --bench")
    as_train = "read every other argument as `train` would (its flags allowed and checked) and "
    as_train += "prepare that run's data: what the launchers run before training"
    _flag(p, "--as-train", as_train)


def cmd_prepare(args: argparse.Namespace) -> int:
    if args.bench_mb != BENCH_MB and not args.bench:
        raise UserError("--bench-mb: only with --bench (it sizes that measurement); add --bench")
    if args.bench and not (math.isfinite(args.bench_mb * 1e6) and args.bench_mb * 1e6 >= 1):
        raise UserError(
            f"--bench-mb {args.bench_mb}: use a number of megabytes of text to encode, "
            f"above 0 (e.g. --bench-mb 16)"
        )
    cfg = config_from_args(args)
    world = os.environ.get("SCALE_LLM_LAUNCH_WORLD", "")
    if args.as_train and world.isascii() and world.isdigit():
        from scale_llm.config.plan import Launch, resolve_plan

        resolve_plan(cfg, Launch(world_size=int(world)))  # the launcher's layout: before any work
    if args.bench:
        from scale_llm.data.prepare_bench import bench_prepare, format_report

        print(format_report(bench_prepare(cfg, args.bench_mb)))
    else:
        from scale_llm.components.checkpoint import refuse_inside_checkpoint
        from scale_llm.data.prepare import prepare
        from scale_llm.train.resume import kept_data

        refuse_inside_checkpoint(Path(cfg.data.dir), f"data.dir={cfg.data.dir}", "data.dir")
        # the launchers' prepare before `train` keeps the tokenizer the run resumes with
        prepare(cfg, force=args.force, keep=kept_data(cfg) if args.as_train else None)
    return 0


def _prints_data(args: argparse.Namespace) -> bool:
    """Whether the command's stdout is data (YAML, JSON, generated text, the runs table), which a
    log line would break: its log lines go to stderr."""
    if args.command in ("config", "generate", "runs"):
        return not getattr(args, "preflight", False)
    return bool(getattr(args, "json", False) or getattr(args, "checkpoint_io", None))


def start_distributed(args: argparse.Namespace):
    """Load the config and resolve the run plan (their checks first), then start the process
    group; what needs the data, the run dir or the other ranks is the preflight's."""
    from scale_llm.components.distributed import start
    from scale_llm.config.plan import launch_env, resolve_plan

    cfg = config_from_args(args)
    launch = launch_env()
    setup_logging(launch.rank, sys.stderr if _prints_data(args) else sys.stdout)
    plan = resolve_plan(cfg, launch)
    laid_out = cfg.parallel.world_size
    if plan.is_main and laid_out not in (None, plan.world_size):
        batch = f"the global batch stays; grad_accum is {plan.grad_accum}"
        if cfg.train.global_batch_size is None:  # (grad_accum is kept: the batch moves)
            batch = (
                f"the global batch is {plan.sequences_per_step} sequences, as the world sets it; "
                f"train.global_batch_size keeps one across world sizes"
            )
        log.warning(
            f"parallel.world_size={laid_out}: the config is laid out for {laid_out} ranks; this "
            f"launch has {plan.world_size} ({batch})"
        )
    if getattr(args, "fit", None) is not None and args.fit != "auto":
        from scale_llm.analysis.memory import parse_bytes

        parse_bytes(args.fit)  # a bad size is an error before any process group exists
    missing_packages(cfg, plan, args.command)
    trace = str(cfg.run_dir / "comm_trace" / "rank")  # (NCCL's flight recorder, on a timeout)
    start(plan, cpu_collectives=cfg.parallel.fsdp.cpu_offload, trace_prefix=trace)
    return cfg, plan


def missing_packages(cfg: Config, plan, command: str) -> None:
    """The optional packages this command needs for this config, checked before any work."""
    from scale_llm.components.hf_files import SAFETENSORS, SAFETENSORS_INDEX

    needs = []  # (the setting, the module it imports, how to get it)
    if plan.backend == "deepspeed":
        how = f"`{install_hint(packages=('deepspeed',))}` (launch/setup.sh installs it)"
        needs.append(("parallel.backend=deepspeed", "deepspeed", f"{how} or pick ddp or fsdp"))
    w, init, train = cfg.logging.wandb, cfg.model.init_from, command == "train"
    if train and w.project:
        how = f"`{install_hint('wandb')}` (or set logging.wandb.project=null)"
        needs.append((f"logging.wandb.project={w.project}", "wandb", how))
    if train and init and any((Path(init) / n).is_file() for n in (SAFETENSORS, SAFETENSORS_INDEX)):
        needs.append((f"model.init_from={init}", "safetensors", f"`{install_hint('hf')}`"))
    if train and cfg.eval.tasks:  # lm-eval reads an export of the weights
        how = f"`{install_hint('hf')}` (or set eval.tasks=null)"
        modules = ("lm_eval", "transformers", "accelerate", "safetensors", "tokenizers")
        needs += [(f"eval.tasks={cfg.eval.tasks}", module, how) for module in modules]
    if missing := [n for n in needs if importlib.util.find_spec(n[1]) is None]:
        raise UserError(
            "; ".join(f"{k} needs {m}, and {m} is not installed: {how}" for k, m, how in missing)
        )


def fit_at_launch(cfg: Config, plan, size: str):
    """`train --fit`: the fastest checkpointing / micro-batch layout that fits (the backend
    stays: its process group exists), applied to the config; prints the overrides."""
    import torch

    from scale_llm.analysis import memory
    from scale_llm.config.plan import launch_env, resolve_plan

    if size == "auto":
        if plan.device.type != "cuda":
            raise UserError(
                "train --fit auto reads the free memory of the GPU, and this run has none; give "
                "an explicit size, e.g. --fit 24GiB"
            )
        budget = int(torch.cuda.mem_get_info(plan.device)[0] * 0.95)  # keep 5% for the context
    else:
        budget = memory.parse_bytes(size)
    fitted = memory.fit(cfg, plan, budget, keep_backend=True)
    flags = memory.format_overrides(fitted.changes) or "no change needed"
    total = memory.gib(fitted.estimate.total)
    log.info(f"fit: {memory.gib(budget)} per GPU -> {flags} (predicted {total})")
    lay, ac = fitted.estimate.layout, fitted.estimate.ac
    chosen = {
        "train.micro_batch_size": lay.micro_batch,
        "train.grad_accum": lay.grad_accum,
        "train.global_batch_size": None,  # the same global batch, now spelled out
        "activation_checkpointing.mode": ac.mode,
        "activation_checkpointing.k": ac.k,
    }
    cfg = with_changes(cfg, chosen)
    return cfg, resolve_plan(cfg, launch_env())


def _train_parser(sub) -> None:
    p = _command(sub, "train", "train a model")
    _add_config_args(p)
    fit = "before training, choose micro-batch, grad_accum and checkpointing to fit SIZE per "
    fit += "GPU (e.g. 80GiB; auto: the GPU's free memory), keeping the global batch"
    p.add_argument("--fit", metavar="SIZE|auto", help=fit)
    _flag(p, "--report-memory", "print the predicted per-GPU memory before training")


def cmd_train(args: argparse.Namespace) -> int:
    cfg, plan = start_distributed(args)
    if args.fit:
        cfg, plan = fit_at_launch(cfg, plan, args.fit)
    if args.report_memory and plan.is_main:
        from scale_llm.analysis import memory

        est = memory.estimate(cfg, plan)
        log.info(memory.format_report(est, cfg, plan, args.config or "defaults"))
    from scale_llm.train.trainer import train

    r = train(cfg, plan)
    if r.losses:
        (s0, l0), (s1, l1) = next(iter(r.losses.items())), list(r.losses.items())[-1]
        val = list(r.val_losses.values())
        where = f" (steps {r.start_step + 1}-{r.steps})" if r.start_step else ""
        log.info(
            f"done: {r.steps - r.start_step} steps{where} in {r.seconds:.1f}s; {r.steps} of "
            f"{cfg.train.max_steps} in total; loss {l0:.3f} (step {s0}) -> {l1:.3f} (step {s1})"
            + (f"; val_loss {val[-1]:.3f}" if val else "")
            + f"; run dir {r.run_dir}"
        )
    return 0


def _estimate_parser(sub) -> None:
    p = _command(sub, "estimate", "predict per-GPU memory; --fit proposes settings")
    _add_config_args(p)
    world = "GPUs the run will use (default: $WORLD_SIZE; else the config's "
    world += "parallel.world_size, as the shipped multi-GPU configs set it; else 1)"
    p.add_argument("--world-size", type=int, metavar="N", help=world)
    _flag(p, "--json", "print one JSON object")
    p.add_argument("--fit", metavar="SIZE", help="memory per GPU to fit in, e.g. 80GiB")
    measure = "also count the activation bytes a CPU forward pass saves for backward, and "
    measure += "measure one whole optimizer step on the CPU by category (params, grads, optimizer, "
    measure += "activations, temporaries)"
    _flag(p, "--measure", measure)
    fake = "also trace one whole optimizer step at full size on fake tensors (no memory "
    fake += "used) for rank 0 of --world-size GPUs (under a pipeline: the first rank of "
    fake += "--pipeline-rank's stage), by category, next to the estimate"
    _flag(p, "--fake", fake)
    rank = "--fake under pipeline parallelism: trace pipeline rank R (default: the rank the "
    rank += "estimate names worst)"
    p.add_argument("--pipeline-rank", type=int, metavar="R", help=rank)


MAX_TARGET_WORLD = 1 << 20  # GPUs: far past any run's, short of counts that overflow


def _target_world(args: argparse.Namespace, default) -> tuple[int, str | None]:
    """The GPUs estimate and bench --roofline predict for, and a line saying why: --world-size,
    else $WORLD_SIZE under a launcher, else `default()`'s (world, line)."""
    if args.world_size is not None:
        world, given = args.world_size, f"--world-size {args.world_size}"
    elif "WORLD_SIZE" in os.environ:
        from scale_llm.config.plan import launch_env

        world = launch_env().world_size
        given = f"WORLD_SIZE={world} (in the environment)"
    else:
        return default()
    if not 1 <= world <= MAX_TARGET_WORLD:
        raise UserError(
            f"{given}: use the number of GPUs the run will use, >= 1 and at most "
            f"{MAX_TARGET_WORLD:,} (or leave --world-size out for $WORLD_SIZE, else the config's "
            f"own, else the default)"
        )
    return world, None


def cmd_estimate(args: argparse.Namespace) -> int:
    from scale_llm.analysis import memory
    from scale_llm.config.plan import launch_env, resolve_plan, target_plan

    cfg = config_from_args(args)
    world, note = _target_world(args, lambda: memory.world_for_estimate(cfg, args.config))
    budget = None if args.fit is None else memory.parse_bytes(args.fit)  # (before any work)
    if args.pipeline_rank is not None and not args.fake:
        raise UserError(
            f"--pipeline-rank {args.pipeline_rank} picks the pipeline rank that --fake traces; "
            f"add --fake, or leave --pipeline-rank out (the estimate reports every pipeline rank)"
        )
    if args.fake:  # a layout it cannot trace: refused before --measure's work
        from scale_llm.analysis.memory.fake import fake_plan

        fake_plan(cfg, world, args.pipeline_rank)
    plan = target_plan(cfg, world)
    fitted = None if budget is None else memory.fit(cfg, plan, budget)  # (before --measure's work)
    est = memory.estimate(cfg, plan)
    result = est.to_json()
    text = [note] if note else []
    text.append(memory.format_report(est, cfg, plan, args.config or "defaults"))
    if args.measure:  # builds the whole model on this host: refused first if it cannot fit
        from scale_llm.analysis.memory.measure import format_measurement, measure_step

        here = with_changes(cfg, {"train.device": "cpu", "train.compile": False})
        try:
            launched = resolve_plan(here, launch_env())
        except UserError as e:  # (the estimate alone plans the layout; --measure runs it)
            raise UserError(
                f"--measure runs the config's step in this process, as launched: {e}. Leave "
                f"--measure out (the estimate needs no launch), or run it under torchrun with "
                f"a world size the layout divides"
            ) from None
        memory.check_host_memory(here, launched)
        counted, predicted = memory.measure_activations(cfg, plan)
        saved = {"counted_saved_bytes": counted, "predicted_saved_bytes": predicted}
        result["measured_cpu"] = saved
        compiled = measures_compiled(cfg, plan.device.type)
        text.append(
            f"measured on CPU (micro-batch {plan.micro_batch_size}"
            + (", compiled blocks" if compiled else "")
            + f"): the forward pass saved {memory.gib(counted)} for backward; predicted "
            f"{memory.gib(predicted)} ({predicted / counted - 1:+.2%}"
            + ("; the prediction counts eager blocks, an upper bound" if compiled else "")
            + ")"
        )
        result["measured_step_cpu"] = step = measure_step(cfg)
        text.append(format_measurement(step))
    if args.fake:
        from scale_llm.analysis.memory.fake import format_trace, trace_step

        result["traced_step_fake"] = traced = trace_step(cfg, world, args.pipeline_rank)
        text.append(format_trace(traced))
    if fitted is not None:
        est, lay = fitted.estimate, fitted.estimate.layout
        gpu = {k: int(v) for k, v in est.gpu.items()}
        result["fit"] = {"budget": budget, "overrides": fitted.changes, "bytes_per_gpu": gpu}
        host = sum(est.cpu.values())  # (offload: what each rank holds in host memory)
        result["fit"]["host_bytes_per_rank"] = int(host)
        text.append(
            f"fits in {memory.gib(budget)}: total {memory.gib(est.total)} "
            f"({lay.describe()}, activation_checkpointing {est.ac.mode}, micro_batch "
            f"{lay.micro_batch} x grad_accum {lay.grad_accum})"
            + (f"; and {memory.gib(host)} of host memory per rank, offloaded" if host else "")
            + "\n  "
            + (memory.format_overrides(fitted.changes) or "(no change needed)")
        )
    print(json.dumps(result) if args.json else "\n".join(text))
    return 0


BENCH_COUNTS = {"steps": 10, "warmup": 3, "rounds": 5}  # bench's defaults (--roofline: untouched)
SWEEP_AXES = {"micro": "1,2,4,8", "ac": "none,selective,full", "compile": "false,true"}


def _bench_parser(sub) -> None:
    p = _command(sub, "bench", "training throughput on synthetic tokens (no data needed)")
    _add_config_args(p)
    p.add_argument("--steps", type=int, default=BENCH_COUNTS["steps"], help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=BENCH_COUNTS["warmup"], help="untimed steps first")
    reference = "time the framework's step against a bare PyTorch loop of the same model (bare, "
    reference += "what --reference alone means), of a GPT-2-style model of the same widths (gpt2), "
    reference += "or compiled against eager (eager), or, under torchrun, the step of every process "
    reference += "against one of them alone (scaling: weak-scaling efficiency); interleaved, best "
    reference += "of --rounds, with the median of the rounds' pairs"
    kinds = ["bare", "gpt2", "eager", "scaling"]
    p.add_argument("--reference", nargs="?", const="bare", choices=kinds, help=reference)
    rounds = "--reference: timed rounds of each"
    p.add_argument("--rounds", type=int, default=BENCH_COUNTS["rounds"], help=rounds)
    _flag(p, "--sweep", "a table over --sweep-micro x --sweep-ac x --sweep-compile (grad_accum 1)")
    axes = {"micro": "micro-batch sizes to sweep", "ac": "checkpointing modes"}
    for axis, help in (axes | {"compile": "compile settings"}).items():
        p.add_argument(f"--sweep-{axis}", default=SWEEP_AXES[axis], help=help)
    backends = "backends to sweep (default: the config's): single (one process), or under a "
    backends += "multi-process launch ddp, fsdp, fsdp-tpN (FSDP2 x tensor parallelism N), "
    backends += "zero0..zero3 (DeepSpeed), e.g. ddp,fsdp,fsdp-tp2,zero2"
    p.add_argument("--sweep-backend", help=backends)
    io = "time a checkpoint save (in the foreground, with and without its integrity "
    io += "record, and in the background as checkpoint.async_mode writes it: the time it holds "
    io += "the step), its record and its check, in a new folder inside DIR (removed afterwards; "
    io += "nothing else in DIR is touched)"
    p.add_argument("--checkpoint-io", metavar="DIR", help=io)
    roofline = "no run: count FLOPs and bytes of one step on the meta device, per op class"
    devices = ["H100-SXM", "H100-500W", "H200", "A100-80GB"]
    p.add_argument("--roofline", choices=devices, help=roofline)
    world = "--roofline: GPUs the run will use "
    world += "(default: $WORLD_SIZE, else parallel.world_size, else 2)"
    p.add_argument("--world-size", type=int, metavar="N", help=world)
    network = "--roofline: the link between nodes of 8 GPUs that collectives spanning nodes "
    network += "run on: ib-ndr (InfiniBand, 400 Gb/s per GPU; the default) or eth-100g "
    network += "(100 Gb/s per node)"
    p.add_argument("--network", choices=["ib-ndr", "eth-100g"], help=network)
    _flag(p, "--json", "print one JSON object")


def cmd_bench(args: argparse.Namespace) -> int:
    from scale_llm.analysis import bench as b
    from scale_llm.config.plan import launch_env, target_plan

    if args.roofline:
        from scale_llm.analysis.roofline import format_roofline, roofline

        given = {"--sweep": args.sweep, "--reference": args.reference}
        given |= {"--checkpoint-io": args.checkpoint_io, "--sweep-backend": args.sweep_backend}
        runs = [flag for flag, value in given.items() if value]
        runs += [f"--sweep-{a}" for a, d in SWEEP_AXES.items() if getattr(args, f"sweep_{a}") != d]
        runs += [
            f"--{key}" for key, default in BENCH_COUNTS.items() if getattr(args, key) != default
        ]
        if runs:  # (it would ignore them)
            raise UserError(
                f"{', '.join(runs)}: not with --roofline, which counts one step on paper and runs "
                f"nothing; leave them out, or drop --roofline to measure"
            )
        cfg = config_from_args(args)
        world, _ = _target_world(args, lambda: (cfg.parallel.world_size or 2, None))
        plan = target_plan(cfg, world)
        network = args.network or "ib-ndr"
        r = roofline(cfg, plan.micro_batch_size, plan.grad_accum, args.roofline, world, network)
        print(json.dumps(r) if args.json else format_roofline(r))
        return 0
    counts = [  # (flag, value, least, what it counts)
        ("--steps", args.steps, 1, "timed optimizer steps"),
        ("--warmup", args.warmup, 0, "untimed steps before them"),
        ("--rounds", args.rounds, 1, "timed rounds of --reference and --checkpoint-io"),
    ]
    bad = [f"{f} {n}: use a count >= {least} ({what})" for f, n, least, what in counts if n < least]
    if args.world_size is not None:
        bad.append("--world-size: only with --roofline (a run's world is its launcher's)")
    if args.network is not None:
        bad.append("--network: only with --roofline (a run goes over the network it has)")
    loose = [
        f"--sweep-{a}"
        for a, default in SWEEP_AXES.items()
        if getattr(args, f"sweep_{a}") != default
    ]
    if not args.sweep and (loose := loose + ["--sweep-backend"] * bool(args.sweep_backend)):
        bad.append(
            f"{', '.join(loose)}: only with --sweep (they set its table's axes); add --sweep"
        )
    if args.rounds != BENCH_COUNTS["rounds"] and not (args.reference or args.checkpoint_io):
        bad.append("--rounds: only with --reference or --checkpoint-io (it counts their rounds)")
    if bad:
        raise UserError("; ".join(bad))
    backends = [x.strip() for x in args.sweep_backend.split(",")] if args.sweep_backend else None
    if args.sweep:  # before any process group is started
        axes = b.sweep_axes(args.sweep_micro, args.sweep_ac, args.sweep_compile)
        for name in backends or []:
            b.backend_changes(name, launch_env().world_size)
    if args.checkpoint_io:
        from scale_llm.files import require_writable_dir

        require_writable_dir(args.checkpoint_io, "--checkpoint-io")
    cfg, plan = start_distributed(args)
    from scale_llm.train.preflight import settle_compile

    cfg = settle_compile(cfg, plan)  # (bench builds its models itself)
    if args.checkpoint_io:
        rows = b.bench_checkpoint(cfg, plan, Path(args.checkpoint_io), args.rounds)
        if plan.is_main:
            print("\n".join(json.dumps(r) for r in rows))
        return 0
    if args.sweep:
        rows = b.bench_sweep(cfg, plan, *axes, args.steps, args.warmup, backends)
        if plan.is_main:
            print("\n".join(json.dumps(r) for r in rows) if args.json else b.markdown_table(rows))
        return 0
    timing = (args.steps, args.warmup)
    if args.reference == "scaling":
        result = b.bench_scaling(cfg, plan, *timing, args.rounds)
    elif args.reference:
        result = b.bench_reference(cfg, plan, *timing, args.rounds, kind=args.reference)
    else:
        result = b.bench(cfg, plan, *timing)
    if plan.is_main and args.json:
        print(json.dumps(result))
    elif plan.is_main:
        width = max(map(len, result))
        for key, value in result.items():
            shown = f"{value:,.4g}" if isinstance(value, float) else value
            print(f"{key:>{width}}: {shown}")
    return 0


def _check_parser(sub) -> None:
    summary = "the first run on a new machine: curves, sweep, reference (a report)"
    p = _command(sub, "check", summary)
    p.add_argument("out", nargs="?", default="check", help="directory for report.json / .md")
    p.add_argument("--steps", type=int, default=8, help="steps of each tiny.yaml curve")
    over = "override a config key of every run the check makes, e.g. --set "
    over += "train.micro_batch_size=4 (repeatable; scale-llm config --keys lists the keys)"
    _add_set(p, over)
    scratch = "where the check's data and runs go, a folder of this user's (default: "
    scratch += "TMPDIR/scale-llm-check-UID, reused)"
    p.add_argument("--scratch", help=scratch)
    budget = "start no item after this many minutes (the report says which were skipped); "
    budget += "default: no limit"
    p.add_argument("--budget-min", type=float, metavar="MINUTES", help=budget)
    only = "a comma list of curves, sweep, reference, param_dtype, scaling (default: all)"
    p.add_argument("--only", metavar="SECTIONS", help=only)


def cmd_check(args: argparse.Namespace) -> int:
    from scale_llm.analysis.check import SECTIONS, run_check
    from scale_llm.config.load import override_setting

    if args.budget_min is not None and not (math.isfinite(args.budget_min) and args.budget_min > 0):
        raise UserError(
            f"--budget-min {args.budget_min}: use the minutes after which the check starts no "
            f"item, above 0 (or leave it out for no limit)"
        )
    if given := override_setting(args.overrides or [], "train.max_steps"):
        raise UserError(f"--set {given}: the check's runs take --steps N; give that instead")
    scratch = Path(args.scratch) if args.scratch else None
    only = None if args.only is None else {x.strip() for x in args.only.split(",")}
    if args.steps < 1 or (args.steps == 1 and (only is None or "curves" in only)):
        raise UserError(
            f"--steps {args.steps}: the check's runs take 1 step or more, the curves 2 or more "
            f"(each must fall from its first loss to its last), e.g. --steps 8"
        )
    if only is not None and not only <= SECTIONS:
        raise UserError(
            f"--only {','.join(sorted(only - SECTIONS))}: not a section of the check; use "
            f"{', '.join(sorted(SECTIONS))}"
        )
    report = run_check(Path(args.out), args.steps, args.overrides, scratch, args.budget_min, only)
    print((Path(args.out) / "report.md").read_text())
    return 0 if report["ok"] else 1


def _convert_parser(sub) -> None:
    p = _command(sub, "convert", "write a checkpoint as one consolidated fp32 file")
    p.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest)")
    p.add_argument("--out", required=True, help="the file to write, e.g. model.pt")
    _flag(p, "--force", "replace --out if an earlier convert wrote it")


def cmd_convert(args: argparse.Namespace) -> int:
    from scale_llm.train.convert import convert

    path, n_params = convert(args.checkpoint, args.out, args.force)
    print(f"wrote {path}: {n_params / 1e6:.2f}M parameters (fp32) and the run's config")
    return 0


def _export_parser(sub) -> None:
    p = _command(sub, "export", "write a checkpoint as a Hugging Face Llama folder")
    p.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest)")
    p.add_argument("--out", required=True, help="the folder to write, e.g. exports/tiny")
    p.add_argument("--format", choices=["hf"], default="hf", help="hf: transformers / vLLM")
    dtype = "weights dtype (default: bf16 for runs trained in bf16/fp16, fp32 otherwise)"
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help=dtype)
    shard = "split the weights into files of at most SIZE, with an index"
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help=shard)
    _flag(p, "--force", "replace --out if it is an earlier export")


def cmd_export(args: argparse.Namespace) -> int:
    from scale_llm.analysis.memory import parse_bytes
    from scale_llm.export import export

    try:
        shard = parse_bytes(args.max_shard_size, bare=True)
    except UserError:
        shard = 0
    if shard < 1:
        raise UserError(
            f"--max-shard-size {args.max_shard_size!r}: write a plain number above 0 and one "
            f"of the units B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of "
            f"1024), e.g. --max-shard-size 5GB"
        )
    done = export(args.checkpoint, args.out, args.dtype, shard, args.force)
    print(
        f"wrote {done.out}: {done.n_params / 1e6:.2f}M parameters in {done.dtype} from step "
        f"{done.step} ({', '.join(done.files)}); load it with "
        f"transformers.AutoModelForCausalLM.from_pretrained({str(done.out)!r})"
    )
    return 0


def _eval_parser(sub) -> None:
    p = _command(sub, "eval", "lm-evaluation-harness tasks and held-out perplexity")
    p.add_argument("run_dir", help="a run directory; its newest good checkpoint is evaluated")
    p.add_argument("--tasks", metavar="T1,T2", help="lm-eval task names")
    p.add_argument("--include-path", metavar="DIR", help="a folder of extra task YAMLs")
    limit = "at most N examples per task (and N validation windows for --perplexity); default: all"
    p.add_argument("--limit", type=int, metavar="N", help=limit)
    fewshot = "examples shown before each question (default: each task's own setting)"
    p.add_argument("--num-fewshot", type=int, metavar="K", help=fewshot)
    batch = "sequences per forward pass of the model"
    p.add_argument("--batch-size", type=int, default=8, help=batch)
    perplexity = "loss and perplexity on the validation split of a prepared data dir"
    p.add_argument("--perplexity", metavar="DATA_DIR", help=perplexity)


def cmd_eval(args: argparse.Namespace) -> int:
    from scale_llm.evaluate import eval_run, format_record
    from scale_llm.generate import read_run_config

    for key, least in (("limit", 1), ("batch_size", 1), ("num_fewshot", 0)):
        value = getattr(args, key)
        if value is not None and value < least:
            flag = key.replace("_", "-")
            raise UserError(f"--{flag} {value}: use a count >= {least} (or leave it out)")
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    loose = {"--num-fewshot": args.num_fewshot, "--include-path": args.include_path}
    if not tasks and (loose := [flag for flag, value in loose.items() if value is not None]):
        raise UserError(
            f"{', '.join(loose)}: only with --tasks (they shape lm-eval's tasks; --perplexity "
            f"reads the held-out split as it is); add --tasks T1,T2 or leave them out"
        )
    plan = _one_process_plan(read_run_config(args.run_dir))
    options = (args.limit, args.include_path, args.perplexity, args.batch_size, args.num_fewshot)
    path, record = eval_run(args.run_dir, plan, tasks, *options)
    print(format_record(record))
    print(f"wrote {path}")
    return 0


def _one_process_plan(cfg: Config):
    """The plan of a run's config as one process on whatever this machine has (generate, eval,
    export): whatever backend, devices, tensor and pipeline parallelism the run trained with."""
    from scale_llm.config.plan import Launch, resolve_plan

    return resolve_plan(with_changes(cfg, {**ONE_PROCESS, "train.device": "auto"}), Launch())


def generation_problems(args: argparse.Namespace) -> list[str]:
    """Sampling settings that would fail deep inside torch (or silently mean something else)."""
    e = []
    if args.max_new_tokens < 1:
        e.append("--max-new-tokens must be at least 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        e.append(f"--temperature {args.temperature}: use a number >= 0 (0 = greedy)")
    elif 0 < args.temperature < 1e-30:  # (the logits divided by it overflow float32 to inf)
        e.append(f"--temperature {args.temperature}: use 0 for greedy, or at least 1e-30")
    if args.top_k is not None and args.top_k < 0:
        e.append(f"--top-k {args.top_k}: use a count >= 1 (0 or omitted: no top-k filter)")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        e.append(f"--top-p {args.top_p}: use a probability in (0, 1] (1: no nucleus filter)")
    if not 0 <= args.seed < 2**63:  # torch takes [-2**63, 2**64) and folds negatives into it
        e.append(f"--seed {args.seed}: use an integer in [0, 2**63), e.g. 0")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = args.prompt.encode("utf-8", "surrogateescape")[err.start : err.end]
        e.append(
            f"--prompt is not valid UTF-8 (bytes {bad!r} at position {err.start}); pass text, "
            f"e.g. re-encode the prompt file with iconv"
        )
    return e


MAX_PROMPT_BYTES = 16 * 2**20  # far past any context; a prompt is read and tokenized whole


def read_prompt_file(path: str) -> str:
    """The prompt `--prompt-file` names: a UTF-8 text file, or standard input for `-`."""
    where = "standard input" if path == "-" else path
    if path != "-" and not Path(path).is_file():
        found = "no such file" if not Path(path).exists() else "not a regular file"
        raise UserError(f"--prompt-file {path}: {found}; give a text file, or - for stdin")
    try:
        with open(path, "rb") if path != "-" else contextlib.nullcontext(sys.stdin.buffer) as f:
            data = f.read(MAX_PROMPT_BYTES + 1)
    except OSError as e:  # (a read's error names no file: main's paragraph would not say which)
        raise UserError(f"--prompt-file {where}: cannot read it ({e.strerror or e})") from None
    if len(data) > MAX_PROMPT_BYTES:
        raise UserError(
            f"--prompt-file {where}: more than {MAX_PROMPT_BYTES // 2**20} MiB; the model reads "
            f"at most model.seq_len tokens of a prompt: give the end of the text you want "
            f"continued (e.g. tail -c 100000 FILE | scale-llm generate RUN --prompt-file -)"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"--prompt-file {where} is not UTF-8 text (bytes {data[e.start : e.end]!r} at byte "
            f"{e.start}); re-encode it, e.g. iconv -f latin1 -t utf-8"
        ) from None


def _generate_parser(sub) -> None:
    p = _command(sub, "generate", "sample text from a trained run")
    p.add_argument("run_dir", help="a run directory written by `scale-llm train`, e.g. runs/tiny")
    given = p.add_mutually_exclusive_group()
    prompt = "text to continue (default: none: a new document)"
    given.add_argument("--prompt", default="", help=prompt)
    prompt_file = "read the prompt from a UTF-8 text file, as it is (a final newline included), "
    prompt_file += "or from standard input with -"
    given.add_argument("--prompt-file", metavar="PATH", help=prompt_file)
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 disables")
    p.add_argument("--top-p", type=float, help="nucleus sampling threshold (default: none)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    p.add_argument("--checkpoint", help="a checkpoint dir (default: the newest)")


def cmd_generate(args: argparse.Namespace) -> int:
    from scale_llm.generate import generate_text, read_run_config

    if args.prompt_file is not None:
        args.prompt = read_prompt_file(args.prompt_file)
    if problems := generation_problems(args):
        raise UserError("; ".join(problems))
    cfg = read_run_config(args.run_dir)
    sampling = (args.max_new_tokens, args.temperature, args.top_k or None, args.top_p, args.seed)
    plan = _one_process_plan(cfg)
    print(generate_text(args.run_dir, cfg, plan, args.prompt, *sampling, args.checkpoint))
    return 0


def _runs_parser(sub) -> None:
    p = _command(sub, "runs", "list the runs of a run.dir: step, loss, status, size")
    where = "a run.dir (the parent of run directories), or one run directory"
    p.add_argument("dir", nargs="?", default=RunConfig().dir, help=where)


def cmd_runs(args: argparse.Namespace) -> int:
    """Read-only: nothing is written, created or locked."""
    from scale_llm.train.runs import format_runs, list_runs

    print(format_runs(list_runs(args.dir), args.dir))
    return 0


_COMMANDS = (  # each command's parser and what runs it, in `scale-llm --help`'s order
    ("prepare", _prepare_parser, cmd_prepare),
    ("train", _train_parser, cmd_train),
    ("config", _config_parser, cmd_config),
    ("estimate", _estimate_parser, cmd_estimate),
    ("bench", _bench_parser, cmd_bench),
    ("check", _check_parser, cmd_check),
    ("convert", _convert_parser, cmd_convert),
    ("export", _export_parser, cmd_export),
    ("eval", _eval_parser, cmd_eval),
    ("generate", _generate_parser, cmd_generate),
    ("runs", _runs_parser, cmd_runs),
)
COMMANDS = {name: run for name, _, run in _COMMANDS}


DOTTED = re.compile(r"^--([a-z_]+\.[a-z_.0-9\[\]]+)(?:=(.*))?$")  # (data.sources[0].weight)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """argparse, with `--section.key value` / `--section.key=value` read as `--set` (the habit
    of torchtitan and litgpt users)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["prepare"] and "--as-train" in argv:
        # the launchers pass their whole command line; `train` checks it, so a typo stops here
        args = parse_args(["train", *(a for a in argv[1:] if a != "--as-train")])
        args.command, args.force, args.bench, args.as_train = "prepare", False, False, True
        args.bench_mb = BENCH_MB
        return args
    rewritten, i = [], 0
    while i < len(argv):
        m = DOTTED.match(argv[i])
        if m is None:
            rewritten.append(argv[i])
        elif m.group(2) is not None:
            rewritten += ["--set", f"{m.group(1)}={m.group(2)}"]
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            rewritten += ["--set", f"{m.group(1)}={argv[i + 1]}"]
            i += 1
        else:
            parser.error(f"{argv[i]} needs a value: {argv[i]} VALUE or {argv[i]}=VALUE")
        i += 1
    return parser.parse_args(rewritten)


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on it)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLERR)
        return bool(poll.poll(0))
    except (OSError, ValueError, AttributeError):  # (no file descriptor: a captured stdout)
        return False


PATH_DESTS = (  # arguments that name a file or folder (argparse's dests)
    *("config", "run_dir", "checkpoint", "dir", "out", "scratch", "include_path", "perplexity"),
    *("prompt_file", "checkpoint_io"),
)


def _argument(command: str, dest: str) -> str:
    """How `scale-llm COMMAND --help` names the argument of `dest` (--out, or OUT)."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in commands.choices[command]._actions if a.dest == dest)
    return action.option_strings[0] if action.option_strings else (action.metavar or dest.upper())


PATH_ERRORS = {  # what an OSError on a path says the user can do
    errno.EACCES: "this user may not read or write it (or its file system does not allow it); "
    "give it (and the folders above it) this user's permissions, or point the command at a "
    "folder this user owns, and run it again",
    errno.ENAMETOOLONG: "a name in that path is longer than the file system allows; give a "
    "shorter path",
    errno.ELOOP: "it is a symlink that loops; point it at a real file or folder",
}
PATH_ERRORS[errno.EPERM] = PATH_ERRORS[errno.EACCES]


def entry() -> int:
    """The `scale-llm` command and `python -m scale_llm`: `main` with PYTHONSAFEPATH=1 in the
    environment, so that no Python the command starts (prepare's encoding workers, each one a
    `python -c`) puts the working folder first on sys.path: a threading.py there would run."""
    os.environ["PYTHONSAFEPATH"] = "1"
    return main()


def _interrupted(e: KeyboardInterrupt) -> int:
    """Ctrl-C: 130; a stop signal (`Stopped`): 128 + its number."""
    with contextlib.suppress(OSError):  # (a hangup's terminal is gone)
        said = signal.Signals(e.signum).name if isinstance(e, Stopped) else None
        print(f"stopped by {said}" if said else "interrupted", file=sys.stderr)
    return 128 + e.signum if isinstance(e, Stopped) else 130


# commands whose stop signals unwind (their `finally` blocks run, removing what they had half
# written): all but those with a stop of their own
OWN_STOP = ("train", "prepare")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.suppress(AttributeError, ValueError):  # (a terminal of another encoding:
        sys.stdout.reconfigure(errors="replace")  # `?` for what it cannot show, not a crash)
    setup_logging(stream=sys.stderr if _prints_data(args) else sys.stdout)
    code = 1  # an internal error propagates with its traceback
    try:
        if empty := [dest for dest in PATH_DESTS if str(getattr(args, dest, None)) == ""]:
            raise UserError(
                f"`scale-llm {args.command}` {_argument(args.command, empty[0])} is empty (an "
                f"unset shell variable?): it would name the working folder; give a path"
            )
        with contextlib.nullcontext() if args.command in OWN_STOP else stop_signals_raise():
            code = COMMANDS[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = e.exit_code
    except KeyboardInterrupt as e:
        code = _interrupted(e)
    except BrokenPipeError:
        if not _stdout_gone():  # another pipe (a child's, a service's): an internal error
            raise
        # the reader of stdout left (`| head`): nothing more to say
        with contextlib.suppress(OSError, ValueError):  # (exit flushes stdout: into nothing)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141  # as a shell reports a command stopped by SIGPIPE
    except OSError as e:  # a full disk (or quota) is the user's to fix, wherever it struck
        if e.errno in PATH_ERRORS and e.filename:  # a path the user named, or one below it
            where = f"{e.filename} -> {e.filename2}" if e.filename2 else e.filename
            said = f"cannot use {where} ({e.strerror}): {PATH_ERRORS[e.errno]}"
        elif e.errno in (errno.ENOSPC, errno.EDQUOT):
            where = f" while writing {e.filename}" if e.filename else ""
            said = (
                f"ran out of disk space{where} ({e.strerror}); free some space there, or point "
                f"the output (data.dir, run.dir, --out) at a larger disk, and run it again "
                f"(prepare and train continue from what they finished; files are written "
                f"under temporary names and renamed when complete)"
            )
        else:
            raise
        print(f"error: `scale-llm {args.command}` {said}", file=sys.stderr)
        code = 2
    except BaseException as e:  # (DCP's save wraps a Ctrl-C in its CheckpointException)
        if (interrupt := wrapped_interrupt(e)) is None:
            raise
        code = _interrupted(interrupt)
    finally:
        joined = False
        if "torch.distributed" in sys.modules:  # a process group may exist: leave it
            from scale_llm.components.distributed import joined_multi_process, shutdown_distributed

            shutdown_distributed(clean=code == 0)
            joined = joined_multi_process()
    if joined:
        from scale_llm.components.distributed import exit_without_teardown

        exit_without_teardown(code)
    return code


if __name__ == "__main__":
    sys.exit(entry())
