"""torch.compile per transformer block (`train.compile`), torchtitan's way: each block's bound
`forward` with `fullgraph=True` (one graph serves every block; a break is an error), so parameter
names stay and module hooks (FSDP2's all-gathers, DeepSpeed's) stay outside the compiled region.
"""

from __future__ import annotations

import torch
import torch._functorch.config
from torch import nn


def compile_blocks(model: nn.Module, donate: bool = True) -> int:
    """Compile the forward of every block of `model.layers`; returns how many. `donate`: the
    compiled backward may reuse its saved buffers; not where one graph's backward runs twice (a
    pipeline's split backward keeps the graph: torch refuses donation under retain_graph)."""
    if torch._functorch.config.donated_buffer != donate:
        # (one graph serves every block of every model in the process: one compiled under the
        # other setting would be reused, and torch checks donation only while it is on)
        torch._dynamo.reset()
        torch._functorch.config.donated_buffer = donate
    for block in model.layers:
        if not getattr(block, "_scale_llm_compiled", False):
            block.forward = torch.compile(block.forward, fullgraph=True)
            block._scale_llm_compiled = True
    return len(model.layers)


def toolchain_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot build kernels on `device` here (what to install), or None."""
    try:
        probe = torch.compile(lambda x: torch.sin(x) * 2.0 + 1.0, fullgraph=True)
        probe(torch.ones(8, device=device))
        return None
    except Exception as e:  # inductor raises many types; each means "cannot compile here"
        error = e
    text = f"{type(error).__name__}: {error}"
    first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    if "InvalidCxxCompiler" in text or "C++ compiler" in text:
        need = "a C++ compiler (Debian/Ubuntu: apt install g++; or set CXX to one)"
    elif "Python.h" in text:
        need = "Python's C headers (Debian/Ubuntu: apt install python3-dev, for this Python)"
    elif "triton" in text.lower() and isinstance(error, ImportError | ModuleNotFoundError):
        need = "Triton (it comes with CUDA builds of torch: pip install triton)"
    elif device.type == "cuda" and ("gcc" in text or " cc" in text or "compiler" in text):
        need = "a C compiler for Triton's launchers (Debian/Ubuntu: apt install gcc)"
    else:
        need = "inductor's toolchain"
    where = device.type
    return f"torch.compile cannot build kernels on {where} here: it needs {need} ({first[:300]})"
