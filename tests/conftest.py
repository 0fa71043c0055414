"""Shared fixtures: a small prepared corpus and tiny configs that train in milliseconds per step."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from scale_llm.config import load_config
from scale_llm.data.prepare import prepare
from scale_llm.log import setup_logging
from tests.helpers import TINY_MODEL, Lines, env, logged

setup_logging(0)


def pytest_configure(config):
    # Tests never touch the network; Hugging Face libraries read these when first imported,
    # and nothing imports them before this hook runs.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"


# DeepSpeed on the CPU JIT-compiles two C++ ops the first time a process needs them (its shared-
# memory all-reduce at every `init_distributed`, and CPUAdam for offload): ~3 min of compiling on
# 2 cores, cached in TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions). Cold, the first DeepSpeed
# world of a session stalls on it; built in the background at the lowest priority from the start,
# the compile uses the cores the single-process tests leave idle. A process that needs an op
# while it is being built waits on torch's lock file, so the build is never killed (a killed build
# leaves that lock behind): the test session waits for it at its end.
_DEEPSPEED_OPS = "from deepspeed.comm.torch import build_shm_op; build_shm_op(); "
_DEEPSPEED_OPS += "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
_prebuild: subprocess.Popen | None = None


def pytest_collection_finish(session):
    global _prebuild
    if session.config.option.collectonly:  # listing tests builds nothing and waits on nothing
        return
    wanted = ("zero", "deepspeed", "every_backend")
    if any(w in item.nodeid for item in session.items for w in wanted):
        for lock in stale_extension_locks():
            lock.unlink(missing_ok=True)
            print(f"\nconftest: removed {lock}: a build killed earlier left it", file=sys.stderr)
        _prebuild = subprocess.Popen(
            [sys.executable, "-c", _DEEPSPEED_OPS],
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=lambda: os.nice(19),
        )


def stale_extension_locks(root: Path | None = None) -> list[Path]:
    """torch's op-build lock files (`<root>/<python>_<device>/<op>/lock`) that no process holds.

    A build creates its lock and keeps it open until it removes it; a build that was killed
    leaves it behind, and every later process that needs the op waits on it forever. On Linux
    the holders are visible in /proc; where they are not all visible (another user's processes,
    another OS) nothing is called stale."""
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    locks = sorted(root.glob("*/*/lock")) + sorted(root.glob("*/lock"))
    if not locks or not Path("/proc/self/fd").is_dir():
        return []
    held = set()
    for fds in Path("/proc").glob("[0-9]*/fd"):
        try:
            names = os.listdir(fds)
        except PermissionError:  # another user's process: it might hold one, so say nothing
            return []
        except OSError:  # gone meanwhile
            continue
        for name in names:
            try:
                held.add(os.readlink(fds / name))
            except OSError:
                continue
    return [lock for lock in locks if str(lock.resolve()) not in held]


def pytest_sessionfinish(session):
    if _prebuild is None:
        return
    try:
        _prebuild.wait(timeout=1200)  # a cold build takes ~3 min on 2 cores
    except subprocess.TimeoutExpired:  # waiting on a lock a killed build left: do not hang
        _prebuild.kill()
        print(
            "\nconftest: DeepSpeed's op build did not finish in 20 min; a build killed earlier "
            "may have left a lock file under ~/.cache/torch_extensions (delete it)",
            file=sys.stderr,
        )


@pytest.fixture
def logs() -> Iterator[Lines]:
    """The scale_llm logger's records during the test, INFO and above (`tests.helpers.logged`:
    a handler of its own, not pytest's `caplog`, whose reach differs between pytest versions)."""
    logger = logging.getLogger("scale_llm")
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with logged() as lines:
            yield lines
    finally:
        logger.setLevel(level)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """About 1.5 MB of the standard library's .py files, copied into a local corpus directory."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus")
    for f in sorted(root.glob("*.py"))[:80]:
        shutil.copyfile(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def data_dir(corpus_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    cfg = load_config(
        None,
        [
            *TINY_MODEL,
            f"data.source={corpus_dir}",
            f"data.dir={out}",
            "data.tokenizer_sample_bytes=500000",
            "data.val_fraction=0.1",
        ],
    )
    prepare(cfg)
    return out


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
