"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced once per
step (non-final micro-steps under `no_sync()`), so the local norm is the global one."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scale_llm.model import Transformer
from scale_llm.parallel.backend import Backend


class DDPBackend(Backend):
    def wrap(self, model: Transformer, initial_weights: Mapping | None = None) -> nn.Module:
        if self.compile:
            # Dynamo's DDPOptimizer would split each compiled block at bucket borders; blocks
            # compiled one by one already overlap a block's all-reduce with the next backward,
            # and a split costs fusion and saved activations: one graph per block
            torch._dynamo.config.optimize_ddp = False
        model = super().wrap(model, initial_weights)
        opts, device = self.cfg.parallel.ddp, self.plan.device
        self.zero_grads_in_place = opts.gradient_as_bucket_view
        return DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=opts.bucket_cap_mb,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
            static_graph=opts.static_graph,
        )

    def sync_context(self, sync_gradients: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if sync_gradients else self.model.no_sync()
