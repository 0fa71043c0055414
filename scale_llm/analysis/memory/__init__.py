"""Per-GPU memory: a prediction before training (`scale-llm estimate`, `train --report-memory`),
a plan that fits a budget (`--fit 80GiB`), CPU measurements and fake traces that keep it honest.
Each part at its own largest, the `peak` alive at once, `total` = peak + 5%: docs/memory.md."""

from scale_llm.analysis.memory.activations import (
    Numerics,
    measure_activations,
    measure_saved_bytes,
    saved_activation_bytes,
)
from scale_llm.analysis.memory.estimate import (
    ParamCounts,
    ds_reduce_buckets,
    gib,
    parse_bytes,
    zero3_gathered_params,
)
from scale_llm.analysis.memory.gpu import estimate
from scale_llm.analysis.memory.host import check_host_memory, host_memory_problem
from scale_llm.analysis.memory.plan import fit, format_overrides, format_report, world_for_estimate

__all__ = [
    "ds_reduce_buckets",
    "Numerics",
    "ParamCounts",
    "check_host_memory",
    "estimate",
    "fit",
    "format_overrides",
    "format_report",
    "gib",
    "host_memory_problem",
    "measure_activations",
    "measure_saved_bytes",
    "parse_bytes",
    "saved_activation_bytes",
    "world_for_estimate",
    "zero3_gathered_params",
]
