"""Shared fixtures: a small prepared corpus and tiny configs that train in milliseconds per step."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from scale_llm.config import load_config
from scale_llm.data.prepare import prepare
from scale_llm.log import setup_logging
from tests.helpers import TINY_MODEL, env

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
    wanted = ("zero", "deepspeed", "every_backend")
    if any(w in item.nodeid for item in session.items for w in wanted):
        _prebuild = subprocess.Popen(
            [sys.executable, "-c", _DEEPSPEED_OPS],
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=lambda: os.nice(19),
        )


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
