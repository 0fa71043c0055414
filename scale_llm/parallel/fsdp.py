"""FSDP2 (`fully_shard`, HSDP with replicate_degree > 1): parameters, gradients and optimizer
state sharded over ranks, wrapped on the meta device in torchtitan's order; each rank fills its
own shards from run.seed (`_fill_shards`), so no host holds the whole model."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor.parallel import loss_parallel

from scale_llm.components.checkpoint import fill_block
from scale_llm.model import Transformer
from scale_llm.parallel.backend import Backend
from scale_llm.parallel.tensor_parallel import (
    apply_tensor_parallel,
    full_logits,
    parallel_cross_entropy,
)


class FSDPBackend(Backend):
    def __init__(self, cfg, plan):
        super().__init__(cfg, plan)
        self.tp = plan.tp_degree
        self.mesh: DeviceMesh | None = None
        if self.tp > 1:
            self.loss_fn = parallel_cross_entropy  # over the vocab shards

    def device_mesh(self) -> DeviceMesh:
        """The run plan's mesh: (pp,) (replicate,) shard (, tp), built once."""
        if self.mesh is None:
            layout = self.plan.mesh
            self.mesh = init_device_mesh(
                self.plan.device.type, tuple(layout["shape"]), mesh_dim_names=tuple(layout["names"])
            )
            within = self._mesh_without("pp")  # what a stage's parameters live on
            if within.ndim > 1:  # a reduction over every dimension (the gradient norm's)
                within._flatten("all")  # then runs as one collective, not one per dimension
        return self.mesh

    def _mesh_without(self, *dims: str) -> DeviceMesh:
        mesh = self.device_mesh()
        names = tuple(n for n in mesh.mesh_dim_names if n not in dims)
        return mesh[names] if len(names) < mesh.ndim else mesh

    def mp_policy(self) -> MixedPrecisionPolicy:
        if self.precision.name == "fp32":
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.precision.dtype, reduce_dtype=torch.float32)

    def wrap(self, model: Transformer, initial_weights: Mapping | None = None) -> nn.Module:
        self.parallelize(model)
        self.shard(model)
        model.to_empty(device=self.storage_device())
        self._fill_shards(model, initial_weights)
        return model

    def parallelize(self, model: Transformer) -> None:
        """On the meta device: tensor parallelism, then checkpointing and compile per block."""
        if self.tp > 1:
            mesh = self.device_mesh()["tp"]
            apply_tensor_parallel(model, mesh, self.cfg.parallel.sequence_parallel)
        self.transform_blocks(model)

    def shard(self, module: nn.Module, reshard_after_forward: bool | None = None) -> None:
        """fully_shard on each block of `module` (a model or a pipeline stage), then on it."""
        opts = self.cfg.parallel.fsdp
        if reshard_after_forward is None:
            reshard_after_forward = opts.reshard_after_forward
        common = dict(
            mesh=self._mesh_without("tp", "pp"),  # what FSDP shards (and HSDP replicates) over
            mp_policy=self.mp_policy(),
            offload_policy=CPUOffloadPolicy() if opts.cpu_offload else OffloadPolicy(),
        )
        layers = module.layers
        blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
        for i, block in enumerate(blocks):
            # the last block's params are needed again at once by backward: keep them gathered
            last = i == len(blocks) - 1
            fully_shard(block, reshard_after_forward=reshard_after_forward and not last, **common)
        fully_shard(module, reshard_after_forward=reshard_after_forward, **common)

    def storage_device(self) -> torch.device | str:
        return "cpu" if self.cfg.parallel.fsdp.cpu_offload else self.plan.device

    def _fill_shards(
        self, model: nn.Module, initial: Mapping | None, whole: Transformer | None = None
    ) -> None:
        """Each rank fills its own shards one whole parameter at a time: drawn from run.seed as
        the `whole` model's `init_fills` (other pipeline stages' drawn and dropped), or read
        from `initial`. No host holds more than its shards and one full fp32 parameter."""
        params = dict(model.named_parameters())
        if initial is None:
            whole = whole or model
            shapes = {name: p.shape for name, p in whole.named_parameters()}
            torch.manual_seed(self.cfg.run.seed)
            for name, fill in whole.init_fills():
                full = torch.empty(shapes[name])  # fp32 on the CPU, as one process draws
                fill(full)
                if name in params:
                    fill_block(params[name], full)
        else:
            for name, param in params.items():
                fill_block(param, initial[name])

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the MixedPrecisionPolicy casts params for compute

    def sync_context(self, sync_gradients: bool) -> contextlib.AbstractContextManager:
        every = self.cfg.parallel.fsdp.reduce_every_micro_step
        self.model.set_requires_gradient_sync(sync_gradients or every)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        with loss_parallel() if self.tp > 1 else contextlib.nullcontext():  # (vocab shards)
            super().backward(loss)

    def logits_for_sampling(self, logits: torch.Tensor) -> torch.Tensor:
        return full_logits(logits)
