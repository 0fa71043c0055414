"""Shared fixtures: a small prepared corpus and tiny configs that train in milliseconds per step."""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from scale_llm.config import Config, load_config
from scale_llm.data.prepare import prepare
from scale_llm.log import setup_logging

setup_logging(0)


def pytest_configure(config):
    # Tests never touch the network; Hugging Face libraries read these when first imported,
    # and nothing imports them before this hook runs.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"


TINY_MODEL = [
    "model.vocab_size=512",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.seq_len=32",
]


def make_config(data_dir: Path | str, run_root: Path | str, *overrides: str) -> Config:
    """A tiny fp32 CPU config over `data_dir`, with run dirs under `run_root`."""
    base = [
        *TINY_MODEL,
        f"data.dir={data_dir}",
        f"run.dir={run_root}",
        "run.name=test",
        "train.micro_batch_size=4",
        "train.max_steps=4",
        "train.warmup_steps=1",
        "train.precision=fp32",
        "train.device=cpu",
        "logging.every=1",
        "logging.tensorboard=false",
        "eval.every=0",
        "checkpoint.every=0",
    ]
    return load_config(None, base + list(overrides))


def random_texts(
    n: int, label: str, *, seed: int = 0, vocab: int = 300, word_len: int = 5, length: int = 120
) -> list[str]:
    """n documents of random made-up words, each starting with `label` formatted with its index
    (e.g. "doc{i:03d}marker"), so a document can be found again after tokenizing."""
    rng = np.random.default_rng(seed)
    words = [
        "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), word_len)) for _ in range(vocab)
    ]
    return [label.format(i=i) + " " + " ".join(rng.choice(words, length)) for i in range(n)]


def prep_config(source: Path | str, out: Path | str, *extra: str) -> Config:
    """A prepare config for small local corpora (vocab 400); `extra` overrides come last."""
    base = [
        "model.vocab_size=400",
        f"data.source={source}",
        f"data.dir={out}",
        "data.val_fraction=0.25",
    ]
    return load_config(None, base + list(extra))


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
