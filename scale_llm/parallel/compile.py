"""torch.compile per transformer block (`train.compile`), torchtitan's way: each block's bound
`forward` with `fullgraph=True` (one graph serves every block; a break is an error), so parameter
names stay and module hooks (FSDP2's all-gathers, DeepSpeed's) stay outside the compiled region.
"""

from __future__ import annotations

import os
import stat

import torch
import torch._functorch.config
from torch import nn

from scale_llm.errors import UserError


def compile_blocks(model: nn.Module, donate: bool = True) -> int:
    """Compile the forward of every block of `model.layers`; returns how many. `donate`: the
    compiled backward may reuse its saved buffers; not where one graph's backward runs twice (a
    pipeline's split backward keeps the graph: torch refuses donation under retain_graph)."""
    if (problem := cache_problem()) is not None:  # (a command without the preflight's probe)
        raise UserError(f"{problem}; or set train.compile=false")
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


def cache_problem() -> str | None:
    """Why the folder inductor loads compiled code from is unsafe, or None. Its default is a
    predictable name in the shared temporary folder (torchinductor_<user>), which another user
    could make first and fill: it must be this user's own folder, which no other user can write
    into (made so here when missing, as inductor would make it). A folder that
    TORCHINDUCTOR_CACHE_DIR names is the user's choice."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = default_cache_dir()
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        found = os.lstat(folder)
    except OSError as e:
        why = f"it cannot be made ({e.strerror})"
    else:
        why = (
            "it is a symbolic link" if stat.S_ISLNK(found.st_mode)
            else "it is not a folder" if not stat.S_ISDIR(found.st_mode)
            else f"it belongs to another user (uid {found.st_uid})" if found.st_uid != os.getuid()
            else "other users can write into it" if found.st_mode & stat.S_IWOTH
            else None
        )  # fmt: skip
    if why is None:
        return None
    return (
        f"torch.compile keeps the code it compiles in {folder} and runs it from there, but {why}: "
        f"code another user put there would run in this process. Remove that folder (a cache), "
        f"or set TORCHINDUCTOR_CACHE_DIR to a folder of your own"
    )


def toolchain_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot build kernels on `device` here (what to install, or an unsafe
    cache folder), or None."""
    if (problem := cache_problem()) is not None:
        return problem
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
