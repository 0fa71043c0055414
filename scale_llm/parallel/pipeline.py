"""Pipeline parallelism (`parallel.pipeline_parallel`) on torch.distributed.pipelining.

The blocks are cut into consecutive stages over the mesh's `pp` dimension. Each rank keeps its
stages of the meta model after TP, checkpointing and compile, before FSDP2 shards each stage
(torchtitan's order). Blocks keep their one-process names (`layers.7...`): checkpoints do not
depend on the pipeline degree. Numerics are one process's: a piece's loss is its token mean over
(pieces x grad_accum), the schedule's own scaling off, the gradient norm reduced over the stages
before the one clip. Evaluation and samples run the stages' forwards in order; the last stage
sends every rank the loss or the logits a sample reads (calling the model gives every rank all).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.checkpoint import GraphExecGroup

from scale_llm.components.loss import cross_entropy
from scale_llm.config.parallel import V_SCHEDULES
from scale_llm.config.plan import RunPlan
from scale_llm.model import Transformer
from scale_llm.parallel.fsdp import FSDPBackend
from scale_llm.parallel.tensor_parallel import full_logits

SCHEDULES = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
    "looped_bfs": ScheduleLoopedBFS,
}


def stage_blocks(n_layers: int, stages: int, layers_per_stage: int | None) -> list[range]:
    """The blocks of each stage: `layers_per_stage` each, or balanced: every stage one block,
    then each further block to the stage that costs least so far, the embedding and the
    output head (with its loss) each counted as one block (torchtitan weighs them alike)."""
    if layers_per_stage is not None:
        counts = [layers_per_stage] * stages
    else:
        counts = [1] * stages
        extra = [(s == 0) + (s == stages - 1) for s in range(stages)]  # embedding, head
        for _ in range(n_layers - stages):
            cheapest = min(range(stages), key=lambda s: (counts[s] + extra[s], -s))
            counts[cheapest] += 1
    starts = [sum(counts[:s]) for s in range(stages)]
    return [range(start, start + n) for start, n in zip(starts, counts, strict=True)]


def stage_owner(stage: int, plan: RunPlan, schedule: str) -> int:
    """The pipeline rank holding `stage`: looped (stage s on rank s mod pp) or, for the V
    schedules, down and back up (rank r holds stages r and 2 pp - 1 - r)."""
    pp = plan.pp_degree
    if schedule in V_SCHEDULES and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


class Stage(nn.Module):
    """One pipeline stage of a Transformer: its blocks under their one-process names, the
    embedding if first, the final norm and head if last. Between stages the residual stream
    travels as a plain tensor (this rank's sequence part under sequence parallelism)."""

    def __init__(self, model: Transformer, blocks: range, first: bool, last: bool, tp_mesh=None):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in blocks})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.rope = model.rope  # (a bound method: the table cache, not a submodule)
        self.tp_mesh, self.sequence_parallel, self.split_backward = tp_mesh, False, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else self._arrived(x)
        rope = self.rope(0, h.size(1), h.device)  # (h's global shape under tensor parallelism)
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is not None:
            return F.linear(self.norm(h), self.output.weight)  # (as Transformer.forward)
        if isinstance(h, DTensor):
            # a split backward detaches each stage's output in place (torch's
            # stage_backward_input), which the view to_local() returns refuses
            return h.to_local().clone() if self.split_backward else h.to_local()
        return h

    def _arrived(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream from the previous stage, as the blocks take it."""
        if self.tp_mesh is None:
            return x
        layout = Shard(1) if self.sequence_parallel else Replicate()
        return DTensor.from_local(x, self.tp_mesh, [layout], run_check=False)


class PipelinedModel(nn.Module):
    """This rank's stages under one-process names (what the optimizer, the checkpoint and the
    trainer see); calling it runs every stage's forward in order across the pipeline ranks
    (evaluation, samples) and returns the logits on every rank."""

    def __init__(self, stages: dict[int, Stage], plan: RunPlan, schedule: str, group) -> None:
        super().__init__()
        held = list(stages.values())
        for name in ("tok_embeddings", "norm", "output"):
            found = [getattr(s, name) for s in held if getattr(s, name) is not None]
            setattr(self, name, found[0] if found else None)
        self.layers = nn.ModuleDict({k: b for s in held for k, b in s.layers.items()})
        self.stages = stages  # (a plain dict: the modules are registered above, once)
        self.plan, self.schedule, self.group = plan, schedule, group
        self.n_stages = plan.pp_degree * plan.pp_stages_per_rank

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last stage's logits broadcast to every pipeline rank (as a DTensor sharded over
        the vocabulary again where tensor parallelism made them one)."""
        logits, src = self.through_stages(tokens)
        local = self.broadcast(logits.to_local() if isinstance(logits, DTensor) else logits, src)
        if self.plan.pp_rank == src:
            return logits
        mesh = next(iter(self.stages.values())).tp_mesh
        return local if mesh is None else DTensor.from_local(local, mesh, [Shard(-1)])

    def through_stages(self, tokens: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        """(the logits on the last stage's pipeline rank, None elsewhere; that rank)."""
        owners = [stage_owner(s, self.plan, self.schedule) for s in range(self.n_stages)]
        x = tokens
        for s, here in enumerate(owners):
            if here == self.plan.pp_rank:
                x = self.stages[s](x)
            if s + 1 < len(owners) and owners[s + 1] != here:
                x = self._pass(x, here, owners[s + 1])
        return (x if here == self.plan.pp_rank else None), here

    def _rank(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def _pass(self, x: torch.Tensor | None, src: int, dst: int) -> torch.Tensor | None:
        """x from pipeline rank `src` to `dst` (its shape and dtype first); None elsewhere."""
        me = self.plan.pp_rank
        if me == src:
            dist.send(_header(x, x.device), self._rank(dst), group=self.group)
            dist.send(x.contiguous(), self._rank(dst), group=self.group)
        elif me == dst:
            header = _header(None, self.plan.device)
            dist.recv(header, self._rank(src), group=self.group)
            x = _empty_like_header(header, self.plan.device)
            dist.recv(x, self._rank(src), group=self.group)
        return x if me in (src, dst) else None

    def broadcast(self, x: torch.Tensor | None, src: int) -> torch.Tensor:
        """Pipeline rank `src`'s plain tensor `x` on every pipeline rank (its shape first)."""
        mine, device = self.plan.pp_rank == src, self.plan.device
        header = _header(x if mine else None, device)
        dist.broadcast(header, self._rank(src), group=self.group)
        x = x.contiguous() if mine else _empty_like_header(header, device)
        dist.broadcast(x, self._rank(src), group=self.group)
        return x


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _header(x: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(dtype index, ndim, *shape) in 8 int64s, zeros for a receiver to fill: what it allocates
    (on the device: NCCL sends device tensors only)."""
    values = [] if x is None else [_DTYPES.index(x.dtype), x.dim(), *x.shape]
    return torch.tensor(values + [0] * (8 - len(values)), dtype=torch.int64, device=device)


def _empty_like_header(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    dtype, ndim, *shape = header.tolist()
    return torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)


class WeightGroupedStage(PipelineStage):
    """torch's stage with a split backward's weight half run as one `GraphExecGroup` (torch
    2.13): its one autograd call per weight group (7 a block) would each recompute a checkpointed
    block and keep what it does not read; in one group a block is recomputed once. (Selective
    checkpointing still fails under the V schedules: its cache serves one recomputation only.)"""

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        with GraphExecGroup():
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)


def pipeline_stages(
    stages: dict[int, Stage], n_stages: int, device: torch.device, group=None
) -> list[PipelineStage]:
    """torch's stages over this rank's `stages` (of `n_stages`), in order."""
    return [
        WeightGroupedStage(module, s, n_stages, device, group=group)
        for s, module in sorted(stages.items())
    ]


class PipelineBackend(FSDPBackend):
    """FSDP2 (and tensor parallelism) within each pipeline stage, the schedule across them."""

    @property
    def donates_buffers(self) -> bool:
        """Not under a V schedule: a split backward's input half keeps each compiled block's
        graph for its weight half (retain_graph), which a donating backward refuses."""
        return self.cfg.parallel.pipeline.schedule not in V_SCHEDULES

    def wrap(self, model: Transformer, initial_weights: Mapping | None = None) -> nn.Module:
        pipe, plan = self.cfg.parallel.pipeline, self.plan
        self.parallelize(model)  # the whole meta model: TP, checkpointing, compile per block
        n_stages = plan.pp_degree * plan.pp_stages_per_rank
        blocks = stage_blocks(model.cfg.n_layers, n_stages, pipe.layers_per_stage)
        tp_mesh = self.device_mesh()["tp"] if self.tp > 1 else None
        split, sp = pipe.schedule in V_SCHEDULES, self.cfg.parallel.sequence_parallel
        stages = {}
        for s in range(n_stages):
            if stage_owner(s, plan, pipe.schedule) == plan.pp_rank:
                stage = Stage(model, blocks[s], s == 0, s == n_stages - 1, tp_mesh)
                stage.sequence_parallel, stage.split_backward = sp, split
                # the V schedules run a backward's weight half after its input half: the
                # gathered weights must stay until then (resharded, the weight half read freed
                # storage: wrong gradients on 2 gloo ranks)
                self.shard(stage, False if split else None)
                stages[s] = stage.to_empty(device=self.storage_device())
        group = self.device_mesh()["pp"].get_group()
        wrapped = PipelinedModel(stages, plan, pipe.schedule, group)
        self._fill_shards(wrapped, initial_weights, whole=model)
        self.schedule = self._schedule(stages, n_stages, group)
        return wrapped

    def _schedule(self, stages: dict[int, Stage], n_stages: int, group):
        """torch's schedule over this rank's stages; the loss scaled here, not by it."""
        pipe_stages = pipeline_stages(stages, n_stages, self.plan.device, group)
        cls = SCHEDULES[self.cfg.parallel.pipeline.schedule]
        return cls(
            pipe_stages[0] if issubclass(cls, PipelineScheduleSingle) else pipe_stages,
            n_microbatches=self.plan.pp_microbatches,
            loss_fn=self._piece_loss,
            scale_grads=False,
        )

    def _piece_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A piece's share of the step's token-mean loss: its mean over pieces x grad_accum.
        Under TP the logits are gathered whole first: the stages' backward fails with the parallel
        loss (torch 2.13: 'nll_loss_backward got mixed torch.Tensor and DTensor')."""
        fn, whole = (cross_entropy, full_logits(logits)) if self.tp > 1 else (self.loss_fn, logits)
        loss = fn(whole, targets) / (self.plan.pp_microbatches * self.accum)
        return loss if self.scale is None else loss * self.scale  # (fp16: the scaler's)

    def forward_backward(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, accum: int
    ) -> torch.Tensor:
        """One micro-batch through the schedule (its pieces' forwards and backwards); returns
        its loss / accum on every rank (summed over the stages: the last one has it)."""
        self.accum, losses, device = accum, [], inputs.device
        self.scale = None  # fp16: the scaler's factor, made on every stage (each unscales its own)
        if self.scaler is not None:
            self.scale = self.scaler.scale(torch.ones((), device=device))
        self.schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
        loss = torch.zeros((), device=device)
        for piece in losses:  # (the last stage's pieces; none elsewhere)
            loss += piece.detach().float().reshape(())
        if self.scale is not None:
            loss /= self.scale
        dist.all_reduce(loss, group=self.model.group)
        return loss

    def sync_context(self, sync_gradients: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # each stage reduce-scatters after its schedule run

    def eval_loss(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """The last stage computes the loss and sends that scalar, not the (B, T, V) logits."""
        logits, src = model.through_stages(inputs)
        loss = torch.zeros((), device=inputs.device)
        if logits is not None and rows:
            part = logits if rows == len(inputs) else logits[:rows]
            loss = self.loss_fn(part, targets[:rows]) * rows
            loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).float()
        return model.broadcast(loss.reshape(1), src)[0]

    def next_token_logits(
        self, model: nn.Module, window: torch.Tensor, position: int
    ) -> torch.Tensor:
        """The last stage sends the one position's whole (V,) logits a sample reads."""
        logits, src = model.through_stages(window)
        row = None if logits is None else self.logits_for_sampling(logits)[0, position]
        return model.broadcast(row, src)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global norm over every stage's gradients (the stages' squares summed), then one
        clip with it: the one-process norm, the same on every rank."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        square = norm.float() ** 2
        dist.all_reduce(square, group=self.model.group)
        norm = square.sqrt()
        if self.scaler is not None:  # fp16: a stage that overflowed skips the step everywhere
            state = self.scaler._per_optimizer_states[id(self.optimizer)]
            for found in state["found_inf_per_device"].values():
                found.copy_(torch.maximum(found, (~torch.isfinite(norm)).float()))
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm
