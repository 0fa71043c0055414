"""train.fp8 (torchao's Float8Linear in the blocks' linears), emulated on the CPU: the conversion,
the bf16 curve it follows, its checkpoints (the high-precision weights under the one-process
names), and the preflight's checks. Under FSDP2 x tensor parallelism: tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from scale_llm.config.plan import RunPlan
from scale_llm.errors import UserError
from scale_llm.model import build_model
from tests.helpers import env, fit_counting_graphs, logged, make_config, plan_for, trainer_for

pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from scale_llm.parallel.fp8 import apply_fp8, check_fp8, float8_config  # noqa: E402

FP8 = ["train.fp8.enabled=true"]
# the curve: 4 layers, 200 steps of 4 x 32 tokens, bf16 autocast (what fp8 runs beside on a GPU)
CURVE = ["model.n_layers=4", "train.max_steps=200", "train.warmup_steps=10", "train.lr=3e-3"]
CURVE += ["train.precision=bf16", "checkpoint.every=0"]
# e4m3 keeps 3 mantissa bits: each cast rounds by up to 2^-4 (6%) of an element, unbiased, so a
# K-term dot product's relative error is about 2^-4 / sqrt(K) (1.1% at K = 32, this model's
# narrowest); the loss moves far less than that per step, and the steps' errors do not add up
# when the curve is healthy. Tolerance: the mean of the last 10 losses within 2% of bf16's (a
# tenth of the distance the curve falls, 6.2 -> 4.9), every step within 5% (no divergence).
# Measured (2 cores, 200 steps): 0.3% tensorwise, 0.2% rowwise; max step 1.0% and 0.8%.
LAST_MEAN_TOL, STEP_TOL = 0.02, 0.05


def losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def bf16_curve(data_dir, tmp_path_factory) -> list[float]:
    cfg = make_config(data_dir, tmp_path_factory.mktemp("bf16"), *CURVE)
    trainer_for(cfg).fit()
    return losses(cfg.run_dir)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_follows_the_bf16_curve(bf16_curve, data_dir, tmp_path, recipe):
    """200 steps of a 4-layer model with emulated fp8 linears stay on bf16's curve (the
    tolerance above), and the start line says the matmuls are emulated."""
    cfg = make_config(data_dir, tmp_path, *CURVE, *FP8, f"train.fp8.recipe={recipe}")
    with logged() as lines:
        trainer = trainer_for(cfg)
        start = time.perf_counter()
        trainer.fit()
    seconds = time.perf_counter() - start
    blocks = [m for m in trainer.backend.module.layers.modules() if isinstance(m, nn.Linear)]
    assert blocks and all(isinstance(m, Float8Linear) for m in blocks)
    assert f"fp8: {recipe} scaling in 20 block linears, emulated on the CPU" in lines.text
    fp8, bf16 = torch.tensor(losses(cfg.run_dir)), torch.tensor(bf16_curve)
    assert len(fp8) == len(bf16) == 200 and torch.isfinite(fp8).all()
    assert bf16[-10:].mean() < bf16[:10].mean() - 1.0  # the curve really falls
    last = abs(fp8[-10:].mean() / bf16[-10:].mean() - 1)
    worst = ((fp8 - bf16).abs() / bf16).max()
    print(f"{recipe}: last-10 mean {last:.2%}, worst step {worst:.2%}, {seconds:.1f} s")
    assert last <= LAST_MEAN_TOL and worst <= STEP_TOL, (last, worst)


def test_conversion_keeps_names_head_and_odd_widths(data_dir, tmp_path):
    """Only the blocks' linears become Float8Linear, under the same parameter names (so the
    state dict, checkpoints and exports do not change); a linear whose dims are not multiples
    of 16 stays and is named; the embedding and the output head stay."""
    cfg = make_config(data_dir, tmp_path, *FP8, "model.tie_embeddings=false", "model.d_model=40")
    cfg.model.n_heads = 5  # head_dim 8: wqkv 40 -> 120, wo 40 -> 40, the MLP 40 -> 128
    model = build_model(cfg.model)
    before = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    with logged() as lines:
        apply_fp8(model, cfg, plan_for(cfg))
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == before
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == set()  # every block linear has a 40-wide side here
    assert "fp8: 10 linears stay in high precision" in lines.text
    assert "layers.0.attention.wqkv (40 x 120)" in lines.text
    cfg = make_config(data_dir, tmp_path, *FP8, "model.tie_embeddings=false")
    model = build_model(cfg.model)
    apply_fp8(model, cfg, plan_for(cfg))
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert len(converted) == 10 and all(n.startswith("layers.") for n in converted)
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is nn.Embedding


def test_conversion_checks_the_widths_each_tensor_parallel_rank_multiplies(data_dir, tmp_path):
    """Under tensor parallelism each rank's fp8 GEMM has 1/tp of a column-wise linear's outputs
    (wqkv, w1, w3) and of a row-wise one's inputs (wo, w2): an MLP 2752 wide at TP 8 is 344 a
    rank, not a multiple of 16, so its three linears stay and are named with their rank's
    shape; attention (384 and 128 wide: 48 and 16 a rank) converts. One process converts all."""
    keys = ["model.d_model=128", "model.n_heads=8", "model.mlp_hidden=2752"]
    cfg = make_config(data_dir, tmp_path, *FP8, *keys)

    def converted(tp: int) -> set[str]:
        model = build_model(cfg.model)
        apply_fp8(model, cfg, dataclasses.replace(plan_for(cfg), tp_degree=tp))
        return {n.split(".", 2)[2] for n, m in model.named_modules() if isinstance(m, Float8Linear)}

    assert converted(1) == {"attention.wqkv", "attention.wo", *MLP}
    with logged() as lines:
        assert converted(8) == {"attention.wqkv", "attention.wo"}
    assert "fp8: 6 linears stay in high precision" in lines.text
    assert "layers.0.feed_forward.w1 (128 x 2752, 128 x 344 on each of 8 tp ranks)" in lines.text
    assert "layers.0.feed_forward.w2 (2752 x 128, 344 x 128 on each of 8 tp ranks)" in lines.text


MLP = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def test_fp8_checkpoint_resumes_without_fp8_exports_and_generates(data_dir, tmp_path):
    """An fp8 run's checkpoint holds the fp32 weights under the one-process names; the run goes
    on without fp8 from it (exactly: model, optimizer and step), exports to Hugging Face and
    `eval` and `generate` read it."""
    from torch.distributed.checkpoint import FileSystemReader

    from scale_llm import cli
    from scale_llm.export import export

    common = ["checkpoint.every=2", "train.precision=bf16"]
    cfg = make_config(data_dir, tmp_path, *common, *FP8)
    trainer_for(cfg).fit()
    ckpt = cfg.run_dir / "checkpoints" / "step_00000004"
    meta = FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model."): v for k, v in meta.items() if k.startswith("model.")}
    plain = build_model(cfg.model).state_dict()
    assert set(saved) == set(plain)
    assert {v.properties.dtype for v in saved.values()} == {torch.float32}
    scores = io.StringIO()  # `eval` reads the newest checkpoint: the fp8 run's, before resuming
    with contextlib.redirect_stdout(scores):
        argv = ["eval", str(cfg.run_dir), "--perplexity", str(data_dir), "--limit", "2"]
        assert cli.main(argv) == 0
    assert "perplexity" in scores.getvalue()
    on = make_config(data_dir, tmp_path, *common, "train.max_steps=6")  # fp8 off, resumed
    with logged() as lines:
        result = trainer_for(on).fit()
    assert f"resume: continuing from {ckpt} at step 4" in lines.text
    assert sorted(result.losses) == [5, 6] and all(
        map(torch.isfinite, map(torch.tensor, result.losses.values()))
    )
    out = tmp_path / "hf"
    export(ckpt, out, dtype="fp32")
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        argv = ["generate", str(cfg.run_dir), "--checkpoint", str(ckpt), "--prompt", "def "]
        assert cli.main([*argv, "--max-new-tokens", "4"]) == 0
    assert any(line.startswith("def ") for line in text.getvalue().splitlines())


def test_compiled_fp8_blocks_follow_eager_without_graph_breaks(data_dir, tmp_path):
    """train.compile with fp8 linears (emulated, bf16, 3 steps): each block one graph, no graph
    break, no recompilation after the first step, and the eager fp8 curve within 1e-4."""
    keys = [*FP8, "train.precision=bf16", "train.max_steps=3"]
    eager = trainer_for(make_config(data_dir, tmp_path / "eager", *keys)).fit().losses
    torch._dynamo.reset()
    trainer = trainer_for(make_config(data_dir, tmp_path / "compiled", *keys, "train.compile=true"))
    compiled, graphs, breaks = fit_counting_graphs(trainer)
    assert breaks == {}
    assert graphs == [2] * 3  # one graph for every block, one for the loss; none recompiled
    for s in eager:
        assert abs(compiled[s] - eager[s]) <= 1e-4 * eager[s], s


def _plan(backend: str, device: str, precision: str = "bf16") -> RunPlan:
    return RunPlan(0, 0, 1, torch.device(device), backend, precision, 1, 4, 1, 32)


def test_preflight_refuses_a_gpu_without_fp8_matmuls(data_dir, tmp_path):
    """A GPU below compute capability 8.9 (an A100 is 8.0) is refused naming the key; an H100
    (9.0) and the CPU (emulated) pass. The capability is stubbed: no GPU here."""
    cfg = make_config(data_dir, tmp_path, *FP8)
    with pytest.raises(UserError, match=r"compute capability 8.9 or newer .* is 8\.0: set train"):
        check_fp8(cfg, _plan("fsdp", "cuda:0"), capability=(8, 0))
    check_fp8(cfg, _plan("fsdp", "cuda:0"), capability=(9, 0))
    check_fp8(cfg, _plan("single", "cpu"))
    check_fp8(make_config(data_dir, tmp_path), _plan("ddp", "cuda:0"), capability=(7, 0))


def test_float8_config_follows_the_recipe_and_the_backend(data_dir, tmp_path):
    """FSDP2 gathers fp8 weights by default with tensorwise scales only, and only under FSDP2;
    GEMMs are emulated off a GPU; rowwise takes torchao's rowwise recipe."""
    from torchao.float8.config import ScalingGranularity

    def config(backend: str, device: str, *keys: str):
        return float8_config(make_config(data_dir, tmp_path, *FP8, *keys), _plan(backend, device))

    assert config("fsdp", "cuda:0").enable_fsdp_float8_all_gather
    assert not config("fsdp", "cuda:0").emulate and config("fsdp", "cpu").emulate
    assert not config("single", "cuda:0").enable_fsdp_float8_all_gather
    off = config("fsdp", "cuda:0", "train.fp8.fsdp_float8_all_gather=false")
    assert not off.enable_fsdp_float8_all_gather
    rowwise = config("fsdp", "cuda:0", "train.fp8.recipe=rowwise")
    assert not rowwise.enable_fsdp_float8_all_gather
    assert rowwise.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE


# ----------------------------------------------------------------------------- the estimate
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_cast_term_is_what_a_linear_backward_allocates(recipe):
    """The estimate's eager fp8 casts (`fp8_cast_bytes`) are what an fp8 linear of the MLP's
    up-projection shape allocates in its backward beyond its input gradient, traced on fake
    tensors with the GPU's fp8 GEMM (not emulated): to the byte."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from scale_llm.analysis.memory.activations import fp8_cast_bytes, numerics_for
    from scale_llm.analysis.memory.measure import LiveStorages
    from scale_llm.config import load_config
    from scale_llm.config.sections import mlp_hidden_size

    m = load_config(None, ["model.d_model=256", "model.seq_len=128"]).model
    batch, K, N = 4, m.d_model, mlp_hidden_size(m)
    M = batch * m.seq_len
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=False)
    with FakeTensorMode():
        linear = nn.Sequential(nn.Linear(K, N, bias=False, dtype=torch.bfloat16))
        linear = convert_to_float8_training(linear, config=config)[0]
        live = LiveStorages(fake=True)
        with live._mode:
            x = torch.randn(M, K, dtype=torch.bfloat16).requires_grad_()
            y = linear(x)
            grad, start = torch.ones_like(y), live.live
            live.peak, live._in_window = live.live, True
            y.backward(grad)
    num = numerics_for("bf16", "fsdp", fp8=True)
    assert live.peak - start - 2 * M * K == fp8_cast_bytes(m, batch, num, recipe, fused=False)


def test_estimate_counts_fp8_casts_and_the_fp8_gather():
    """7B on 8 GPUs under FSDP2: the fp8 gather holds the blocks' linear weights at 1 byte
    (the gathered parameters at the peak drop by their other byte), and each block's backward
    holds the casts; one process in bf16 saves no autocast copies of the linears' weights."""
    from scale_llm.analysis.memory.activations import block_matmul_params
    from scale_llm.analysis.memory.gpu import estimate
    from scale_llm.config import load_config
    from tests.helpers import REPO

    def est(*keys: str, world: int = 8):
        cfg = load_config(REPO / "yaml" / "7b.yaml", ["parallel.backend=fsdp", *keys])
        return estimate(cfg, world)

    bf16, fp8 = est(), est(*FP8)
    phase = "block 31 backward"  # the last block: the root and two blocks gathered
    saved = 2 * block_matmul_params(fp8.model)  # two blocks' linears (2 bytes -> 1)
    assert bf16.parts[phase]["params"] - fp8.parts[phase]["params"] == saved
    m, tokens, F = fp8.model, fp8.layout.micro_batch * fp8.model.seq_len, 11008
    casts = 2 * tokens * F + m.d_model * F + tokens * m.d_model + 12  # compiled: fused
    assert fp8.parts[phase]["temporaries"] - bf16.parts[phase]["temporaries"] == casts
    assert "fp8 tensorwise linears" in fp8.layout.describe()
    rowwise = est(*FP8, "train.fp8.recipe=rowwise")
    assert rowwise.parts[phase]["params"] == bf16.parts[phase]["params"]  # gathered in bf16
    one = [est("parallel.backend=single", *keys, world=1) for keys in ([], FP8)]
    drop = {
        p: one[0].parts[p]["activations"] - one[1].parts[p]["activations"] for p in one[0].parts
    }
    copies = 2 * block_matmul_params(m)  # a block's autocast copies (all 32 checkpointed)
    assert drop["loss forward"] == 32 * copies and drop["block 0 backward"] == copies


def test_torchao_imports_quietly_off_a_gpu():
    """On the CPU, importing torchao says nothing of the CUDA kernel libraries and Triton it
    cannot load, nor torch's deprecation of how it registers an enum (a fresh interpreter:
    torchao imports once)."""
    import subprocess
    import sys

    from tests.helpers import REPO, env

    code = "import logging; logging.basicConfig(); from scale_llm.parallel import fp8; "
    proc = subprocess.run(
        [sys.executable, "-c", code + "fp8._import_torchao(quiet=True)"],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stderr and "triton" not in proc.stderr, proc.stderr
    assert "KernelPreference" not in proc.stderr


def test_runs_without_fp8_never_import_torchao():
    """Tensor parallelism asks each block for its styles, and the backends convert: without
    train.fp8 neither imports torchao (a fresh interpreter), so runs work where it is absent."""
    import subprocess
    import sys

    from tests.helpers import REPO, env

    code = (
        "import sys, types; from scale_llm.config import load_config; "
        "from scale_llm.model import build_model; from scale_llm.parallel import fp8; "
        "from tests.helpers import plan_for; cfg = load_config(None, []); "
        "model = build_model(cfg.model); fp8.apply_fp8(model, cfg, plan_for(cfg)); "
        "print(fp8.tp_styles(model.layers[0], types.SimpleNamespace(device_type='cuda'))); "
        "assert 'torchao' not in sys.modules, 'imported'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ColwiseParallel" in proc.stdout and "Float8" not in proc.stdout


# ------------------------------------------------------------- tensor parallelism's activations
TP_GATHERS = r"""
import dataclasses, json, types
import torch, torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from scale_llm.config import load_config
from scale_llm.model import build_model
from scale_llm.parallel import fp8, tensor_parallel
from tests.helpers import TINY_MODEL, plan_for

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = DeviceMesh("cpu", torch.arange(2))
cfg = load_config(None, TINY_MODEL + ["train.fp8.enabled=true", "train.device=cpu"])
plan = plan_for(cfg)
plan = dataclasses.replace(plan, tp_degree=2)
real = fp8.tp_styles


class Gathers(TorchDispatchMode):  # what each all-gather carries: (tensor type, element dtype)
    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if "all_gather" in str(func):
            data = getattr(args[0], "_data", args[0])  # (a Float8TrainingTensor's fp8 data)
            self.seen.append((type(args[0]).__name__, str(data.dtype)))
        return func(*args, **(kwargs or {}))


def gathers(gpu):
    # the styles a GPU's mesh gets (a CPU one's otherwise), on a CPU mesh whose process group
    # carries any dtype (torch's fake one: no data moves, so only the structure is real)
    tensor_parallel.tp_styles = lambda block, m: real(block, types.SimpleNamespace(
        device_type="cuda" if gpu else m.device_type))
    torch.manual_seed(0)
    model = build_model(cfg.model)
    fp8.apply_fp8(model, cfg, plan)
    tensor_parallel.apply_tensor_parallel(model, mesh, sequence_parallel=True)
    mode = Gathers()
    mode.seen = []
    with mode:
        out = model(torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len)))
    out.to_local().float().square().mean().backward()  # (runs: the values are the fake's)
    return {"gathers": mode.seen}


print(json.dumps({"gpu": gathers(True), "cpu": gathers(False)}))
"""


def test_tensor_parallel_gathers_fp8_activations_on_gpus():
    """The fp8 tensor-parallel plan a GPU gets (tensorwise): attention's and the MLP's input
    is cast to fp8 on its sequence shard and all-gathered as fp8 once, which wqkv, or w1 and
    w3, read as it is (torchao's PrepareFloat8ModuleInput, torchtitan's plan); the final norm's
    output, read by the high-precision head, is gathered as it was. Its forward and backward
    run on 2 fake ranks (torch's fake process group: gloo carries no fp8, and no GPU here);
    the CPU's plain plan gathers every activation in the run's precision."""
    import subprocess
    import sys

    from tests.helpers import REPO, env

    proc = subprocess.run(
        [sys.executable, "-c", TP_GATHERS], cwd=REPO, env=env(), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    fp8, plain = ["Float8TrainingTensor", "torch.float8_e4m3fn"], ["Tensor", "torch.float32"]
    assert result["gpu"]["gathers"] == [fp8] * 4 + [plain]  # 2 blocks x (attention, MLP), norm
    assert result["cpu"]["gathers"] == [plain] * 5


def test_fp8_tensor_parallel_plan_on_gpus():
    """The block plan of the fp8 path: PrepareFloat8ModuleInput takes attention's and the MLP's
    first input from the sequence shards (Shard(1)) to Replicate, in fp8; the column-wise
    Float8 styles take it replicated, the row-wise ones reduce-scatter into the stream. The
    CPU and the rowwise recipe keep the plain styles and gather in the run's precision."""
    import types

    from torch.distributed.tensor import Replicate, Shard
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from scale_llm.config import load_config
    from scale_llm.parallel.fp8 import tp_styles
    from scale_llm.parallel.tensor_parallel import block_plan
    from tests.helpers import TINY_MODEL

    def block(*keys: str) -> nn.Module:
        cfg = load_config(None, [*TINY_MODEL, *FP8, "train.device=cpu", *keys])
        model = build_model(cfg.model)
        apply_fp8(model, cfg, plan_for(cfg))
        return model.layers[0]

    gpu, cpu = types.SimpleNamespace(device_type="cuda"), types.SimpleNamespace(device_type="cpu")
    styles = tp_styles(block(), gpu)
    assert styles == (Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput)
    plan = block_plan(*styles, Shard(1))
    assert type(plan["attention"]) is type(plan["feed_forward"]) is PrepareFloat8ModuleInput
    assert plan["attention"].input_layouts == (Shard(1), None, None, None, None)
    assert plan["attention"].desired_input_layouts == (Replicate(), None, None, None, None)
    assert plan["feed_forward"].input_layouts == (Shard(1),)
    assert plan["feed_forward"].desired_input_layouts == (Replicate(),)
    for name in ("attention.wqkv", "feed_forward.w1", "feed_forward.w3"):
        assert type(plan[name]) is Float8ColwiseParallel
        assert plan[name].input_layouts == (Replicate(),)
    for name in ("attention.wo", "feed_forward.w2"):
        assert type(plan[name]) is Float8RowwiseParallel
        assert plan[name].output_layouts == (Shard(1),)
    for styles in (tp_styles(block(), cpu), tp_styles(block("train.fp8.recipe=rowwise"), gpu)):
        assert styles[2] is None and "attention" not in block_plan(*styles, Shard(1))


# ----------------------------------------------------------------------------- FSDP2's scales
PRECOMPUTE = r"""
import json, sys
import torch, torch.distributed as dist
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
from scale_llm.config import load_config
from scale_llm.config.plan import Launch, resolve_plan
from scale_llm.model import build_model
from scale_llm.parallel.backend import build_backend
from scale_llm.parallel.step import optimizer_step
from tests.helpers import TINY_MODEL, leave_world

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.set_num_threads(1)
keys = TINY_MODEL + sys.argv[1:] + [
    "parallel.backend=fsdp", "train.device=cpu", "train.compile=false", "train.fp8.enabled=true",
    "train.precision=bf16", "train.micro_batch_size=2", "train.grad_accum=1"]
cfg = load_config(None, keys)
plan = resolve_plan(cfg, Launch())
torch.manual_seed(0)
data = torch.randint(0, cfg.model.vocab_size, (3, 2, cfg.model.seq_len + 1))


def run(precompute):
    backend = build_backend(cfg, plan)
    model = backend.setup(build_model(cfg.model))
    hooks = len(backend.optimizer._optimizer_step_post_hooks)
    if not precompute:
        backend.optimizer._optimizer_step_post_hooks.clear()
    losses, scales = [], []
    for batch in data:
        loss, _ = optimizer_step(backend, model, [(batch[:, :-1], batch[:, 1:])])
        losses.append(loss.item())
        weights = [p._local_tensor for p in model.parameters()]
        weights = [w for w in weights if isinstance(w, WeightWithDynamicFloat8CastTensor)]
        # each set scale against max / amax of its whole weight now (a world of one)
        scales.append([None if w._precomputed_scale is None else
                       (w._precomputed_scale.item(), 448.0 / w._tensor.abs().max().double().item())
                       for w in weights])
    return {"hooks": hooks, "losses": losses, "scales": scales}


print(json.dumps({"on": run(True), "off": run(False)}))
leave_world()  # (a gloo world can abort in interpreter shutdown)
"""


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fsdp2_fp8_gather_precomputes_the_scales_after_each_step(recipe):
    """Tensorwise fp8 weights gathered by FSDP2 (gloo, a world of one, in a process of its own):
    after every optimizer step each weight holds the scale torchao's precompute made in one
    all-reduce (max / amax of the weight just stepped), and the losses equal those of the same
    run with the hook removed (the gather then reduces each weight's amax itself). Rowwise
    gathers in high precision: no hook. (The FSDP2 x TP fp8 run on 4 gloo ranks in
    test_tensor_parallel.py runs through it too.)"""
    import subprocess
    import sys

    from tests.helpers import REPO, env

    proc = subprocess.run(
        [sys.executable, "-c", PRECOMPUTE, f"train.fp8.recipe={recipe}"],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    on, off = json.loads(proc.stdout.splitlines()[-1]).values()
    print(recipe, on["losses"], off["losses"])
    if recipe == "rowwise":
        assert on["hooks"] == 0 and on["scales"] == [[]] * 3
        return
    assert on["hooks"] == 1 and len(on["scales"][0]) == 10  # 2 blocks x 5 linears
    for step in on["scales"]:
        for precomputed, expected in step:
            assert precomputed == pytest.approx(expected, rel=1e-6)
    assert all(s is None for step in off["scales"] for s in step)
    assert on["losses"] == off["losses"]


# ----------------------------------------------------------------------------- gpu-check (g)
def test_gpu_check_compares_fp8_with_bf16_in_its_report(corpus_dir, data_dir, tmp_path):
    """launch/gpu-check.sh --fp8-only on the CPU (its dry run: eager, emulated fp8, the tiny
    model over the tests' data, 4 steps): three runs of one config, bf16 then fp8 tensorwise
    and rowwise; report.json's "fp8" holds each run's losses and tokens/s, the speed-up and the
    loss differences against bf16; report.md gains section (g)."""
    import subprocess

    from tests.helpers import REPO, TINY_MODEL, env

    data = [f"data.source={corpus_dir}", f"data.dir={data_dir}", "data.val_fraction=0.1"]
    data += ["data.tokenizer_sample_bytes=500000", "train.micro_batch_size=4"]
    sets = [x for key in [*TINY_MODEL, *data] for x in ("--set", key)]
    out = tmp_path / "report"
    environ = env() | {"SCALE_LLM_CHECK_FP8_STEPS": "4"}
    sets += ["--scratch", str(tmp_path / "scratch")]
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "gpu-check.sh"), str(out), "--fp8-only", *sets],
        cwd=REPO, env=environ, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())["fp8"]
    assert report["skipped"] is None and report["emulated"] and report["steps"] == 4
    bf16, *fp8 = report["rows"]
    assert [r["run"] for r in report["rows"]] == ["bf16", "fp8 tensorwise", "fp8 rowwise"]
    assert bf16["fp8"] is None and sorted(bf16["losses"]) == ["1", "2", "3", "4"]
    for row, recipe in zip(fp8, ("tensorwise", "rowwise"), strict=True):
        assert row["fp8"].startswith(f"{recipe} scaling in 10 block linears, emulated on the CPU")
        assert row["speedup"] > 0 and row["tokens_per_s"] > 0
        last = row["losses"]["4"] / bf16["losses"]["4"] - 1
        assert row["loss_diff_last"] == pytest.approx(last) and row["ok"], row
    text = (out / "report.md").read_text()
    assert "## (g) fp8 against bf16" in text and "| fp8 rowwise |" in text
    assert [p.name for p in (tmp_path / "scratch").iterdir()] == []  # its runs removed
    print(text)


def test_gpu_check_reads_its_settings_before_any_work(tmp_path):
    """SCALE_LLM_CHECK_FP8_STEPS=abc was a traceback after the report folder was claimed (and
    left holding the claim alone); --calibration-only on a machine without a GPU printed
    nothing and exited 0. Each is one line and exit 2 now, the folder not made."""
    import shutil
    import subprocess

    from tests.helpers import REPO, env

    out = tmp_path / "report"
    cases = {
        ("--fp8-only",): {"SCALE_LLM_CHECK_FP8_STEPS": "abc"},
        ("--calibration-only",): {"SCALE_LLM_CHECK_STEPS": "0"},
        (): {"SCALE_LLM_CHECK_THREADS": "-1"},
    }
    for flags, bad in cases.items():
        (name, value), *_ = bad.items()
        proc = subprocess.run(
            ["bash", str(REPO / "launch" / "gpu-check.sh"), str(out), *flags],
            cwd=tmp_path, env=env() | bad, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        said = f"gpu-check: {name}={value} is not a whole number from 1 to 999999"
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()
    if shutil.which("nvidia-smi") or torch.cuda.is_available():
        pytest.skip("with a GPU, --calibration-only runs section (f)")
    calm = {k: v for k, v in env().items() if k != "SCALE_LLM_CHECK_CALIBRATION"}
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "gpu-check.sh"), str(out), "--calibration-only"],
        cwd=tmp_path, env=calm, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "--calibration-only runs section (f)" in proc.stderr
    assert not out.exists()


def test_an_fsdp2_checkpoint_gathering_fp8_weights_is_read_without_fp8(data_dir, tmp_path):
    """FSDP2 gathering fp8 weights wraps each in torchao's WeightWithDynamicFloat8CastTensor
    (the moments too): saved as it was, that class was pickled into the checkpoint, and export,
    convert, generate, eval and a resume without fp8, none of which imports torchao.float8,
    stopped with an UnpicklingError traceback. A process that has not imported torchao."""
    from scale_llm.config import save_config
    from tests.helpers import run

    fsdp = ["parallel.backend=fsdp", "checkpoint.every=2"]
    save_config(make_config(data_dir, tmp_path, *FP8, *fsdp), tmp_path / "fp8.yaml")
    run([sys.executable, "-m", "scale_llm", "train", str(tmp_path / "fp8.yaml")], tmp_path)
    run_dir = tmp_path / "test"
    convert = ["convert", str(run_dir), "--out", str(tmp_path / "model.pt")]
    run([sys.executable, "-m", "scale_llm", *convert], tmp_path)
    state = torch.load(tmp_path / "model.pt", weights_only=True)["model"]
    assert {type(t) for t in state.values()} == {torch.Tensor}
    more = ["--set", "train.max_steps=6"]  # (and resumed with fp8: plain tensors read back)
    done = run(
        [sys.executable, "-m", "scale_llm", "train", str(tmp_path / "fp8.yaml"), *more], tmp_path
    )
    assert "resume: continuing from" in done.stdout and "step 6/6" in done.stdout


def test_a_checkpoint_of_torchaos_fp8_weight_class_is_named_in_one_paragraph(tmp_path):
    """A checkpoint saved before its weights were unwrapped holds torchao's class: read by a
    process that has not imported torchao.float8 (export, a resume without fp8), DCP's
    CheckpointException wrapping the UnpicklingError was a traceback."""
    import torch.distributed.checkpoint as dcp
    from torchao.float8.float8_linear import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Wrapped

    wrapped = Wrapped(torch.ones(4, 4), LinearMMConfig(), torch.float8_e4m3fn)
    dcp.save({"model": {"w": wrapped}}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    read = f"""
import torch
from scale_llm.components.serialization import dcp_load
from scale_llm.errors import UserError
try:
    dcp_load({{"model": {{"w": torch.empty(4, 4)}}}}, {str(tmp_path / "dcp")!r}, True)
except UserError as e:
    print(e)
"""
    done = subprocess.run([sys.executable, "-c", read], env=env(), capture_output=True, text=True)
    assert "its tensors were saved inside torchao's fp8 weight class" in done.stdout, done.stderr
