"""Where this process runs: the one place that chooses the device and starts the process group.

CUDA + NCCL where a GPU is visible, else CPU + gloo. Rank, local rank and world size come from
the launcher's environment (torchrun, the deepspeed launcher and srun + torchrun all set RANK,
LOCAL_RANK and WORLD_SIZE); without them this is a world of one.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from scale_llm.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def launch_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as set by the launcher; (0, 0, 1) when run directly."""
    try:
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise UserError(
            f"RANK / LOCAL_RANK / WORLD_SIZE must be integers ({e}); start "
            f"multi-process runs with the scripts in launch/"
        ) from None
    return rank, local_rank, world


def select_device(requested: str, local_rank: int = 0) -> torch.device:
    """`auto`: this rank's CUDA GPU when one is visible, else the CPU."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "train.device=cuda but no CUDA GPU is visible to PyTorch; use "
            "train.device=auto or cpu (or install a CUDA build of torch)"
        )
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def single_process(requested_device: str) -> DistInfo:
    return DistInfo(rank=0, local_rank=0, world_size=1, device=select_device(requested_device))


def init_distributed(backend: str, requested_device: str) -> DistInfo:
    """Pick the device and, for every backend but `single`, join (or start) the process group."""
    rank, local_rank, world = launch_env()
    device = select_device(requested_device, local_rank)
    if backend == "single":
        return DistInfo(0, 0, 1, device)
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede `import deepspeed`
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if world > 1:
            raise UserError(
                "WORLD_SIZE > 1 but MASTER_PORT is not set; start multi-process "
                "runs with torchrun, the deepspeed launcher or launch/*.sh"
            )
        os.environ["MASTER_PORT"] = str(_free_port())
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    if not dist.is_initialized():
        pg_backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(minutes=int(os.environ.get("SCALE_LLM_PG_TIMEOUT_MIN", "30")))
        # A world of one keeps its store in memory: no TCP listener at all (torch's TCPStore
        # binds every interface whatever MASTER_ADDR says).
        store = dist.HashStore() if world == 1 else _restart_safe_store(world, timeout)
        dist.init_process_group(
            pg_backend,
            store=store,
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        log.info("dist: %d processes, %s process group, device %s", world, pg_backend, device)
    return DistInfo(rank, local_rank, world, device)


def _restart_safe_store(world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, the agent's store with this restart attempt's own key prefix.

    torchrun hands every restart attempt the same shared TCPStore without a per-attempt prefix,
    so after `--max-restarts` brings a dead rank back, a peer can read the previous attempt's
    gloo/NCCL address of rank 0 and fail with "Connection refused" (seen on torch 2.13; compare
    pytorch/pytorch#167288). None (plain env:// rendezvous) outside torchrun.
    """
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
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a scalar tensor over all ranks (itself when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    value = value.detach().clone().float()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
