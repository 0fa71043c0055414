"""FSDP2 and tensor parallelism start sharded: no host holds the whole model.

Each rank fills its own shards one whole parameter at a time (parallel/fsdp.py `_fill_shards`),
with no communication, so one rank of a world can be checked on its own: here rank 0 and rank 3
of a 4-rank world in a process of their own (torch's fake process group: the layout of four
ranks, the collectives no-ops), on a 134M-parameter model (512 MiB in fp32), from the seed, from
a DCP checkpoint (a resume from another backend) and from a Hugging Face folder (init_from). The
peak host memory the fill adds is at most the rank's quarter plus one full parameter (twice the
largest where a reader holds a copy while it reads), and the shards hold one process's weights.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, env

SCRIPT = r"""
import json, resource, sys
from pathlib import Path
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from scale_llm.config import load_config
from scale_llm.config.plan import Launch, resolve_plan
from scale_llm.model import build_model
from scale_llm.parallel.backend import build_backend

rank, tp, source, saved = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
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
initial = None
if source == "dcp":  # a checkpoint of another backend: its weights, one tensor at a time
    from scale_llm.components.checkpoint import CheckpointWeights
    initial = CheckpointWeights(Path(saved) / "ckpt", build_model(cfg.model).state_dict())
elif source == "hf":  # model.init_from's folder
    from scale_llm.train.init_from import load_init_weights
    initial = load_init_weights(cfg.model, Path(saved) / "hf")
before = peak_kib()
backend.wrap(model, initial)
grew = (peak_kib() - before) * 1024
params = dict(model.named_parameters())
mine = {n: p.to_local().clone() for n, p in params.items()}
shapes = {n: tuple(p.shape) for n, p in params.items()}
torch.manual_seed(cfg.run.seed)
one = build_model(cfg.model, "cpu").state_dict()  # what one process draws (and what was saved)
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


SAVE = r"""
import json, sys
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from scale_llm.config import load_config
from scale_llm.model import build_model
from scale_llm.model.hf import to_hf, to_hf_config

out = Path(sys.argv[1])
cfg = load_config(None, json.loads(sys.argv[2]))
torch.manual_seed(cfg.run.seed)
state = build_model(cfg.model, "cpu").state_dict()
dcp.save({"model": state}, checkpoint_id=str(out / "ckpt" / "dcp"), no_dist=True)
(out / "hf").mkdir()
(out / "hf" / "config.json").write_text(json.dumps(to_hf_config(cfg.model, torch.float32, 1, 2, 2)))
save_file(dict(to_hf(cfg.model, dict(state))), str(out / "hf" / "model.safetensors"))
"""
SHAPE = ["model.vocab_size=32000", "model.d_model=768", "model.n_layers=12", "model.n_heads=12",
         "model.seq_len=256", "model.tie_embeddings=false"]  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The 134M model's one-process weights as a DCP checkpoint and a Hugging Face folder, written
    in a process of their own (they would count in the measured process's peak)."""
    out = tmp_path_factory.mktemp("saved")
    done = subprocess.run(
        [sys.executable, "-c", SAVE, str(out), json.dumps(SHAPE)],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rank", "tp", "source"),
    [(0, 1, "seed"), (3, 1, "seed"), (0, 2, "seed"), (3, 2, "seed"), (3, 2, "dcp"), (3, 2, "hf")],
)
def test_a_rank_holds_its_quarter_and_one_parameter_at_start(rank, tp, source, saved):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(rank), str(tp), source, str(saved)],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    copies = 1 if source == "seed" else 2  # (a reader's buffer beside the tensor it fills)
    bound = found["model"] / 4 + copies * found["largest"] + 32 * mib  # + the allocator's slack
    print(
        f"\nrank {rank} of 4, tp {tp}, from {source}: host peak +{found['grew'] / mib:.0f} MiB "
        f"(model {found['model'] / mib:.0f} MiB, its quarter {found['model'] / 4 / mib:.0f}, "
        f"largest parameter {found['largest'] / mib:.0f}; bound {bound / mib:.0f})"
    )
    assert found["equal"], "the shards differ from one process's weights"
    assert found["grew"] <= bound
    assert found["grew"] < 0.7 * found["model"]  # (each rank once held the whole model)
