"""The precision policy, in one place: bf16 autocast, fp16 autocast + GradScaler, or fp32 (which
one a run uses, the run plan decides)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Precision:
    name: str  # bf16 | fp16 | fp32 (never auto: scale_llm.config.plan resolves that)
    device_type: str

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16: dynamic loss scaling; bf16 / fp32 have fp32's exponent range: no scaler (the
        clipping norm catches a non-finite step)."""
        return torch.amp.GradScaler(self.device_type) if self.name == "fp16" else None
