"""Readings of the device a rank runs on: peak FLOP/s for MFU, peak CUDA memory; and how a CPU
run keeps the memory it frees. Peaks are dense tensor-core FLOP/s per GPU from data sheets
(fp32: the non-tensor rate), matched as whole words in order: "H100 PCIe" before "H100".
"""

from __future__ import annotations

import ctypes
import os
import re
import sys

import torch

T = 1e12
# (name fragment, {precision: dense peak FLOP/s}); first match wins
PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756 * T, "fp16": 756 * T, "fp32": 51 * T}),
    ("H100 NVL", {"bf16": 835 * T, "fp16": 835 * T, "fp32": 60 * T}),
    ("H100", {"bf16": 989 * T, "fp16": 989 * T, "fp32": 67 * T}),  # SXM5
    ("H200 NVL", {"bf16": 835 * T, "fp16": 835 * T, "fp32": 60 * T}),
    ("H200", {"bf16": 989 * T, "fp16": 989 * T, "fp32": 67 * T}),  # SXM
    ("A100", {"bf16": 312 * T, "fp16": 312 * T, "fp32": 19.5 * T}),  # 40 and 80 GB, SXM / PCIe
    ("L40S", {"bf16": 362 * T, "fp16": 362 * T, "fp32": 91.6 * T}),
    ("L40", {"bf16": 181 * T, "fp16": 181 * T, "fp32": 90.5 * T}),
    ("L4", {"bf16": 121 * T, "fp16": 121 * T, "fp32": 30.3 * T}),
    ("RTX 4090", {"bf16": 165 * T, "fp16": 165 * T, "fp32": 82.6 * T}),  # fp32 accumulate
    ("RTX A6000", {"bf16": 155 * T, "fp16": 155 * T, "fp32": 38.7 * T}),
    ("MI300X", {"bf16": 1307 * T, "fp16": 1307 * T, "fp32": 163.4 * T}),
]


def peak_flops(
    device: torch.device, precision: str = "bf16", override_tflops: float | None = None
) -> float | None:
    """Dense peak FLOP/s of `device` in `precision` (`override_tflops` wins); None: unknown."""
    if override_tflops:
        return override_tflops * T
    if device.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(device), precision)


def peak_for_name(name: str, precision: str) -> float | None:
    for fragment, peaks in PEAKS:
        if re.search(rf"(?<!\w){re.escape(fragment)}(?!\w)", name):
            return peaks.get(precision)
    return None


def cuda_memory_gib(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {
        "peak_alloc_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
    }


def host_available_bytes() -> int | None:
    """MemAvailable of this host (Linux /proc/meminfo), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError, StopIteration):
        return None


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def keep_freed_cpu_memory() -> bool:
    """Let glibc keep the CPU memory a step frees for the next, as CUDA's caching allocator
    does: by default large allocations get fresh pages and each step pays a page fault per 4 KiB
    (docs/performance.md). Left alone where the user chose (_MALLOC_ENV,
    SCALE_LLM_CPU_MALLOC=system) and off glibc; True if it was set."""
    if os.environ.get("SCALE_LLM_CPU_MALLOC") == "system":
        return False
    if sys.platform != "linux" or any(os.environ.get(k) for k in _MALLOC_ENV):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, 1 << 30) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
