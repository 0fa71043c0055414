"""Where this process runs: the one place that chooses the device and process group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scale_llm.errors import UserError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def select_device(requested: str) -> torch.device:
    """`auto`: the CUDA GPU when one is visible, else the CPU."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "train.device=cuda but no CUDA GPU is visible to PyTorch; use "
            "train.device=auto or cpu (or install a CUDA build of torch)"
        )
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def single_process(requested_device: str) -> DistInfo:
    return DistInfo(rank=0, local_rank=0, world_size=1, device=select_device(requested_device))
