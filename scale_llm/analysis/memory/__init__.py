"""Per-GPU memory: a prediction before training (`scale-llm estimate`, `train --report-memory`),
a plan that fits a budget (`--fit 80GiB`), and a CPU measurement that keeps the prediction honest.

The estimate gives each part at its own largest over a step, per GPU, in bytes:

  params       the parameter storage the backend keeps (fp32 master weights, 16-bit copies,
               sharded or gathered)
  grads        gradient storage (full, or sharded, in the precision the backend accumulates in,
               with DDP's buckets and DeepSpeed's reduce buckets)
  optimizer    AdamW's two moments (and DeepSpeed's fp32 master copy), full or partitioned
  activations  what the forward pass saves for backward (the logits the chunked loss keeps too),
               for the attention implementation and checkpointing mode, and during a
               checkpointed block's backward its recomputed activations
  temporaries  the largest set in flight: the logits' gradient and the loss's fp32 chunk, or
               one block's backward

and then `peak`, the largest sum alive at once (the parts do not peak together: the loss's
forward and backward, each block's backward, the optimizer step; `estimate.step_phases`), and
`total` = peak + `overhead`, a stated 5% allocator allowance.

The activation formula follows this project's model op by op (see `block_activation_bytes`); it
is checked against `measure_saved_bytes`, which counts what autograd really saves on the CPU.
"""

from scale_llm.analysis.memory.activations import (
    Numerics,
    measure_activations,
    measure_saved_bytes,
    saved_activation_bytes,
)
from scale_llm.analysis.memory.estimate import (
    Estimate,
    GiB,
    Layout,
    ParamCounts,
    ds_reduce_buckets,
    estimate,
    gib,
    parse_bytes,
    zero3_gathered_params,
)
from scale_llm.analysis.memory.host import check_host_memory, host_memory_problem
from scale_llm.analysis.memory.plan import (
    Plan,
    fit,
    format_overrides,
    format_report,
    hints,
    world_for_estimate,
)
from scale_llm.config import with_changes

__all__ = [
    "ds_reduce_buckets",
    "GiB",
    "Estimate",
    "Layout",
    "Numerics",
    "ParamCounts",
    "Plan",
    "check_host_memory",
    "estimate",
    "fit",
    "format_overrides",
    "format_report",
    "gib",
    "hints",
    "host_memory_problem",
    "measure_activations",
    "measure_saved_bytes",
    "parse_bytes",
    "saved_activation_bytes",
    "with_changes",
    "world_for_estimate",
    "zero3_gathered_params",
]
