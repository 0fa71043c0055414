"""The one preflight: every check that can be known before work, in one report, and the frozen
`RunSpec` the trainer builds. Every rank runs it (writing nothing) and the ranks agree on the
verdict, so one rank's problem stops every rank with a message, not a hang in a collective."""

from __future__ import annotations

import configparser
import contextlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from scale_llm.analysis.memory import check_host_memory
from scale_llm.components.checkpoint import CLAIM, claim_folder, refuse_inside_checkpoint
from scale_llm.components.distributed import first_failed_rank
from scale_llm.components.optim import lr_at
from scale_llm.config import Config, TrainConfig, compiles, with_changes
from scale_llm.config.plan import RunPlan
from scale_llm.data.loader import TrainLoader
from scale_llm.data.mixture import TrainingData, check_epochs, open_training_data, source_config
from scale_llm.data.pretrained_tokenizer import BUNDLE_FILE, vocab_problem
from scale_llm.data.sources import refuse_overlap
from scale_llm.errors import UserError, install_hint, short
from scale_llm.files import (
    MAX_RECORD_BYTES,
    OWNER_MARKER,
    OwnerLock,
    json_object_or_none,
    owned_kind,
    require_kind,
    require_writable_dir,
    same_file,
)
from scale_llm.model import attention
from scale_llm.parallel import compile as block_compile
from scale_llm.parallel.ds_config import check_zero_settings
from scale_llm.parallel.fp8 import check_fp8
from scale_llm.train.eval_tasks import TaskEval
from scale_llm.train.guards import FAULT_VARIABLE, fault_spec
from scale_llm.train.init_from import check_init_from
from scale_llm.train.profiling import check_profile
from scale_llm.train.resume import Resume, choose_resume

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RunSpec:
    """What the trainer builds, every part checked: nothing here is `auto` or unread."""

    cfg: Config  # train.compile settled to true or false for this machine
    plan: RunPlan
    data: TrainingData  # the windows of data.dir (a mixture: each source's)
    tokenizer: Path  # data.dir's tokenizer file (the run dir gets a copy)
    resume: Resume | None  # the checkpoint this launch continues, its state checked
    init_from: Path | None  # a Hugging Face folder whose weights start a fresh run
    tasks: TaskEval  # eval.tasks, looked up (none: nothing to run)
    asked: Config  # the config as given (`auto` kept): what the run dir's config.yaml holds

    @property
    def complete(self) -> bool:
        """The run already reached train.max_steps: the launch says so and writes nothing."""
        return self.resume is not None and self.resume.step >= self.cfg.train.max_steps


@dataclass
class Report:
    """The problems of one preflight: each check's UserError is kept; the launch stops once."""

    problems: list[str] = field(default_factory=list)

    def check(self, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return fn(*args)
        except UserError as e:
            self.problems.append(str(e))
            return None

    def raise_if_any(self, plan: RunPlan) -> None:
        """Stop every rank when any rank has a problem (each with its own, or a pointer)."""
        if first_failed_rank(bool(self.problems)) is None:
            return
        if not self.problems:
            raise UserError(
                "another rank found problems that stop this launch before any work (its "
                "message says what they are, and how to fix them)"
            )
        if len(self.problems) == 1:
            raise UserError(self.problems[0])
        raise UserError(
            f"{len(self.problems)} problems stop this launch before any work:\n  - "
            + "\n  - ".join(self.problems)
        )


def check_fault_reach(cfg: Config) -> None:
    """A malformed SCALE_LLM_FAULT, or one past the last step this launch trains, stops it; a
    mid_save at a step it saves at only when a stop signal arrives there is said."""
    if (fault := fault_spec()) is None:
        return
    point, step, _ = fault
    t, every = cfg.train, cfg.checkpoint.every
    last = min(t.max_steps, t.exit_at_step or t.max_steps)
    if step > last:
        raise UserError(
            f"{FAULT_VARIABLE}={point}:{step}: this launch trains to step {last} (train."
            f"max_steps={t.max_steps}, train.exit_at_step={t.exit_at_step}), so nothing would be "
            f"injected and the drill would pass for one; pick a step it reaches, or unset "
            f"{FAULT_VARIABLE}"
        )
    if point == "mid_save" and step != last and not (every and step % every == 0):
        log.warning(
            f"{FAULT_VARIABLE}={point}:{step}: checkpoint.every={every} saves at no step {step}: "
            f"the fault fires only if a stop signal makes this launch save there"
        )


def preflight(cfg: Config, plan: RunPlan) -> RunSpec:
    """The RunSpec of `cfg` under `plan`, or one UserError naming every problem. A check whose
    input failed is skipped (that failure is already in the report)."""
    check_fault_reach(cfg)  # a malformed or unreachable SCALE_LLM_FAULT: before anything else
    report, asked = Report(), cfg
    data = report.check(open_training_data, cfg)  # manifest, mixture, shards, tokenizer
    tokenizer = Path(cfg.data.dir) / data.manifest["tokenizer"]["file"] if data else None
    fits = report.check(check_data_fits, cfg, plan, data) if data is not None else None
    known = len(report.problems)
    if plan.is_main:
        report.check(check_run_dir_state, cfg)
    run_dir_ok = plan.is_main and len(report.problems) == known  # (a refused one: said once)
    before = len(report.problems)
    has_data = first_failed_rank(data is None) is None  # (the choice is a collective: alike)
    resume = report.check(choose_resume, cfg, plan, data.manifest) if has_data else None
    if fits and len(report.problems) == before:  # data.repeat=false: from the resumed position
        report.check(check_data_epochs, cfg, plan, data, resume)
    report.check(check_exit_step, cfg.train, resume)
    if run_dir_ok and not (resume and resume.step >= cfg.train.max_steps):  # (it will write)
        report.check(require_writable_dir, cfg.run_dir / "checkpoints", "RUN_DIR/checkpoints")
        if cfg.logging.tensorboard:  # (a folder it cannot write was a thread's traceback)
            report.check(require_writable_dir, cfg.run_dir / "tensorboard", "RUN_DIR/tensorboard")
    init_from = None
    if data is not None and cfg.model.init_from:
        if resume is None:
            tok = data.manifest["tokenizer"]
            init_from = report.check(
                check_init_from, cfg.model, tok["sha256"], tok.get("files_sha256"), plan.is_main
            )
        else:
            log.info("init_from: not used: resuming %s (newer weights)", resume.checkpoint)
    check_settings(report, cfg, plan, resume is not None)
    tasks = report.check(TaskEval, cfg, plan, tokenizer)  # every rank: they agree on it
    cfg = report.check(settle_compile, cfg, plan) or cfg  # every rank: they agree on it
    report.raise_if_any(plan)
    spec = RunSpec(cfg, plan, data, tokenizer, resume, init_from, tasks, asked)
    if plan.is_main and not spec.complete:
        warn_about_warmup(cfg)
        warn_about_source(cfg, data)
        warn_about_validation(cfg, plan, data)
        warn_about_attention(cfg, plan)
        warn_about_unread(cfg, plan)
        warn_about_deepspeed(cfg, plan)
    return spec


def check_settings(report: Report, cfg: Config, plan: RunPlan, resumes: bool) -> None:
    """The checks of the settings and this machine alone (no data, no run dir): W&B, host
    memory, fp8, DeepSpeed's zero_optimization, the profiler."""
    if plan.is_main and cfg.logging.wandb.project is not None:
        report.check(check_wandb, cfg, resumes)
    report.check(check_host_memory, cfg, plan)
    report.check(check_fp8, cfg, plan)  # torchao, an fp8 GPU, the backend
    report.check(check_zero_settings, cfg, plan)  # DeepSpeed's own model of zero_optimization
    report.check(check_profile, cfg.train.profile, cfg.run_dir)
    report.check(check_evaluation, cfg)


def check_evaluation(cfg: Config) -> None:
    """eval.every with eval.steps=0 ran no evaluation, and said nothing."""
    if cfg.eval.every > 0 and cfg.eval.steps == 0:
        raise UserError(
            f"eval.steps=0 scores no validation batch, so eval.every={cfg.eval.every} evaluates "
            f"nothing; set eval.steps to 1 or more, or eval.every=0 for no evaluation"
        )


def check_fresh_settings(cfg: Config, plan: RunPlan) -> None:
    """What train's preflight refuses of a fresh run's settings before its data exists (for
    `check`, whose runs take --set values): these checks, and init_from's folder and shapes."""
    report = Report()
    if cfg.model.init_from:
        report.check(check_init_from, cfg.model, None)  # (its tokenizer: once data exists)
    check_settings(report, cfg, plan, False)
    report.raise_if_any(plan)


def check_data_epochs(cfg: Config, plan: RunPlan, data: TrainingData, resume: Resume | None):
    """data.repeat=false: no source read twice by the steps from the resumed stream position
    on (a mixture's epochs printed)."""
    resumed = (resume.step, resume.state["data"]["position"]) if resume else (0, 0)
    loader = TrainLoader(data.train, plan, cfg.run.seed, 0, data.sources, cfg.data.repeat)
    check_epochs(cfg, loader, data, plan.is_main, resumed)


def check_data_fits(cfg: Config, plan: RunPlan, data: TrainingData) -> bool:
    """data.dir can feed this model and this batch: windows of seq_len in both splits, more
    training windows than one optimizer step reads (data.repeat's epochs: after the resume)."""
    check_vocab(cfg, data.manifest)
    train, val = data.train, min(data.val.values(), key=len)
    if len(train) == 0 or len(val) == 0:
        raise UserError(
            f"data.dir={cfg.data.dir} has too few tokens for model.seq_len={cfg.model.seq_len} "
            f"(train windows: {len(train)}, val windows: {len(val)}); use a larger corpus or a "
            f"shorter seq_len"
        )
    if (per_step := plan.sequences_per_step) > len(train):
        raise UserError(
            f"one optimizer step reads {per_step:,} sequences (train.micro_batch_size "
            f"{plan.micro_batch_size} x train.grad_accum {plan.grad_accum} x {plan.dp_degree} "
            f"rank(s)) but data.dir={cfg.data.dir} holds {len(train):,} training windows of "
            f"model.seq_len {cfg.model.seq_len}: every step would repeat the data; lower "
            f"train.grad_accum or train.micro_batch_size, or prepare more data"
        )
    return True


def warn_about_source(cfg: Config, data: TrainingData) -> None:
    """A source other than the one data.dir was prepared from (a config edited, `prepare` not
    run again): the run trains on what was prepared, so it says so."""
    for key, (given, prepared) in data.other_source.items():
        log.warning(
            f"{key}={short(given, 80)}, but data.dir={cfg.data.dir} was prepared from "
            f"{short(prepared, 80)} (its manifest): this run trains on that; run `scale-llm "
            f"prepare CONFIG` to prepare {key} (the launchers do before training)"
        )


def warn_about_validation(cfg: Config, plan: RunPlan, data: TrainingData) -> None:
    """Validation smaller than one evaluation (each window is scored once): say so."""
    e, per_batch = cfg.eval, plan.sequences_per_step
    asked = e.steps * per_batch
    small = {name or "data.dir": len(w) for name, w in data.val.items() if len(w) < asked}
    if not (e.every and e.steps and small):
        return
    held = ", ".join(f"{n:,} in {name}" for name, n in small.items())
    whole = min(small.values()) // per_batch  # whole global batches the smallest holds
    fix = f" or set eval.steps={whole} to score whole batches" if whole else ""
    log.warning(
        f"eval: eval.steps={e.steps} global batches of {per_batch} sequences ask for {asked} "
        f"validation windows, but there are fewer ({held}): each evaluation scores those once "
        f"each; prepare more validation data (data.val_fraction){fix}"
    )


def warn_about_unread(cfg: Config, plan: RunPlan) -> None:
    """parallel.fsdp.* / ddp.* / pipeline.* set away from their defaults where this plan reads
    none of them (`auto` resolved to ddp, a replicate_degree meant for HSDP): said, not silent."""
    reads = {"fsdp": plan.backend == "fsdp", "ddp": plan.backend == "ddp"}
    for group, read in (reads | {"pipeline": plan.pp_degree > 1}).items():
        section = getattr(cfg.parallel, group)
        given, default = vars(section), vars(type(section)())
        unread = [f"{k}={v}" for k, v in given.items() if v != default[k]]
        if unread and not read:
            log.warning(
                f"parallel.{group}: {', '.join(unread)} not read: this run's backend is "
                f"{plan.backend}{' without pipeline stages' if group == 'pipeline' else ''}"
            )


def warn_about_attention(cfg: Config, plan: RunPlan) -> None:
    """A GPU run whose attention materializes a (T, T) tensor where a fused kernel would not."""
    if plan.device.type != "cuda":
        return
    m = cfg.model
    if m.attention == "eager":
        log.warning(
            "model.attention=eager materializes the (B, n_heads, T, T) score matrix on the GPU "
            "(for teaching and memory studies); model.attention=sdpa runs a fused kernel"
        )
        return
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision, torch.float32)
    document = m.attention_mask == "document"
    if problem := attention.problem("cuda", dtype, document, m.d_model // m.n_heads):
        log.warning("attention: %s", problem)


def warn_about_deepspeed(cfg: Config, plan: RunPlan) -> None:
    """ZeRO-0 and -1 in bf16 sum the micro-steps' gradients in bf16 (parallel/ds_config.py)."""
    stage = cfg.parallel.deepspeed.zero_stage
    if plan.backend == "deepspeed" and plan.precision == "bf16" and stage <= 1:
        log.warning(
            f"parallel.deepspeed.zero_stage={stage} in bf16: DeepSpeed sums the micro-steps' "
            f"gradients in bf16 and reduces them in {'bf16' if stage == 0 else 'fp32'}; "
            f"zero_stage 2 or 3, or parallel.backend=ddp or fsdp, keep them in fp32"
        )


def warn_about_warmup(cfg: Config) -> None:
    """warmup >= max_steps: the LR never reaches train.lr (fine for smoke runs; say so)."""
    t = cfg.train
    if t.warmup_steps >= t.max_steps:
        log.warning(
            f"train.warmup_steps={t.warmup_steps} >= train.max_steps={t.max_steps}: the learning "
            f"rate rises to {lr_at(t.max_steps - 1, t):.3g} at the last step (train.lr={t.lr:g}) "
            f"and never decays; fine for a smoke run"
        )


def check_exit_step(train: TrainConfig, resume: Resume | None) -> None:
    """train.exit_at_step at or below the step this launch resumes from is never reached: the
    launch would train on to max_steps, past the time limit it was set for."""
    at = train.exit_at_step  # (> 0: a fresh run reaches it)
    if resume and at is not None and at <= resume.step < train.max_steps:
        raise UserError(
            f"train.exit_at_step={at} is not after step {resume.step}, where this launch resumes "
            f"({resume.checkpoint}), so it would never stop there and would train on to "
            f"train.max_steps={train.max_steps}: set it above {resume.step}, or to null to train "
            f"to the end"
        )


def check_wandb(cfg: Config, resumes: bool) -> None:
    """W&B starts from the run's own settings: a workspace settings file where wandb.init reads
    one (the folder the launch started from) may hold only WANDB_SETTINGS_KEPT keys (`wandb
    offline` writes `mode`; an `entity` would send the run elsewhere), and a resumed run's id
    file holds an id. The project's name first: W&B refused it after the run dir and the model
    were made ("": no W&B, silently)."""
    project = cfg.logging.wandb.project
    if not 0 < len(project) <= 128 or not WANDB_BAD.isdisjoint(project):
        raise UserError(
            f"logging.wandb.project={short(project, 30)}: W&B takes a name of 1 to 128 "
            f"characters without {' '.join(sorted(WANDB_BAD))} (e.g. scale-llm); null: no W&B"
        )
    here = Path.cwd()
    path = here / (".wandb" if (here / ".wandb").exists() else "wandb") / "settings"
    named: set[str] = set()
    if path.exists() or path.is_symlink():
        named = {"(not a small regular file)"}
        if path.is_file() and path.stat().st_size <= MAX_RECORD_BYTES:
            named = _wandb_settings_keys(path)
    if extra := sorted(named - set(WANDB_SETTINGS_KEPT)):
        raise UserError(
            f"logging.wandb.project={cfg.logging.wandb.project}: W&B would take its settings "
            f"from {path}, in the folder this launch started from: {', '.join(extra)} (keys "
            f"such as base_url and the proxies decide where your API key and metrics go); move "
            f"the file away or launch from another folder, and keep such settings in WANDB_* "
            f"variables or ~/.config/wandb/settings (a file holding only "
            f"{', '.join(WANDB_SETTINGS_KEPT)} is read, as `wandb offline` writes it)"
        )
    if resumes:
        wandb_id(cfg.run_dir)
    try:
        import wandb
    except ImportError:
        raise UserError(
            f"logging.wandb.project={cfg.logging.wandb.project} needs the wandb package: "
            f"{install_hint('wandb')} (or set logging.wandb.project=null)"
        ) from None
    if cfg.logging.wandb.mode == "online" and not _wandb_credentials(wandb, cfg):
        raise UserError(
            f"logging.wandb.project={cfg.logging.wandb.project}: W&B finds no API key on this "
            f"node (logging.wandb.mode=online); log this node in (`wandb login`, or set "
            f"WANDB_API_KEY), or set logging.wandb.mode=offline to log into the run directory "
            f"and `wandb sync` it later, or logging.wandb.project=null"
        )


def _wandb_credentials(wandb, cfg: Config) -> bool:
    """Whether wandb.init would find credentials for its server (WANDB_API_KEY, an identity
    token file, the .netrc, its settings), as it looks for them, without asking the server or
    keeping what it finds (nor its settings: wandb.init reads them afresh); True where this
    wandb has no such reader (wandb.init then decides)."""
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        kept = wandb_setup._singleton
    except (ImportError, AttributeError):
        return True
    try:
        settings = wandb_setup.singleton().settings  # (starts no service)
        host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
        return bool(
            wbauth.authenticate_session(
                host=host, source="scale_llm", prompt=False, update_session=False
            )
        )
    except (AttributeError, TypeError):
        return True
    except Exception as e:  # a key of the wrong form, two sources at once, a bad WANDB_* value
        raise UserError(
            f"logging.wandb.project={cfg.logging.wandb.project}: W&B cannot use this node's "
            f"settings or credentials ({' '.join(str(e).split())[:200]}); fix the WANDB_* "
            f"variables (WANDB_API_KEY, WANDB_BASE_URL, ...) or the .netrc, or set "
            f"logging.wandb.mode=offline"
        ) from None
    finally:
        wandb_setup._singleton = kept


def _wandb_settings_keys(path: Path) -> set[str]:
    """The keys W&B reads from a settings file, as its reader takes them: a file it cannot parse
    gives none; one that would stop wandb.init (a `%` interpolation, another encoding) is named."""
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
    except configparser.Error:  # W&B reads nothing from it
        return set()
    except UnicodeDecodeError:
        return {"(not text W&B can read)"}
    try:
        return set(dict(parser.items("default")))
    except configparser.NoSectionError:
        return set()
    except configparser.Error as e:
        return {f"(W&B cannot read it: {type(e).__name__})"}


def wandb_id(run_dir: Path) -> str | None:
    """The W&B run id in RUN_DIR/wandb-id.txt (None: no such regular file; check_run_dir
    refuses other kinds), or a UserError naming the file."""
    path = run_dir / WANDB_ID_FILE
    if path.is_symlink() or not path.is_file():
        return None
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open(path, "rb") as f:
            text = f.read(MAX_WANDB_ID + 2).decode().strip()
        if re.fullmatch(rf"[A-Za-z0-9_-]{{1,{MAX_WANDB_ID}}}", text):
            return text
    raise UserError(
        f"{path} does not hold a W&B run id (letters, digits, - and _; a run writes 16 hex "
        f"digits), and a resumed run logs to the W&B run it names: write the id back (the run's "
        f"W&B page shows it), or delete the file to log from here on as a new W&B run"
    )


RUN_WRITES = (
    "the run would write its checkpoints and logs into the corpus, which prepare (before every "
    "launch) would then read as documents"
)


def check_run_dir_state(cfg: Config) -> None:
    """The run dir can be written, holds what a run writes there, and no live launch holds it."""
    require_writable_dir(cfg.run_dir, "run.dir / run.name")
    refuse_inside_checkpoint(cfg.run_dir, f"the run dir {cfg.run_dir}", "run.dir / run.name")
    for data in [source_config(cfg, e).data for e in cfg.data.sources] or [cfg.data]:
        written = (*RUN_DIR_FILES, *RUN_DIR_FOLDERS)  # (what a glob over the corpus may match)
        refuse_overlap(
            data, written, str(cfg.run_dir), "run.dir / run.name", RUN_WRITES, "the run dir"
        )
    check_run_dir(cfg.run_dir)
    RunLock(cfg.run_dir).check()


def settle_compile(cfg: Config, plan: RunPlan) -> Config:
    """train.compile as true or false: one rank without inductor's toolchain (a small function
    is compiled to find out) or with an unsafe cache folder makes every rank run eager (auto) or
    stop (true)."""
    if not compiles(cfg.train, plan.device.type):
        return with_changes(cfg, {"train.compile": False})
    problem = block_compile.toolchain_problem(plan.device)
    if first_failed_rank(problem is not None) is None:
        return with_changes(cfg, {"train.compile": True})
    problem = problem or "another rank's machine cannot compile (its log says why)"
    if cfg.train.compile is True:
        raise UserError(
            f"train.compile=true, but {problem}. Fix that, or run the blocks eager: --set "
            f"train.compile=false (or auto: eager with a warning where torch.compile cannot run)"
        )
    log.warning(
        f"train.compile=auto: {problem}; the blocks run eager (slower on a GPU). Fix that to "
        f"compile them, or set train.compile=false to run eager without this warning"
    )
    return with_changes(cfg, {"train.compile": False})


METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step
WANDB_ID_FILE = "wandb-id.txt"  # the W&B run id, so that a resumed run logs to the same run
MAX_WANDB_ID = 64
# the keys a launch folder's W&B settings file may hold (`wandb offline` writes mode)
WANDB_SETTINGS_KEPT = ("mode", "disabled", "project", "silent", "quiet")
WANDB_BAD = set("/\\#?%:")  # what a W&B project name may not hold
COMM_TRACE = "comm_trace"  # where NCCL's flight recorder writes when a collective times out
# What the trainer creates in RUN_DIR, by kind: another kind fails at its first write, or blocks.
RUN_DIR_FOLDERS = {
    "checkpoints": "its checkpoints",
    COMM_TRACE: "what NCCL's flight recorder writes when a collective times out",
    "tensorboard": "its TensorBoard event files",
    "wandb": "its offline Weights & Biases logs",
    ".wandb": "its Weights & Biases logs (W&B logs there, not in wandb/, where it exists)",
}
RUN_DIR_FILES = {
    "config.yaml": "its config",
    "plan.json": "its resolved plan",
    "tokenizer.model": "its copy of the tokenizer",
    BUNDLE_FILE: "its copy of the tokenizer (a model's own: data.tokenizer)",
    "ds_config.json": "its DeepSpeed config",
    METRICS_FILE: "its metric rows",
    WANDB_ID_FILE: "its Weights & Biases run id",
}
LOCK = ".lock"
RUN_KIND = "run"  # the kind in RUN_DIR/OWNER_MARKER, written by the launch that takes the lock
# in RUN_DIR/checkpoints (or the folder it links to), beside its claim (components/checkpoint.py
# CLAIM: the run that last used it, and the folder's id): the lock its launch holds
CHECKPOINTS_LOCK = ".scale-llm-run.lock"


class RunLock:
    """One launch per run directory, taken by the main rank once every check has passed (a dead
    owner's lock is taken over, a live one's refused); with it the lock of its checkpoints
    folder, which two runs may reach (a link, a second mount): one prunes it at a time, and the
    folder records the run that last used it (its claim)."""

    def __init__(self, run_dir: Path):
        self.run_dir, ckpts = run_dir, run_dir / "checkpoints"
        self.locks = (
            OwnerLock(run_dir / LOCK, str(run_dir), "pick another run.name"),
            OwnerLock(
                ckpts / CHECKPOINTS_LOCK,
                f"the checkpoints folder {ckpts}",
                "if it is another run, give this run a checkpoints folder of its own",
            ),
        )

    def check(self) -> None:
        """Refuse a live owner of either lock (both named at once: each may need removing)."""
        said = []
        for lock in self.locks:
            try:
                lock.check()
            except UserError as e:
                said.append(str(e))
        if said:
            raise UserError(" Also: ".join(said))

    def acquire(self) -> None:
        try:
            for lock in self.locks:
                lock.acquire()
            refuse_checkpoints_of_another_run(self.run_dir)  # again, now that no run can start
            claim_folder(self.run_dir / "checkpoints", os.path.realpath(self.run_dir))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()


def check_run_dir(run_dir: Path) -> None:
    """`run_dir` is new, empty or a run's, and every name the trainer writes there is missing
    or of its kind (a symlinked folder is fine; a symlinked file is not: files go by rename)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return  # a new run dir (require_writable_dir checks that it can be made)
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK)  # (a killed launch's)
    if entries not in ([], ["checkpoints"]) and not is_run_dir(run_dir):  # (a link set up first)
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise UserError(
            f"{run_dir} holds files but is not a run directory (no {OWNER_MARKER} of a run): "
            f"{shown}; a run writes its config and files there, so it stops. Pick another "
            f"run.name (or run.dir), or empty that folder. (A run dir of a scale_llm before "
            f"3ae9a78 of 2026-12-06 has no mark: to continue such a run, write "
            f'{{"kind": "run"}} into {run_dir / OWNER_MARKER})'
        )
    refuse_checkpoints_of_another_run(run_dir)
    for kind, names in (("a folder", RUN_DIR_FOLDERS), ("a regular file", RUN_DIR_FILES)):
        for name, what in names.items():
            require_kind(run_dir / name, kind, what)


def refuse_checkpoints_of_another_run(run_dir: Path) -> None:
    """RUN_DIR/checkpoints must not be (inside) another run's checkpoints folder: each run prunes
    its checkpoints and moves newer ones aside."""
    if (other := checkpoints_of_another_run(run_dir)) is None:
        return
    ckpts = run_dir / "checkpoints"
    link = f" (a symlink to {os.path.realpath(ckpts)})" if ckpts.is_symlink() else ""
    raise UserError(
        f"{ckpts}{link} belongs to the run {other}: it lies in that run dir or in the checkpoints "
        f"folder that run uses. Each run prunes its checkpoints and moves newer ones aside, so "
        f"two runs would remove each other's. Give this run a checkpoints folder of its own, or "
        f"resume from one of that run's checkpoints on purpose: checkpoint.resume=PATH"
    )


def checkpoints_of_another_run(run_dir: Path) -> Path | None:
    """The other run whose files RUN_DIR/checkpoints is or lies in: a folder in another run dir,
    or one whose claim (in it, or above it for a link) names a run whose checkpoints folder it
    is; folders compared by device and inode (one seen through a link or a second mount)."""
    ckpts = run_dir / "checkpoints"
    if not ckpts.is_dir():
        return None
    target = Path(os.path.realpath(ckpts))  # (realpath: a loop is named later)
    for folder in (target, *target.parents) if ckpts.is_symlink() else (target,):
        if same_file(folder, run_dir):  # (a folder of its own run dir; a run dir above it is not
            break  # its owner)
        if is_run_dir(folder):
            return folder
        if (other := _claimed_by(folder)) is not None and not same_file(other, run_dir):
            return other
    return None


def _claimed_by(folder: Path) -> Path | None:
    """The run `folder`'s claim names, if that run still uses it as its checkpoints folder."""
    claim = json_object_or_none(folder / CLAIM, MAX_RECORD_BYTES) or {}
    if not isinstance(run := claim.get("run"), str) or not is_run_dir(Path(run)):
        return None
    return Path(run) if same_file(Path(run) / "checkpoints", folder) else None


def is_run_dir(path: Path) -> bool:
    """`path` (or the folder a link names) holds the mark the trainer writes in its run dirs."""
    return owned_kind(Path(os.path.realpath(path))) == RUN_KIND


def check_vocab(cfg: Config, manifest: dict[str, Any]) -> None:
    """The model embeds every id of data.dir's tokenizer: exactly the pieces of the one prepare
    trained; at least the ids of a model's own (data.tokenizer), whose rows HF models pad."""
    check_document_end(cfg, manifest)
    tok_vocab = manifest["tokenizer"]["vocab_size"]
    if manifest["tokenizer"]["file"] == BUNDLE_FILE:
        where = f"the tokenizer of data.dir={cfg.data.dir}"
        if isinstance(manifest["tokenizer"].get("from"), str):
            where += f" (prepared with data.tokenizer={manifest['tokenizer']['from']})"
        if problem := vocab_problem(where, tok_vocab, cfg.model.vocab_size, cfg.model.init_from):
            raise UserError(problem)
        return
    if tok_vocab != cfg.model.vocab_size:
        fix = (
            f"set model.vocab_size={tok_vocab}, or re-run `scale-llm prepare` with the vocab size "
            f"you want"
        )
        if init_from := cfg.model.init_from:  # (its weights were learned with its tokenizer)
            fix = (
                f"model.init_from={init_from} learned its own tokenizer's ids: set data."
                f"tokenizer={init_from} and run `scale-llm prepare` (into a data.dir of its own)"
            )
        raise UserError(
            f"model.vocab_size={cfg.model.vocab_size} does not match the tokenizer in "
            f"data.dir={cfg.data.dir} ({tok_vocab} pieces); {fix}"
        )


def check_document_end(cfg: Config, manifest: dict[str, Any]) -> None:
    """model.attention_mask=document splits at model.document_end_id: the shards' end id."""
    eos = manifest["tokenizer"].get("eos_id")
    if cfg.model.attention_mask == "document" and cfg.model.document_end_id != eos:
        raise UserError(
            f"model.attention_mask=document ends documents at model.document_end_id="
            f"{cfg.model.document_end_id}, but the tokenizer of data.dir={cfg.data.dir} ends "
            f"them with id {eos}; set model.document_end_id={eos}"
        )
