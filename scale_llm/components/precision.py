"""The precision policy, in one place: bf16 autocast, fp16 autocast + GradScaler, or fp32.

Which precision a run uses is decided by `scale_llm.plan` (precision `auto`); this module says
what each one means for the forward pass and the gradients."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Precision:
    name: str  # bf16 | fp16 | fp32 (never auto: scale_llm.plan resolves that)
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
