"""ZeRO-Offload's host side, counted: DeepSpeed's ZeRO-1/2 optimizer offload runs real steps on
2 gloo ranks (bf16, grad_accum 2, a small model), and every tensor its optimizer holds is walked
by attribute name and summed, rank by rank, against the estimate's host figure, buffer by
buffer. A buffer DeepSpeed adds, under any name, is a storage no known name owns and fails the
test; one the estimate leaves out fails the sums. The CPU accelerator does not pin (its
`pin_memory` returns the tensor), so what torch's pinned allocator adds on a GPU machine, each
block rounded up to a power of two, is computed from the counted blocks and compared with the
estimate's `pinned rounding`. The bytes a step's copies move into and out of the host buffers
are counted too, against the estimate's host<->GPU traffic. The world runs this file as a
script under torchrun (about 30 s on 2 cores)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from scale_llm.analysis.memory.estimate import (
    PINNED_BLOCKS,
    Estimate,
    GiB,
    Layout,
    ParamCounts,
    estimate_layout,
    format_offload_traffic,
    layout_of,
    pinned_block_bytes,
    pinned_round_limit,
    zero_offload_gpu_grads,
    zero_offload_host_blocks,
    zero_offload_traffic,
)
from scale_llm.analysis.memory.gpu import estimate
from scale_llm.config import Config, load_config
from scale_llm.config.plan import target_plan
from tests.helpers import env

REPO = Path(__file__).resolve().parents[1]
SHAPE = [  # parameters of five sizes, a partition boundary cutting one; untied, as 7B
    "model.vocab_size=512",
    "model.tie_embeddings=false",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.grad_accum=2",
    "train.precision=bf16",
    "train.device=cpu",
    "train.compile=false",
    "parallel.backend=deepspeed",
    "parallel.deepspeed.offload_optimizer=cpu",
]
SHIPPED = yaml.safe_load((REPO / "yaml" / "7b-1xh200.yaml").read_text())["parallel"]["deepspeed"]
CASES = {
    # the shipped 7B layout: ZeRO-2, and the generated fp32 accumulation on the GPU
    "7b-1xh200": [
        f"parallel.deepspeed.zero_stage={SHIPPED['zero_stage']}",
        f"parallel.deepspeed.config={json.dumps(SHIPPED.get('config') or {})}",
    ],
    # DeepSpeed's default: 16-bit gradient accumulators on the host
    "zero2": [
        "parallel.deepspeed.zero_stage=2",
        "parallel.deepspeed.config={data_types: {grad_accum_dtype: bf16}}",
    ],
    "zero1": ["parallel.deepspeed.zero_stage=1"],
}
# attribute -> what the estimate calls it (earlier names own a storage two names reach: the
# inner optimizer's state is keyed by the fp32 master partitions)
HOST = {
    "single_partition_of_fp32_groups": "master",
    "single_partition_of_fp32_groups.grad": "grads",
    "param_buffer_of_bit16_for_cpu_offload_groups": "staging",
    "accumulated_grads_in_cpu": "accumulators",
    "temp_grad_buffer_for_cpu_offload": "copy buffer",
    "optimizer.state": "moments",
}
DEVICE = {  # on the GPU in a CUDA run
    "bit16_groups_flat": "params",
    "temp_grad_buffer_for_gpu_offload": "grads",
    "averaged_gradients": "grads",  # the fp32 accumulation partition (grad_accum_dtype fp32)
}
STRAY_LIMIT = 64  # bytes no name owns: the step's gradient norm (a 4-byte scalar) and no more


def storages_by_name(obj: Any) -> dict[str, dict[int, int]]:
    """{attribute path: {storage address: bytes}} of every tensor (and .grad) reachable from a
    DeepSpeed optimizer's attributes, through lists, dicts (keys too) and DeepSpeed's and
    torch.optim's own objects; not into the model (its parameters are the 16-bit flat groups'
    views) or process groups; meta tensors hold no memory."""
    found: dict[str, dict[int, int]] = defaultdict(dict)
    seen: set[int] = set()

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            if value.device.type != "meta":
                storage = value.untyped_storage()
                found[path][storage.data_ptr()] = storage.nbytes()
            if value.grad is not None:
                walk(value.grad, path + ".grad")
            return
        if id(value) in seen or isinstance(value, torch.nn.Module):
            return
        seen.add(id(value))
        if isinstance(value, (list, tuple, set)):
            for v in value:
                walk(v, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k, path)
                walk(v, path)
        elif type(value).__module__.startswith(("deepspeed", "torch.optim")):
            for name, v in vars(value).items():
                walk(v, f"{path}.{name}" if path else name)

    walk(obj, "")
    return found


def census(optimizer: Any) -> tuple[dict[str, Any], set[int]]:
    """The optimizer's storages, each given to the first known name that reaches it: host
    buffers as lists of block sizes, device buffers as byte sums, and what no name owns; and
    the host buffers' addresses."""
    owners: dict[int, tuple[int, list[str]]] = {}
    for path, storages in storages_by_name(optimizer).items():
        for address, nbytes in storages.items():
            owners.setdefault(address, (nbytes, []))[1].append(path)
    known = list(HOST) + list(DEVICE)
    host: dict[str, list[int]] = defaultdict(list)
    device: dict[str, int] = defaultdict(int)
    stray: dict[str, int] = {}
    on_host = set()
    for address, (nbytes, paths) in owners.items():
        owner = min((known.index(p) for p in paths if p in known), default=None)
        if owner is None:
            stray[" | ".join(sorted(set(paths)))] = nbytes
        elif known[owner] in HOST:
            host[HOST[known[owner]]].append(nbytes)
            on_host.add(address)
        else:
            device[DEVICE[known[owner]]] += nbytes
    summary = {"host": {k: sorted(v) for k, v in host.items()}, "device": device, "stray": stray}
    return summary, on_host


class CrossingCopies(TorchDispatchMode):
    """Bytes that aten copies move between the host buffers and everything else (the GPU's
    side in a CUDA run): into them "to host", out of them "to GPU"."""

    def __init__(self, host: set[int]) -> None:
        super().__init__()
        self.host, self.moved = host, {"to host": 0, "to GPU": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            into, out_of = (t.untyped_storage().data_ptr() in self.host for t in (dst, src))
            if into != out_of:
                self.moved["to host" if into else "to GPU"] += src.numel() * src.element_size()
        return func(*args, **(kwargs or {}))


def run_case(overrides: list[str]) -> dict[str, Any]:
    """Two optimizer steps: the census between the second's micro-steps and after it, and the
    bytes the second copies across the host line."""
    from scale_llm.config.plan import launch_env, resolve_plan
    from scale_llm.model import build_model
    from scale_llm.parallel.backend import build_backend

    cfg = load_config(None, [*SHAPE, *overrides])
    plan = resolve_plan(cfg, launch_env())
    backend = build_backend(cfg, plan)
    model = backend.setup(build_model(cfg.model))
    gen = torch.Generator().manual_seed(plan.rank)
    losses, norms, seen, crossing = [], [], {}, CrossingCopies(set())
    for step in range(2):
        with crossing if step else contextlib.nullcontext():
            for i in range(plan.grad_accum):
                shape = (plan.micro_batch_size, cfg.model.seq_len + 1)
                tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=gen)
                with backend.sync_context(sync_gradients=i == plan.grad_accum - 1):
                    loss = backend.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
                    backend.backward(loss / plan.grad_accum)
                losses.append(loss.item())
                if step and not i:
                    seen["between micro-steps"] = census(backend.optimizer)[0]
            norms.append(backend.clip_and_step().item())
        seen["after the step"], crossing.host = census(backend.optimizer)
    return {"losses": losses, "norms": norms, "copied": crossing.moved, **seen}


def main(out: str) -> None:
    from scale_llm.components.distributed import start
    from scale_llm.config.plan import launch_env, resolve_plan
    from tests.helpers import leave_world

    start(resolve_plan(load_config(None, SHAPE), launch_env()))  # one world for every case
    results = {name: run_case(overrides) for name, overrides in CASES.items()}
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))
    leave_world()


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict[int, dict[str, Any]]:
    """{rank: {case: its census}} from one 2-rank world."""
    from tests.helpers import run

    out = tmp_path_factory.mktemp("census")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    run([*cmd, __file__, str(out)], cwd=out)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}


def case(name: str) -> tuple[Config, Layout]:
    cfg = load_config(None, [*SHAPE, *CASES[name]])
    return cfg, layout_of(cfg, target_plan(cfg, 2))


@pytest.mark.parametrize("name", list(CASES))
def test_every_host_buffer_of_the_offload_is_counted(counted, name):
    """Rank by rank, the host buffers DeepSpeed's optimizer holds after a step are the
    estimate's, block for block (every size exact; no tolerance), and nothing else it holds is
    more than the gradient norm's scalar. For rank 0, whose host the report gives, the
    estimate's host figure is their sum plus the pinned rounding of the counted pinned blocks."""
    cfg, lay = case(name)
    n = ParamCounts.of(cfg.model)
    for rank, results in counted.items():
        seen = results[name]["after the step"]
        blocks = zero_offload_host_blocks(n, lay, rank)
        print(f"\n{name} rank {rank}: {seen['host']}")
        assert seen["host"] == {k: sorted(v) for k, v in blocks.items() if v}, rank
        assert sum(seen["stray"].values()) <= STRAY_LIMIT, seen["stray"]
    host = counted[0][name]["after the step"]["host"]
    pinned = [b for k in PINNED_BLOCKS for b in host.get(k, [])]
    figure = estimate(cfg, target_plan(cfg, 2)).cpu
    rounding = sum(pinned_block_bytes(b, lay.pinned_round_limit) - b for b in pinned)
    assert figure["pinned rounding"] == rounding
    assert sum(figure.values()) == sum(map(sum, host.values())) + rounding


@pytest.mark.parametrize("name", ["7b-1xh200", "zero2"])
def test_the_offloads_gpu_gradients_are_the_estimates(counted, name):
    """Between micro-steps ZeRO-2 with optimizer offload keeps on the GPU no 16-bit gradient
    partition: only its copy-out buffer and, with grad_accum_dtype fp32, the fp32 accumulation
    partition; its 16-bit parameters are the flat groups, padded to 2 x world elements each."""
    cfg, lay = case(name)
    n = ParamCounts.of(cfg.model)
    for results in counted.values():
        device = results[name]["between micro-steps"]["device"]
        assert device["grads"] == zero_offload_gpu_grads(n, lay)
        assert 0 <= device["params"] - 2 * n.total < 2 * (2 * 2)  # two groups


@pytest.mark.parametrize("name", list(CASES))
def test_the_offloads_copies_per_step_are_the_estimates(counted, name):
    """Rank by rank, the bytes a step's copies move into the host buffers and out of them
    (every aten copy_ with one side in them; the CPU accelerator runs the same copies a GPU's
    PCIe carries) are the estimate's per direction: no accumulators with fp32 accumulation on
    the GPU; with DeepSpeed's default, each micro-step's 16-bit gradients out and back."""
    cfg, lay = case(name)
    n = ParamCounts.of(cfg.model)
    for rank, results in counted.items():
        traffic = zero_offload_traffic(n, lay, rank)
        assert results[name]["copied"] == {way: sum(v.values()) for way, v in traffic.items()}


def test_fp32_accumulation_on_the_gpu_trains_like_the_host_accumulators(counted):
    """The shipped layout (fp32 accumulation on the GPU) and DeepSpeed's default (16-bit
    accumulators on the host) start from the same losses and keep close norms and losses."""
    for results in counted.values():
        ours, default = results["7b-1xh200"], results["zero2"]
        assert ours["losses"][:2] == default["losses"][:2]  # the same weights, the same data
        assert ours["losses"] == pytest.approx(default["losses"], rel=1e-2)
        assert ours["norms"] == pytest.approx(default["norms"], rel=2e-2)


def test_pinned_blocks_round_up_to_a_power_of_two_below_the_limit():
    """torch's pinned allocator's arithmetic, and the settings that change it."""
    assert [pinned_block_bytes(b) for b in (1, 3, 4096, 4097)] == [1, 4, 4096, 8192]
    fp32_partition = 4 * 6_738_415_616  # 7B's whole fp32 partition: 25.1 GiB takes 32
    assert pinned_block_bytes(fp32_partition) == 32 * GiB
    assert pinned_block_bytes(fp32_partition, 1 << 20) == fp32_partition
    assert pinned_block_bytes(1000, 1 << 20) == 1024  # still rounded below the limit
    assert pinned_round_limit({}) is None
    cuda = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,pinned_max_round_threshold_mb:1"}
    assert pinned_round_limit(cuda) == 1 << 20
    both = {**cuda, "PYTORCH_ALLOC_CONF": "roundup_power2_divisions:[256:4,>:1]"}
    assert pinned_round_limit(both) == 1 << 20  # PYTORCH_CUDA_ALLOC_CONF, when set, is the one
    if hasattr(torch._C, "_accelerator_getAllocatorSettings"):  # ... torch reads (2.13: has it)
        read = "import torch; print(torch._C._accelerator_getAllocatorSettings())"
        proc = subprocess.run([sys.executable, "-c", read], env=env() | both, capture_output=True)
        assert proc.stdout.decode().strip() == both["PYTORCH_CUDA_ALLOC_CONF"], proc.stderr[-2000:]
    two = "pinned_max_cached_size_mb:8,pinned_max_round_threshold_mb:64"
    assert pinned_round_limit({"PYTORCH_ALLOC_CONF": two}) == 8 << 20  # no caching, no rounding


def shipped_7b(monkeypatch, settings: str | None) -> Estimate:
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    if settings is not None:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", settings)
    return estimate(load_config(REPO / "yaml" / "7b-1xh200.yaml", []), 1)


def test_the_single_h200_7b_plan_fits_a_128_gib_host_without_the_rounding(monkeypatch):
    """yaml/7b-1xh200.yaml: with torch's default pinned allocator its host buffers and their
    rounding exceed 128 GiB; with pinned blocks over 1 MiB kept at their size they leave more
    than 10% of it free. Its GPU total fits an H200's 141 GB (131 GiB) either way."""
    rounded = shipped_7b(monkeypatch, None)
    exact = shipped_7b(monkeypatch, "expandable_segments:True,pinned_max_round_threshold_mb:1")
    assert sum(rounded.cpu.values()) > 128 * GiB > sum(exact.cpu.values()) / 0.9
    assert exact.cpu["pinned rounding"] == 0 < rounded.cpu["pinned rounding"]
    assert exact.total == rounded.total < 141e9
    print(f"\n{format_offload_traffic(exact)}")


def test_fp32_accumulation_on_the_gpu_removes_the_per_micro_step_copies(monkeypatch):
    """At 7B, grad_accum 32, DeepSpeed's default sends the 16-bit gradients to the host and back
    on every micro-step (2 x 32 - 1 copies of 2 bytes per parameter besides the step's own 4 + 2);
    the shipped layout copies the fp32 gradients once and the parameters once."""
    shipped = shipped_7b(monkeypatch, None)
    P, lay = shipped.params, shipped.layout
    assert shipped.traffic == {
        "to host": {"fp32 gradients": 4 * P},
        "to GPU": {"parameters": 2 * P},
    }
    default = estimate_layout(shipped.model, shipped.ac, replace(lay, ds_grad_accum_dtype=None))
    N = lay.grad_accum
    accumulators = {"to host": N * 2 * P, "to GPU": (N - 1) * 2 * P}
    for way, copies in accumulators.items():
        assert default.traffic[way]["gradient accumulators"] == copies
    assert sum(map(sum, map(dict.values, default.traffic.values()))) > 20 * 6 * P


def test_the_roofline_puts_the_offload_copies_in_the_optimizers_place():
    """bench --roofline of an offload layout: no GPU AdamW row; a PCIe row with the estimate's
    bytes per step, in both totals."""
    from scale_llm.analysis.roofline import OFFLOAD_ROW, format_roofline, roofline

    cfg, lay = case("zero2")
    r = roofline(cfg, 2, 2, "H200", 2)
    copied = sum(map(sum, map(dict.values, r["offload_bytes_per_step"].values())))
    traffic = zero_offload_traffic(ParamCounts.of(cfg.model), lay)
    assert r["offload_bytes_per_step"] == traffic
    assert r["classes"][OFFLOAD_ROW]["bytes"] == copied and "optimizer (AdamW)" not in r["classes"]
    assert "gradient accumulators" in format_roofline(r)


if __name__ == "__main__":
    main(sys.argv[1])
