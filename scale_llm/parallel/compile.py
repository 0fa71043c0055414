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
    require_own_cache()
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


def require_own_cache() -> None:
    """Stops (UserError) before anything compiles where `cache_problem` finds one: for every
    compile, also those of commands without the preflight's probe (bench, the estimator)."""
    if (problem := cache_problem()) is not None:
        raise UserError(f"{problem}; or set train.compile=false")


def cache_problem() -> str | None:
    """Why the folder inductor runs compiled code from is unsafe, or None. Its default is a
    predictable name in the shared temporary folder (torchinductor_<user>) that another user
    could make first and fill: it must be this user's folder, closed to other users. An empty
    one torch made open (umask 000) is closed here. A folder TORCHINDUCTOR_CACHE_DIR names is
    the user's choice (torch names the default there itself when imported)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = default_cache_dir()
    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named and os.path.abspath(named) != os.path.abspath(folder):
        return None
    try:
        if not os.path.lexists(folder):
            os.makedirs(folder, mode=0o700, exist_ok=True)
        found = os.lstat(folder)
        mine = stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid()
        filled = False
        if mine and found.st_mode & stat.S_IWOTH:
            os.chmod(folder, 0o700)  # closed first, then looked into
            if filled := bool(os.listdir(folder)):  # left as found: refused until removed
                os.chmod(folder, stat.S_IMODE(found.st_mode))
    except OSError as e:
        why = f"it cannot be made or read ({e.strerror})"
    else:
        why = (
            "it is a symbolic link" if stat.S_ISLNK(found.st_mode)
            else "it is not a folder" if not stat.S_ISDIR(found.st_mode)
            else f"it belongs to another user (uid {found.st_uid})" if not mine
            else "other users could write into it, and it holds files" if filled
            else None
        )  # fmt: skip
    if why is None:
        return None
    return (
        f"torch.compile runs the code it finds in its cache folder {folder}, but {why}: code "
        f"another user put there would run in this process. Set TORCHINDUCTOR_CACHE_DIR to a "
        f"folder of your own, or remove that one (a cache)"
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
