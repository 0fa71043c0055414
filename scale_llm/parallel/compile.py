"""torch.compile per transformer block (`train.compile`), torchtitan's way.

Each block's `forward` is compiled with `fullgraph=True` (a graph break is an error, not a silent
slowdown). The blocks share one code object, so one graph serves every block; activation
checkpointing (applied first) is traced as part of it. Compiling the bound `forward` rather than
the module's `__call__` keeps the parameter names (and so checkpoints) unchanged and leaves
module hooks (FSDP2's all-gathers, DeepSpeed's) outside the compiled region.
"""

from __future__ import annotations

import torch
from torch import nn


def compile_blocks(model: nn.Module) -> int:
    """Compile the forward of every block of `model.layers`; returns how many."""
    for block in model.layers:
        if not getattr(block, "_scale_llm_compiled", False):
            block.forward = torch.compile(block.forward, fullgraph=True)
            block._scale_llm_compiled = True
    return len(model.layers)
