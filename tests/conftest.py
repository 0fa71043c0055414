"""Shared fixtures: a small prepared corpus and tiny configs that train in milliseconds per step."""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from scale_llm.config import load_config
from scale_llm.data.prepare import prepare
from scale_llm.log import setup_logging
from tests.helpers import TINY_MODEL

setup_logging(0)


def pytest_configure(config):
    # Tests never touch the network; Hugging Face libraries read these when first imported,
    # and nothing imports them before this hook runs.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"


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
