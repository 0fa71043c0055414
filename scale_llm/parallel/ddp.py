"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced.

Accumulation: non-final micro-steps run under `no_sync()`, so gradients are reduced once per
optimizer step. After the reduction every rank holds the same gradients, so the local norm is the
global norm and the optimizer state is replicated (torch.distributed.checkpoint writes it once).
"""

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
            # Dynamo's DDPOptimizer would split each compiled block at gradient-bucket borders
            # (3 graphs per 400m block at 25 MB buckets) so that a bucket's all-reduce can start
            # inside the block's backward. Blocks are compiled one by one already, so the
            # all-reduce of a block's buckets overlaps the backward of the block below it; a
            # split costs fusion across its borders and activations saved at them, for overlap
            # finer than one block that buys little. One graph per block.
            torch._dynamo.config.optimize_ddp = False
        model = super().wrap(model, initial_weights)
        opts = self.cfg.parallel.ddp
        device = self.plan.device
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
