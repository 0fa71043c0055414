"""Per-GPU memory: a prediction before training (`scale-llm estimate`, `train --report-memory`),
a plan that fits a budget (`--fit 80GiB`), and a CPU measurement that keeps the prediction honest.

The estimate is a sum of parts, per GPU, in bytes:

  params       the parameter storage the backend keeps (fp32 master weights, 16-bit copies,
               sharded or gathered)
  grads        gradient storage (full, or sharded, in the precision the backend accumulates in)
  optimizer    AdamW's two moments (and DeepSpeed's fp32 master copy), full or partitioned
  activations  what the forward pass saves for backward, for the attention implementation and
               checkpointing mode, plus what backward needs on top: one checkpointed block
               recomputed at a time, and autocast's 16-bit weight copies
  logits       the B x T x vocab buffers of the loss: the logits the chunked loss keeps (in the
               compute dtype) and their gradient
  overhead     a stated allowance: 5% of the rest for temporaries and allocator slack

The activation formula follows this project's model op by op (see `block_activation_bytes`); it
is checked against `measure_saved_bytes`, which counts what autograd really saves on the CPU.
"""

from scale_llm.config import with_changes
from scale_llm.memory.activations import (
    Numerics,
    measure_activations,
    measure_saved_bytes,
    saved_activation_bytes,
)
from scale_llm.memory.estimate import (
    Estimate,
    GiB,
    Layout,
    ds_reduce_buckets,
    estimate,
    gib,
    parse_bytes,
)
from scale_llm.memory.plan import Plan, fit, format_overrides, format_report, hints

__all__ = [
    "ds_reduce_buckets",
    "GiB",
    "Estimate",
    "Layout",
    "Numerics",
    "Plan",
    "estimate",
    "fit",
    "format_overrides",
    "format_report",
    "gib",
    "hints",
    "measure_activations",
    "measure_saved_bytes",
    "parse_bytes",
    "saved_activation_bytes",
    "with_changes",
]
