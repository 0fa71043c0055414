"""The precision policy, in one place: bf16 autocast, fp16 autocast + GradScaler, or fp32."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from scale_llm.errors import UserError

log = logging.getLogger(__name__)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Precision:
    name: str  # bf16 | fp16 | fp32 (never auto: that is resolved against the device)
    device_type: str

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """fp16: dynamic loss scaling. bf16 / fp32 (fp32's exponent range): no scaling, only the
        scaler's check that skips a step whose gradients are not finite."""
        if self.name == "fp16":
            return torch.amp.GradScaler(self.device_type)
        return StepGuard(self.device_type)


class StepGuard(torch.amp.GradScaler):
    """A GradScaler held at scale 1: losses and gradients are multiplied by exactly 1.0, and the
    inf / NaN check in `unscale_` still makes `step` skip a step with non-finite gradients."""

    def __init__(self, device_type: str):
        super().__init__(device_type, init_scale=1.0, growth_interval=2**31 - 1)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        super().update(1.0)


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """`auto` means bf16 on a bf16-capable GPU and fp32 on CPU (CPUs without AMX emulate bf16)."""
    if requested == "auto":
        bf16_gpu = device.type == "cuda" and torch.cuda.is_bf16_supported()
        name = "bf16" if bf16_gpu else "fp32"
    else:
        name = requested
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(
            "train.precision=bf16 but this GPU has no bf16 support; use "
            "train.precision=fp16 (with loss scaling) or fp32"
        )
    if name != "fp32" and device.type == "cpu":
        log.warning(
            "train.precision=%s on CPU: autocast works but is usually slower than "
            "fp32 on CPUs without native bf16/fp16 matmuls",
            name,
        )
    return Precision(name, device.type)
