"""Readings of the device a rank runs on: peak FLOP/s for MFU, peak CUDA memory."""

from __future__ import annotations

import torch

# bf16 dense peak FLOP/s per GPU, for MFU. Unknown devices (and CPUs) report no MFU.
_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "A6000": 155e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in _PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


def cuda_memory_gib(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {
        "peak_alloc_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
    }
