"""The process group (NCCL on CUDA, gloo on the CPU) started from the run plan, and small helpers.

Collectives fail fast and leave a trace, as torchtitan's do: NCCL's flight recorder writes each
rank's last collectives when one times out (`COMM_ENV`), a failed collective aborts the process,
and the timeout is long until the first step is done and short after it (`shorten_timeouts`).
Every setting is an environment variable a user may set first."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from scale_llm.components.hardware import keep_freed_cpu_memory
from scale_llm.errors import UserError
from scale_llm.files import remove_temporary_folders

if TYPE_CHECKING:
    from scale_llm.config.plan import RunPlan

log = logging.getLogger(__name__)

_JOINED_MULTI_PROCESS = False  # this process has been part of a group of several


def deepspeed_on(device: torch.device) -> None:
    """DeepSpeed picks its accelerator at import: the CPU's for a CPU run (before `import`)."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def joined_multi_process() -> bool:
    """Whether this process joined a group of several ranks (the CLI then skips the interpreter
    teardown gloo has been seen to abort in)."""
    return _JOINED_MULTI_PROCESS


# torch's NCCL settings a run starts with, each kept when already set
COMM_ENV = {
    "TORCH_FR_BUFFER_SIZE": "20000",  # the flight recorder: each rank's last collectives
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # ... written out when a collective times out
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed collective ends the process (torchrun's)
}
START_TIMEOUT_MIN, STEP_TIMEOUT_MIN = 30.0, 10.0  # (SCALE_LLM_PG_TIMEOUT_MIN, _STEP_TIMEOUT_MIN)


TRACE_FILE = "TORCH_FR_DUMP_TEMP_FILE"  # the flight recorder's files: this prefix + the rank
_GIVEN = {k: os.environ[k] for k in (*COMM_ENV, TRACE_FILE) if k in os.environ}  # (the user's)


def comm_environment(trace_prefix: str | None) -> dict[str, str]:
    """COMM_ENV, with the flight recorder's files at `trace_prefix` + rank (the run dir's
    comm_trace/rank); what the environment held when the process started wins."""
    wanted = {**COMM_ENV, **({TRACE_FILE: trace_prefix} if trace_prefix else {})}
    return {**wanted, **_GIVEN}


def timeout_minutes(name: str, default: float) -> datetime.timedelta:
    """The timeout environment variable `name` sets (minutes above 0), else `default`."""
    minutes = os.environ.get(name, str(default))
    try:
        timeout = datetime.timedelta(minutes=float(minutes))
        if timeout <= datetime.timedelta(0):
            raise ValueError
    except (ValueError, OverflowError):  # not a number, inf or nan, zero or negative
        raise UserError(
            f"{name}={minutes!r} is not a number of minutes above 0; unset it ({default:g}) or "
            f"set e.g. 60"
        ) from None
    return timeout


_step_timeout: datetime.timedelta | None = None  # set by `shorten_timeouts`


def shorten_timeouts() -> datetime.timedelta | None:
    """After the first step: every process group of this rank times out after
    SCALE_LLM_STEP_TIMEOUT_MIN (a stuck collective is found in minutes, not half an hour)."""
    global _step_timeout
    if not is_distributed():
        return None
    _step_timeout = timeout_minutes("SCALE_LLM_STEP_TIMEOUT_MIN", STEP_TIMEOUT_MIN)
    _set_timeouts(_step_timeout)
    return _step_timeout


@contextlib.contextmanager
def start_timeouts() -> Iterator[None]:
    """The start-up timeout for a while (the other ranks wait while rank 0 runs eval.tasks or
    writes a file of minutes), the step timeout again afterwards."""
    if _step_timeout is None or not is_distributed():
        yield
        return
    _set_timeouts(timeout_minutes("SCALE_LLM_PG_TIMEOUT_MIN", START_TIMEOUT_MIN))
    try:
        yield
    finally:
        _set_timeouts(_step_timeout)


def _set_timeouts(timeout: datetime.timedelta) -> None:
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def start(plan: RunPlan, cpu_collectives: bool = False, trace_prefix: str | None = None) -> None:
    """Select this rank's device and, for every backend but `single`, join the plan's process
    group. `cpu_collectives`: a CUDA run that also reduces CPU tensors (FSDP2's CPU offload)
    gets gloo for those next to NCCL, as torchtitan does."""
    if plan.device.type == "cuda":
        torch.cuda.set_device(plan.device)
    elif plan.device.type == "cpu":
        keep_freed_cpu_memory()
    if plan.backend == "single":
        return
    deepspeed_on(plan.device)
    world = plan.world_size
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if world > 1:
            raise UserError(
                "WORLD_SIZE > 1 but MASTER_PORT is not set; start multi-process "
                "runs with torchrun, the deepspeed launcher or launch/*.sh"
            )
        with socket.socket() as s:  # a free port
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.setdefault("RANK", str(plan.rank))
    os.environ.setdefault("LOCAL_RANK", str(plan.local_rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    if dist.is_initialized():
        return
    pg_backend = "nccl" if plan.device.type == "cuda" else "gloo"
    if pg_backend == "nccl" and cpu_collectives:
        pg_backend = "cuda:nccl,cpu:gloo"  # NCCL alone: "No backend type associated with cpu"
    timeout = timeout_minutes("SCALE_LLM_PG_TIMEOUT_MIN", START_TIMEOUT_MIN)
    timeout_minutes("SCALE_LLM_STEP_TIMEOUT_MIN", STEP_TIMEOUT_MIN)  # (checked before any work)
    os.environ.update(comm_environment(trace_prefix))  # (read when the group is made)
    port = os.environ.get("MASTER_PORT", "")
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise UserError(
            f"MASTER_PORT={port!r} is not a port number (1-65535); unset it or let the "
            f"launcher set it"
        )
    where = f"{os.environ['MASTER_ADDR']}:{port}"
    if world > 1:
        _say_what_we_wait_for(plan, timeout, where)
    # A world of one keeps its store in memory: TCPStore binds every interface, whatever MASTER_ADDR
    try:
        store = dist.HashStore() if world == 1 else _restart_safe_store(world, timeout)
        dist.init_process_group(
            pg_backend,
            store=store,
            rank=plan.rank,
            world_size=world,
            timeout=timeout,
            device_id=plan.device if plan.device.type == "cuda" else None,
        )
    except (dist.DistStoreError, dist.DistNetworkError) as e:
        raise UserError(
            f"the process group of {world} processes did not form at {where} "
            f"({str(e).splitlines()[0]}); start every rank with torchrun, the deepspeed "
            f"launcher or launch/*.sh, or unset WORLD_SIZE and RANK for a one-process run"
        ) from None
    global _JOINED_MULTI_PROCESS
    _JOINED_MULTI_PROCESS = _JOINED_MULTI_PROCESS or world > 1
    log.info("dist: %d processes, %s process group, device %s", world, pg_backend, plan.device)


def _say_what_we_wait_for(plan: RunPlan, timeout: datetime.timedelta, where: str) -> None:
    """Joining blocks until every rank arrives: routine under a launcher (INFO), a warning
    without one (a leftover WORLD_SIZE: nobody else will come)."""
    # torchrun, mpirun, srun, DeepSpeed's launcher (its launch.py sets CROSS_RANK)
    launchers = ("TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "CROSS_RANK")
    launched = any(k in os.environ for k in launchers)
    launched = launched or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    message = (
        "dist: rank %d waits for %d processes to join at %s (gives up after %.3g min; "
        "SCALE_LLM_PG_TIMEOUT_MIN)"
    )
    args = (plan.rank, plan.world_size, where, timeout.total_seconds() / 60)
    if launched:
        log.info(message, *args)
    else:
        log.warning(
            message + "; no launcher seen: if no other process was started, this WORLD_SIZE=%d "
            "is left over from another job: unset WORLD_SIZE and RANK for a one-process run",
            *args,
            plan.world_size,
        )


def _restart_safe_store(world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, the agent's store with this restart attempt's own key prefix (a shared
    one lets a restarted peer read the previous attempt's rank-0 address: "Connection refused",
    pytorch/pytorch#167288); None outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=world,
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"scale_llm/attempt_{attempt}", agent)


def shutdown_distributed(clean: bool = True) -> None:
    """Leave the process group; after a failure, without waiting for ranks that may be stuck."""
    if is_distributed():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def exit_without_teardown(code: int) -> None:
    """End a process that was in a process group: gloo worlds have aborted in interpreter
    shutdown after all their work (SIGABRT, "terminate called without an active exception"),
    so logs and output are flushed, temporary folders removed and the interpreter's teardown
    skipped."""
    remove_temporary_folders()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size; (0, 1) without a process group."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Every rank of `group` (default: the whole world) meets here; nothing in one process."""
    if is_distributed():
        dist.barrier(group=group)


def first_failed_rank(failed: bool, group: dist.ProcessGroup | None = None) -> int | None:
    """The lowest rank of `group` where `failed` holds (None: none does; one process: its own
    verdict). A barrier that carries each rank's outcome, so that all stop together."""
    if not is_distributed():
        return 0 if failed else None
    world, cuda = dist.get_world_size(group), "gloo" not in str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mine = dist.get_rank(group) if failed else world
    flag = torch.tensor([mine], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return None if (first := int(flag.item())) == world else first


def side_group() -> dist.ProcessGroup | None:
    """A gloo group for collectives off the main thread (a background checkpoint write), which
    on the main group could interleave with the step's; None in one process."""
    return dist.new_group(backend="gloo") if is_distributed() else None


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a scalar tensor over all ranks (itself when not distributed)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return value
    value = value.detach().clone().float()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()
