"""Tensor and sequence parallelism on DTensor (`parallel.tensor_parallel`), Megatron-LM's layout
(docs/backends.md). The residual stream stays a DTensor between and inside blocks: a compiled
block whose borders convert to local tensors got wrong gradients (torch 2.13)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from scale_llm.model import Transformer
from scale_llm.parallel.fp8 import tp_styles


def apply_tensor_parallel(model: Transformer, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard `model`'s layers over `mesh` (1-D: the tp ranks) in place (on the meta device)."""
    tp = mesh.size()
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    norm = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    for block in model.layers:
        styles = tp_styles(block, mesh)  # (torchao's Float8 styles, for fp8 on GPUs)
        plan = block_plan(*styles, stream)
        parallelize_module(block, mesh, {**plan, **(norm if sequence_parallel else {})})
        if not sequence_parallel:  # the norms read the whole (replicated) residual stream
            _replicate_parameters(block.attention_norm, mesh)
            _replicate_parameters(block.ffn_norm, mesh)
        # a block's input arrives from the embedding's reduce-scatter still in flight (an
        # AsyncCollectiveTensor inside the DTensor), which torch 2.13's compiled code cannot
        # unwrap in a no-grad forward (evaluation, samples): there it is waited for first
        block.register_forward_pre_hook(_settled)
        if "attention" not in plan:  # (fp8 on GPUs: the plan gathers it, in fp8)
            # attention and the MLP read the whole sequence: their first input is gathered (the
            # other arguments, rope, cache, positions and mask, are the same on every rank)
            gather = functools.partial(_whole_sequence, mesh=mesh)
            block.attention.register_forward_pre_hook(gather)
            block.feed_forward.register_forward_pre_hook(gather)
        block.attention.n_heads //= tp  # the heads of this rank
        block.attention.n_kv_heads //= tp
    embed = RowwiseParallel(
        input_layouts=Replicate(), output_layouts=stream, use_local_output=False
    )
    top = {"tok_embeddings": embed}
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    else:
        _replicate_parameters(model.norm, mesh)
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False
        )
    parallelize_module(model, mesh, top)
    # the output projection reads the whole sequence on every rank: the final norm's output
    # (sequence shards, or the plain replicated tensor) becomes a replicated DTensor, which is
    # also what a tied head's F.linear against the vocab-sharded embedding needs
    model.norm.register_forward_hook(lambda _m, _i, out: out.redistribute(mesh, [Replicate()]))


def block_plan(
    colwise: type, rowwise: type, prepare: type | None, stream: Placement
) -> dict[str, ParallelStyle]:
    """A block's linears' styles (`tp_styles`'s); with `prepare` (fp8's), attention's and the
    MLP's input is also cast to fp8 and gathered whole once (else a pre-hook gathers it)."""
    plan = {
        "attention.wqkv": colwise(input_layouts=Replicate()),
        "attention.wo": rowwise(output_layouts=stream, use_local_output=False),
        "feed_forward.w1": colwise(input_layouts=Replicate()),
        "feed_forward.w3": colwise(input_layouts=Replicate()),
        "feed_forward.w2": rowwise(output_layouts=stream, use_local_output=False),
    }
    if prepare is None:
        return plan
    rest = (None, None, None, None)  # rope, cache, start_pos, docs: the same on every rank
    return {
        "attention": prepare(
            input_layouts=(stream, *rest), desired_input_layouts=(Replicate(), *rest)
        ),
        "feed_forward": prepare(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
        **plan,
    }


def _settled(_module, args: tuple) -> tuple:
    """The residual stream's tensor waited for, in a no-grad forward (`wait` leaves autograd)."""
    x, *rest = args
    if torch.is_grad_enabled():
        return args
    if isinstance(x, DTensor) and isinstance(x._local_tensor, AsyncCollectiveTensor):
        local = x.to_local().wait()
        x = DTensor.from_local(local, x.device_mesh, x.placements, run_check=False)
    return (x, *rest)


def _whole_sequence(_module, args: tuple, mesh: DeviceMesh) -> tuple:
    x, *rest = args  # (the residual stream: a DTensor)
    return (x.redistribute(mesh, [Replicate()]), *rest)


def _replicate_parameters(module: nn.Module, mesh: DeviceMesh) -> None:
    """The module's parameters as DTensors replicated over `mesh` (every rank has them alike)."""
    for name, param in list(module.named_parameters(recurse=False)):
        replicated = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
        module.register_parameter(name, nn.Parameter(replicated, param.requires_grad))


def parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of logits sharded over the vocabulary, never gathered: a plain tensor,
    the same on every tp rank (backward must run under `loss_parallel`)."""
    with loss_parallel():
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return loss.to_local() if isinstance(loss, DTensor) else loss


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """The whole logits on every rank (sampling during training reads one row of them)."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits
