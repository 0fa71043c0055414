"""Run by tests/test_compile.py in a process of its own (it starts a process group): one DDP
optimizer step of a model with compiled blocks whose blocks hold several gradient buckets;
prints how many graphs AOTAutograd compiled (`split` first turns Dynamo's DDPOptimizer on)."""

from __future__ import annotations

import json
import sys

import torch
from torch._dynamo.utils import counters

from scale_llm.components.distributed import start
from scale_llm.config import load_config
from scale_llm.config.plan import Launch, resolve_plan
from scale_llm.model import build_model
from scale_llm.parallel.backend import build_backend
from scale_llm.parallel.step import optimizer_step
from tests.helpers import leave_world

# d_model 256: a block holds 0.79M parameters, 3.1 MB of fp32 gradients: 4 buckets of 1 MB
SETTINGS = ["model.d_model=256", "model.n_layers=2", "model.n_heads=4", "model.seq_len=64"]
SETTINGS += ["model.vocab_size=512", "parallel.backend=ddp", "parallel.ddp.bucket_cap_mb=1"]
SETTINGS += ["train.compile=true", "train.device=cpu", "train.micro_batch_size=2"]


def main(split: bool) -> None:
    cfg = load_config(None, SETTINGS)
    plan = resolve_plan(cfg, Launch())
    start(plan)
    backend = build_backend(cfg, plan)
    model = backend.setup(build_model(cfg.model))
    if split:
        torch._dynamo.config.optimize_ddp = True  # Dynamo's default under DDP
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1))
    optimizer_step(backend, model, [(x[:, :-1], x[:, 1:])])
    print(json.dumps({"graphs": counters["aot_autograd"]["total"]}))
    leave_world()


if __name__ == "__main__":
    main(sys.argv[1:] == ["split"])
