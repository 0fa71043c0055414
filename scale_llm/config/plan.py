"""The run plan: every `auto` (device, backend, precision, accumulation) settled once, at
start-up, from the config and the launch, into one frozen `RunPlan` that everything below the CLI
reads; the run dir keeps the config as written (`config.yaml`) and the plan as run (`plan.json`)."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from scale_llm.config import Config, format_errors
from scale_llm.config.fp8 import NOT_FP16
from scale_llm.config.parallel import pipeline_microbatches, stages_per_rank
from scale_llm.config.sections import WIDTH_MULTIPLE
from scale_llm.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Launch:
    """Where this process sits, as the launcher (torchrun, deepspeed, srun) says."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1


def launch_env() -> Launch:
    """RANK / LOCAL_RANK / WORLD_SIZE from the environment; a world of one when run directly."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    try:
        launch = Launch(*(int(os.environ.get(k, "1" if k == "WORLD_SIZE" else "0")) for k in names))
    except ValueError as e:
        raise UserError(
            f"RANK / LOCAL_RANK / WORLD_SIZE must be integers ({e}); start "
            f"multi-process runs with the scripts in launch/"
        ) from None
    if not (0 <= launch.rank < launch.world_size and 0 <= launch.local_rank < launch.world_size):
        # e.g. RANK=1 left in a shell: this process would run as a silent non-main rank
        shown = ", ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in names)
        raise UserError(
            f"the launch environment is inconsistent ({shown}): a launcher sets WORLD_SIZE >= "
            f"1, 0 <= RANK < WORLD_SIZE and 0 <= LOCAL_RANK < WORLD_SIZE; unset RANK, "
            f"LOCAL_RANK and WORLD_SIZE to run one process, or start multi-process runs with "
            f"torchrun or the scripts in launch/"
        )
    return launch


@dataclass(frozen=True)
class RunPlan:
    """What this run does, with nothing left to resolve."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str  # single | ddp | fsdp | deepspeed
    precision: str  # bf16 | fp16 | fp32
    dp_degree: int  # ranks that split each global batch: world_size / (tp_degree x pp_degree)
    micro_batch_size: int
    grad_accum: int
    seq_len: int
    tp_degree: int = 1  # ranks that split each layer (tensor parallelism), consecutive ranks
    replicate_degree: int = 1  # HSDP: data-parallel groups that replicate (fsdp only)
    pp_degree: int = 1  # pipeline stages' rank groups, the outermost mesh dimension
    pp_stages_per_rank: int = 1  # model chunks a pipeline rank holds (looped / V schedules)
    pp_microbatches: int = 1  # pieces the pipeline cuts each micro-batch into

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's place among the data-parallel ranks (a TP group reads the same data)."""
        return (self.rank // self.tp_degree) % self.dp_degree

    @property
    def pp_rank(self) -> int:
        """This rank's place in its pipeline (0: the first stage), the mesh's outermost index."""
        return self.rank // (self.world_size // self.pp_degree)

    @property
    def mesh(self) -> dict[str, Any]:
        """The device mesh the backend builds: its dimension names and sizes, outermost first
        (rank = ((pp x replicate + replicate) x shard + shard) x tp + tp position)."""
        if self.backend != "fsdp":
            return {"names": ["dp"], "shape": [self.world_size]}
        dims = [("pp", self.pp_degree), ("replicate", self.replicate_degree)]
        dims += [("shard", self.dp_degree // self.replicate_degree), ("tp", self.tp_degree)]
        dims = [(name, n) for name, n in dims if n > 1 or name == "shard"]
        return {"names": [name for name, _ in dims], "shape": [n for _, n in dims]}

    @property
    def sequences_per_step(self) -> int:
        """The global batch: micro_batch_size x grad_accum x data-parallel degree."""
        return self.micro_batch_size * self.grad_accum * self.dp_degree

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.seq_len

    @property
    def tokens_per_step_per_rank(self) -> int:
        """One GPU's share of the step's tokens: the ranks of a tensor- or pipeline-parallel
        group share their micro-batches."""
        return self.tokens_per_step // self.world_size

    def to_json(self) -> dict[str, Any]:
        out = {**dataclasses.asdict(self), "device": str(self.device)}
        derived = ("sequences_per_step", "tokens_per_step", "mesh")
        return out | {k: getattr(self, k) for k in derived}

    def describe(self) -> str:
        split = self.tp_degree > 1 or self.pp_degree > 1
        return (
            f"backend {self.backend}, precision {self.precision} on {self.device}, rank "
            f"{self.rank} of {self.world_size}; batch: micro {self.micro_batch_size} x seq_len "
            f"{self.seq_len} x grad_accum {self.grad_accum} x "
            f"{'data-parallel' if split else 'world'} {self.dp_degree} = "
            f"{self.sequences_per_step} sequences = {self.tokens_per_step:,} tokens per step"
            + (f"; {self._layout()}" if split else "")
        )

    def _layout(self) -> str:
        """The model split, for the start line: the degrees and the mesh."""
        parts = [f"tensor parallel {self.tp_degree}"] if self.tp_degree > 1 else []
        if self.pp_degree > 1:
            parts.insert(
                0,
                f"pipeline parallel {self.pp_degree} ({self.pp_degree * self.pp_stages_per_rank} "
                f"stages, {self.pp_microbatches} microbatch{'es' * (self.pp_microbatches > 1)} "
                f"a micro-batch)",
            )
        mesh = " x ".join(f"{n} {k}" for n, k in zip(self.mesh["names"], self.mesh["shape"]))
        return ", ".join(parts) + f" (mesh {mesh})"


def resolve_plan(
    cfg: Config, launch: Launch | None = None, *, cuda: bool | None = None, bf16: bool | None = None
) -> RunPlan:
    """The plan for `cfg` under `launch` (default: this process's launcher environment); `cuda`
    / `bf16`: whether a (bf16-capable) GPU is usable (default: ask torch). Every check that needs
    the launch runs here, before any process group, model or run directory exists."""
    launch = launch or launch_env()
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if errors := launch_problems(cfg, launch.world_size, cuda):
        raise UserError(format_errors(errors, f"launched with {launch.world_size} processes"))
    device = _device(cfg.train.device, launch.local_rank, cuda)
    if bf16 is None:
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if device.type == "cuda" and launch.rank == 0:
        _warn_on_odd_widths(cfg)
    backend = cfg.parallel.backend  # auto: single for one process, ddp for a launcher's several
    if backend == "auto":
        backend = "single" if launch.world_size == 1 else "ddp"
    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    dp = launch.world_size // (tp * pp)
    return RunPlan(
        **dataclasses.asdict(launch),
        device=device,
        backend=backend,
        precision=_precision(cfg.train.precision, device, bf16),
        dp_degree=dp,
        micro_batch_size=cfg.train.micro_batch_size,
        grad_accum=_grad_accum(cfg, dp),
        seq_len=cfg.model.seq_len,
        tp_degree=tp,
        replicate_degree=cfg.parallel.fsdp.replicate_degree if backend == "fsdp" else 1,
        pp_degree=pp,
        pp_stages_per_rank=stages_per_rank(cfg.parallel.pipeline) if pp > 1 else 1,
        pp_microbatches=pipeline_microbatches(cfg.parallel) if pp > 1 else 1,
    )


def target_plan(cfg: Config, world_size: int) -> RunPlan:
    """The plan `cfg` would get on `world_size` bf16-capable GPUs (what `estimate` predicts)."""
    plan = resolve_plan(cfg, Launch(world_size=world_size), cuda=True, bf16=True)
    return dataclasses.replace(plan, device=torch.device("cuda", 0))


def _device(requested: str, local_rank: int, cuda: bool) -> torch.device:
    """`auto`: this rank's CUDA GPU when one is visible, else the CPU."""
    if requested == "cuda" and not cuda:
        raise UserError(
            "train.device=cuda but no CUDA GPU is visible to PyTorch; use "
            "train.device=auto or cpu (or install a CUDA build of torch)"
        )
    if requested == "cuda" or (requested == "auto" and cuda):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 1
        return torch.device("cuda", local_rank % max(1, count))
    return torch.device("cpu")


def _precision(name: str, device: torch.device, bf16: bool) -> str:
    """`auto`: bf16 on a bf16-capable GPU, fp32 otherwise (CPUs without AMX emulate bf16)."""
    if name == "auto":
        name = "bf16" if device.type == "cuda" and bf16 else "fp32"
    if name == "bf16" and device.type == "cuda" and not bf16:
        raise UserError(
            "train.precision=bf16 but this GPU has no bf16 support; use "
            "train.precision=fp16 (with loss scaling) or fp32"
        )
    if name != "fp32" and device.type == "cpu":
        log.warning(
            f"train.precision={name} on CPU: autocast works but is usually slower than fp32 on "
            f"CPUs without native bf16/fp16 matmuls"
        )
    return name


def _warn_on_odd_widths(cfg: Config) -> None:
    """Matmul widths that are not multiples of 128 leave tensor-core tiles part empty. The MLP
    default is rounded (model.mlp_hidden: null); the vocabulary is the tokenizer's own size, so
    an odd one is the user's choice: say what the nearest fast size is."""
    m = WIDTH_MULTIPLE
    for key, value in (("vocab_size", cfg.model.vocab_size), ("mlp_hidden", cfg.model.mlp_hidden)):
        if value is not None and value % m:
            log.warning(
                f"model.{key}={value} is not a multiple of {m}: its matmuls run slower on tensor "
                f"cores; {m * -(-value // m)} is (the tokenizer and the model follow "
                f"model.vocab_size)"
            )


def _grad_accum(cfg: Config, world_size: int) -> int:
    """train.grad_accum, or what train.global_batch_size implies on `world_size` (dp) ranks."""
    g, mb, accum = cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.grad_accum
    if g is None:
        return accum
    implied = g // (mb * world_size)
    if accum not in (1, implied):
        raise UserError(
            f"train.grad_accum={accum} contradicts train.global_batch_size={g} (micro_batch_size "
            f"{mb} x world {world_size} gives grad_accum {implied}); set only one of them"
        )
    return implied


FP8_BACKENDS = ("single", "fsdp")  # DDP and DeepSpeed: not tested with Float8Linear


def launch_problems(cfg: Config, world_size: int, cuda: bool) -> list[str]:
    """Checks that need the launch: the number of processes and whether a GPU will be used."""
    e, backend, on_gpu = [], cfg.parallel.backend, cuda and cfg.train.device != "cpu"
    if backend == "deepspeed" and cfg.train.precision == "fp16" and not on_gpu:
        e.append(
            "train.precision=fp16 with parallel.backend=deepspeed needs a GPU (DeepSpeed's "
            "CPU accelerator has no fp16); use train.precision=bf16 or fp32 on CPU"
        )
    if cfg.parallel.fsdp.cpu_offload and backend == "fsdp" and not on_gpu:
        e.append(
            "parallel.fsdp.cpu_offload=true needs a GPU to offload from; on a CPU-only "
            "machine set it to false"
        )
    if (snapshot := cfg.train.profile.memory_snapshot_step) is not None and not on_gpu:
        e.append(
            f"train.profile.memory_snapshot_step={snapshot}: a memory snapshot records the CUDA "
            f"caching allocator, and this run will not use a GPU; run on a GPU, or set "
            f"train.profile.memory_snapshot_step=null (the CPU profiler's trace, "
            f"train.profile.enabled=true, records CPU memory)"
        )
    resolved = backend if backend != "auto" else ("single" if world_size == 1 else "ddp")
    if cfg.train.fp8.enabled and resolved not in FP8_BACKENDS:  # (estimate and --fit too)
        e.append(
            f"train.fp8.enabled=true works with parallel.backend=fsdp (or one process), not "
            f"{resolved}: set parallel.backend=fsdp (FSDP2 also gathers fp8 weights), or "
            f"train.fp8.enabled=false"
        )
    if cfg.train.fp8.enabled and cfg.train.precision == "fp16":
        e.append(NOT_FP16)
    if world_size > 1 and backend == "single":
        e.append(
            f"parallel.backend=single but {world_size} processes were launched; set "
            f"parallel.backend to ddp, fsdp or deepspeed, or launch one process"
        )
    if (tp := cfg.parallel.tensor_parallel) > 1 and world_size % tp:
        fits = [k for k in range(2, world_size + 1) if world_size % k == 0]
        e.append(
            f"parallel.tensor_parallel={tp} does not divide the world size {world_size}; use "
            f"a divisor of it ({', '.join(map(str, fits)) or 'none above 1: launch more'}) "
            f"or launch a multiple of {tp} processes"
        )
        tp = 1  # (the checks below: as if the world were data parallel)
    if (pp := cfg.parallel.pipeline_parallel) > 1 and world_size % (tp * pp):
        fits = [k for k in range(2, world_size // tp + 1) if world_size % (tp * k) == 0]
        e.append(
            f"parallel.pipeline_parallel={pp} x parallel.tensor_parallel={tp} does not divide "
            f"the world size {world_size}; use parallel.pipeline_parallel="
            f"{' or '.join(map(str, fits)) or '1'}, or launch a multiple of {tp * pp} processes"
        )
        pp = 1
    split, r = tp * pp, cfg.parallel.fsdp.replicate_degree
    if backend == "fsdp" and (world_size // split) % r:
        of = (
            f"the world size {world_size}"
            if split == 1
            else f"the data-parallel degree {world_size // split} (world {world_size} / "
            f"tensor_parallel {tp} / pipeline_parallel {pp})"
        )
        e.append(
            f"parallel.fsdp.replicate_degree={r} does not divide {of}; use a divisor of it "
            f"(usually the number of nodes)"
        )
    g, mb, dp = cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size // split
    if g is not None and g % (mb * dp):
        e.append(
            f"train.global_batch_size={g} is not divisible by train.micro_batch_size={mb} x "
            f"{'world size' if split == 1 else 'data-parallel degree'} {dp} = {mb * dp}; pick a "
            f"global batch that is a multiple of {mb * dp} or change micro_batch_size"
        )
    accum = cfg.train.grad_accum if g is None or g % (mb * dp) else g // (mb * dp)
    ddp = backend == "ddp" or (backend == "auto" and world_size > 1)
    if ddp and cfg.parallel.ddp.static_graph and accum > 1:
        e.append(
            f"parallel.ddp.static_graph=true with grad_accum {accum}: torch's DDP fails an "
            f"internal assert at the first step when its static graph meets the micro-steps "
            f"that skip the all-reduce (no_sync); set parallel.ddp.static_graph=false, or "
            f"train.grad_accum=1"
        )
    return e
