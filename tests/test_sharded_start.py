"""FSDP2 and tensor parallelism start sharded: no host holds the whole model.

Each rank fills its own shards one whole parameter at a time (parallel/fsdp.py `_fill_shards`),
with no communication, so one rank of a world can be checked on its own: here rank 0 and rank 3
of a 4-rank world in a process of their own (torch's fake process group: the layout of four
ranks, the collectives no-ops), on a 134M-parameter model (512 MiB in fp32). The peak host memory
the fill adds is at most the rank's quarter plus one full parameter, and the shards hold what
one process draws from the same seed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, env

SCRIPT = r"""
import json, resource, sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from scale_llm.config import load_config
from scale_llm.config.plan import Launch, resolve_plan
from scale_llm.model import build_model
from scale_llm.parallel.backend import build_backend

rank, tp = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
shape = ["model.vocab_size=32000", "model.d_model=768", "model.n_layers=12", "model.n_heads=12",
         "model.seq_len=256", "model.tie_embeddings=false"]
cfg = load_config(None, [*shape, "parallel.backend=fsdp", f"parallel.tensor_parallel={tp}",
                         "train.device=cpu", "train.compile=false", "train.micro_batch_size=1"])
plan = resolve_plan(cfg, Launch(rank=rank, local_rank=rank, world_size=4))
backend = build_backend(cfg, plan)
model = build_model(cfg.model)
peak_kib = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
before = peak_kib()
backend.wrap(model)
grew = (peak_kib() - before) * 1024
params = dict(model.named_parameters())
mine = {n: p.to_local().clone() for n, p in params.items()}
shapes = {n: tuple(p.shape) for n, p in params.items()}
torch.manual_seed(cfg.run.seed)
one = build_model(cfg.model, "cpu").state_dict()  # what one process draws
from torch.distributed.tensor import distribute_tensor
equal = all(
    torch.equal(mine[n], distribute_tensor(one[n], p.device_mesh, p.placements,
                                           src_data_rank=None).to_local())
    for n, p in params.items())
numels = {n: 1 for n in shapes}
for n, s in shapes.items():
    for d in s:
        numels[n] *= d
print(json.dumps({"grew": grew, "model": 4 * sum(numels.values()),
                  "largest": 4 * max(numels.values()), "equal": equal}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("rank", "tp"), [(0, 1), (3, 1), (0, 2), (3, 2)])
def test_a_rank_holds_its_quarter_and_one_parameter_at_start(rank, tp):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(rank), str(tp)],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    bound = found["model"] / 4 + found["largest"] + 32 * mib  # + the allocator's own slack
    print(
        f"\nrank {rank} of 4, tp {tp}: host peak +{found['grew'] / mib:.0f} MiB at start "
        f"(model {found['model'] / mib:.0f} MiB, its quarter {found['model'] / 4 / mib:.0f}, "
        f"largest parameter {found['largest'] / mib:.0f}; bound {bound / mib:.0f})"
    )
    assert found["equal"], "the shards differ from one process's weights"
    assert found["grew"] <= bound
    assert found["grew"] < found["model"] / 2  # (rank 0 once held the whole model)
