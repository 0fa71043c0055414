"""The Hugging Face bridges: export to LlamaForCausalLM, the tokenizer, model.init_from, eval.

One tiny 4-step run (the test session's prepared data) is exported once; transformers loads the
export and must give our logits, our greedy tokens and our token ids. Import is checked by a
bit-identical round trip and by the first loss of runs started from the export (one process,
and 2-rank FSDP2 / ZeRO-3 runs whose checkpoints are exported again). `scale-llm eval` runs
lm-evaluation-harness offline on a tiny task shipped in tests/data/eval_task, and its accuracy
is recomputed here from our own model's log-likelihoods.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from scale_llm import cli
from scale_llm.config import ModelConfig
from scale_llm.data.shards import read_manifest
from scale_llm.data.tokenizer import Tokenizer
from scale_llm.errors import UserError
from scale_llm.export import default_dtype, export, write_hf_folder
from scale_llm.generate import generate, load_run, read_run_config
from scale_llm.model import build_model
from tests.helpers import (
    BACKENDS,
    REPO,
    SPLIT,
    Runs,
    finished_run,
    first_batch_loss,
    init_weights,
    plan_for,
    rows_of,
    trainer_for,
    wanted,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TASK_DIR = REPO / "tests" / "data" / "eval_task"
TASK = "scale_llm_tiny_mc"
ROLLING = "scale_llm_tiny_rolling"  # each question scored as a whole document
TEXTS = [
    "",
    "def f(x):\n    return x + 1\n",
    "class A:\n    def __init__(self):\n        self.items = {'a': [1, 2, 3]}\n\n\n",
    "x   =    1      # runs of spaces",
    "\t\tindented with tabs\n\t\n\r\n",
    "    leading and trailing    ",
    "unicode: héllo wörld naïve café 😀🚀 中文字符 日本語 한국어 ∑∫√",
    "digits 1234567890 3.14159 1e-5 0xDEADBEEF 2024-11-30",
    "a literal <s> and </s> and <unk> in the text",
]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    """Nothing here may reach the network; datasets caches under the test's temp dir."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def run_dir(data_dir, tmp_path_factory) -> Path:
    """4 steps of the tiny model, with val_loss at step 4 (2 batches) and TensorBoard on."""
    root = tmp_path_factory.mktemp("hf_runs")
    return finished_run(data_dir, root, "eval.every=4", "eval.steps=2", "logging.tensorboard=true")


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_export") / "tiny"
    export(run_dir, out)
    return out


@pytest.fixture(scope="module")
def ours(run_dir):
    cfg = read_run_config(run_dir)
    model, tok = load_run(run_dir, cfg, plan_for(cfg))
    return model, tok


@pytest.fixture(scope="module")
def theirs(exported):
    model = transformers.LlamaForCausalLM.from_pretrained(exported, dtype=torch.float32)
    return model.eval()


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(f))
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


# ----------------------------------------------------------------------------- export


def test_export_writes_a_llama_folder(exported, run_dir):
    names = {p.name for p in exported.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "scale_llm_export.json",
    } == names
    hf = json.loads((exported / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"]
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]) == (32, 2, 4)
    assert hf["num_key_value_heads"] == 4 and hf["intermediate_size"] == 128
    assert hf["max_position_embeddings"] == 32 and hf["tie_word_embeddings"] is True
    assert hf["rope_theta"] == 10000.0 and hf["rms_norm_eps"] == 1e-5
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (1, 2, 2)
    assert hf["torch_dtype"] == "float32"  # an fp32 run exports fp32 by default
    config = transformers.AutoConfig.from_pretrained(exported)
    assert config.rope_parameters["rope_theta"] == 10000.0
    gen = transformers.GenerationConfig.from_pretrained(exported)
    assert (gen.eos_token_id, gen.pad_token_id, gen.temperature, gen.top_k) == (2, 2, 0.8, 50)
    info = json.loads((exported / "scale_llm_export.json").read_text())
    assert info["step"] == 4 and info["checkpoint"].endswith("step_00000004")
    assert (exported / "tokenizer.model").read_bytes() == (run_dir / "tokenizer.model").read_bytes()
    assert "lm_head.weight" not in hf_tensors(exported)  # tied: transformers ties it back
    modes = {p.name: p.stat().st_mode & 0o777 for p in exported.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"]  # readable like the rest


def test_dtype_rule():
    assert [default_dtype(p) for p in ("bf16", "fp16", "fp32")] == ["bf16", "bf16", "fp32"]


def test_logits_equal_ours(ours, theirs):
    model, _ = ours
    tokens = torch.randint(0, 512, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mine, hf = model(tokens), theirs(tokens).logits
    assert mine.std() > 0.1  # trained logits, not a constant
    assert (mine - hf).abs().max().item() <= 1e-5


def test_greedy_generation_equals_scale_llm_generate(ours, theirs, exported, run_dir, capsys):
    model, tok = ours
    prompt = "def "
    ids = tok.encode(prompt, bos=True)
    mine = generate(model, ids, 20, temperature=0, eos_id=tok.eos_id)
    out = theirs.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20)
    hf_ids = out[0, len(ids) :].tolist()
    assert hf_ids == mine  # (4 steps in, the tiny run repeats itself: see the random model's)
    args = ["generate", str(run_dir), "--prompt", prompt, "--temperature", "0"]
    assert cli.main([*args, "--max-new-tokens", "20"]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert (
        capsys.readouterr().out == prompt + hf_tok.decode(hf_ids, skip_special_tokens=True) + "\n"
    )


def test_tokenizer_gives_our_ids(exported, ours, corpus_dir):
    _, tok = ours
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    code = sorted(corpus_dir.glob("*.py"))[0].read_text()[:20000]
    for text in [*TEXTS, code]:
        ids = hf_tok(text)["input_ids"]
        assert ids == tok.encode(text, bos=True), repr(text[:40])  # BOS first, no EOS
        assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text, bos=False)
        assert hf_tok.decode(ids, skip_special_tokens=True) == text
    assert hf_tok("")["input_ids"] == [1]
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (1, 2, 2)
    # two documents as the training stream has them: [BOS] a [EOS] [BOS] b
    pair = hf_tok("x = 1", "y = 2")["input_ids"]
    assert pair == tok.encode("x = 1", eos=True) + tok.encode("y = 2")


def test_sharded_export_loads_the_same(run_dir, exported, tmp_path):
    out = tmp_path / "sharded"
    assert cli.main(["export", str(run_dir), "--out", str(out), "--max-shard-size", "40KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == set(shards)
    tensors = hf_tensors(out)
    for shard in shards:  # at most 40 kB of tensors, or one tensor that is larger alone
        held = [n for n, f in index["weight_map"].items() if f == shard]
        assert len(held) == 1 or sum(tensors[n].numel() * 4 for n in held) <= 40_000
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    assert_same_tensors(tensors, hf_tensors(exported))
    model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = torch.randint(0, 512, (1, 16))
    reference = transformers.LlamaForCausalLM.from_pretrained(exported, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)


def test_bf16_export(run_dir, exported, tmp_path):
    out = tmp_path / "bf16"
    assert cli.main(["export", str(run_dir), "--out", str(out), "--dtype", "bf16"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    fp32 = hf_tensors(exported)
    for name, t in hf_tensors(out).items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, fp32[name].to(torch.bfloat16))


def test_export_is_all_or_nothing(run_dir, tmp_path, monkeypatch):
    out = tmp_path / "atomic"
    import scale_llm.export as export_module

    def fail(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(export_module, "write_tokenizer_files", fail)
    with pytest.raises(OSError, match="simulated"):
        export(run_dir, out)
    assert list(tmp_path.iterdir()) == []  # neither --out nor the temporary folder is left
    monkeypatch.undo()
    export(run_dir, out)
    with pytest.raises(UserError, match="already exists"):
        export(run_dir, out)
    before = (out / "config.json").stat().st_ino
    export(run_dir, out, dtype="bf16", force=True)
    assert (out / "config.json").stat().st_ino != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atomic"]


def test_an_fp16_export_refuses_weights_past_fp16s_range(run_dir, tmp_path):
    """A weight above 65504 became inf in the fp16 files without a word; refused, naming the
    tensor and the fix, and nothing is left behind. bf16 takes the same weights."""
    model = random_model()
    with torch.no_grad():
        model.layers[1].feed_forward.w2.weight[0, 0] = 1e5
    state = lambda: {k: v.clone() for k, v in model.state_dict().items()}  # noqa: E731
    tokenizer = Tokenizer(run_dir / "tokenizer.model")
    said = r"--dtype fp16: model.layers.1.mlp.down_proj.weight holds a value of magnitude 1e\+05"
    with pytest.raises(UserError, match=said + r", past fp16's 65504 .*\(--dtype bf16\)"):
        write_hf_folder(state(), model.cfg, tokenizer, tmp_path / "fp16", "fp16")
    assert list(tmp_path.iterdir()) == []
    write_hf_folder(state(), model.cfg, tokenizer, tmp_path / "bf16", "bf16")


def test_integer_weights_are_refused_with_their_shapes(exported, tmp_path):
    """A folder whose safetensors hold an integer tensor: the preflight reads every tensor's
    shape (HFWeights.shapes) and, for those the model reads, its dtype (it said ok, and train
    refused later)."""
    from safetensors.torch import load_file, save_file

    from scale_llm.components.hf_files import HFWeights

    folder = tmp_path / "ints"
    shutil.copytree(exported, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int16)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    read = HFWeights(folder, "model.init_from")
    with pytest.raises(UserError, match=r"model.norm.weight in .* holds torch.int16 values, not"):
        read.shapes({"model.norm.weight", "lm_head.weight"})
    assert read.shapes({"lm_head.weight"})["model.norm.weight"] == (32,)  # one it does not read


def test_weights_transformers_reads_are_read_and_others_refused_before_any_work(exported, tmp_path):
    """A pickled embedding saved as a transposed view (transformers loads it) was a traceback
    (`view size is not compatible`) after the preflight said ok; so were an fp4 norm in
    safetensors, and sparse or meta tensors in a pickle. The view is read; the others are
    refused by the preflight's read of the shapes, naming the tensor."""
    from safetensors.torch import load_file, save_file

    from scale_llm.components.hf_files import HFWeights

    tensors = load_file(exported / "model.safetensors")
    needed = {"model.norm.weight", "model.embed_tokens.weight"}
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(exported / "config.json", folder)
    head = tensors["model.embed_tokens.weight"]
    for kind, value in [
        ("a transposed view", head.t().contiguous().t()),
        ("torch.float32 (torch.sparse_coo, on cpu)", head.to_sparse()),
        ("torch.float32 (torch.strided, on meta)", head.to("meta")),
    ]:
        torch.save({**tensors, "model.embed_tokens.weight": value}, folder / "pytorch_model.bin")
        read = HFWeights(folder, "model.init_from")
        if kind == "a transposed view":
            assert not value.is_contiguous()
            read.shapes(needed)
            assert torch.equal(read.get("model.embed_tokens.weight"), head)
            continue
        with pytest.raises(
            UserError, match=rf"model.embed_tokens.weight in .* holds {re.escape(kind)} "
        ):
            read.shapes(needed)
        with pytest.raises(UserError, match="not floating-point weights scale_llm reads"):
            read.get("model.embed_tokens.weight")
    (folder / "pytorch_model.bin").write_bytes(
        b""
    )  # (a checkpoint's advice, to delete it, was given)
    with pytest.raises(UserError, match="damaged or incomplete .*; download the model again, or"):
        HFWeights(folder, "model.init_from")
    # a sharded pickle whose second shard holds a tensor the index sends to the first: the last
    # file read won, without a word
    torch.save(tensors, folder / "p1.bin")
    torch.save({"model.norm.weight": tensors["model.norm.weight"] + 1}, folder / "p2.bin")
    weight_map = {**dict.fromkeys(tensors, "p1.bin"), "extra": "p2.bin"}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(UserError, match=r"p2.bin holds 'model.norm.weight', which .* sends to"):
        HFWeights(folder, "model.init_from").shapes(needed)
    for name in ("p1.bin", "p2.bin", "pytorch_model.bin.index.json"):
        (folder / name).unlink()
    fp4 = {**tensors, "model.norm.weight": torch.zeros(32, dtype=torch.uint8)}
    fp4["model.norm.weight"] = fp4["model.norm.weight"].view(torch.float4_e2m1fn_x2)
    save_file(fp4, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"model.norm.weight in .* holds F4 values, not"):
        HFWeights(folder, "model.init_from").shapes(needed)


def random_model(**shape) -> torch.nn.Module:
    """A model of the tiny vocabulary with random weights: a wider init (so that logits differ
    visibly between tokens) and norm weights that are not all ones (they are mapped too)."""
    cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, seq_len=32, **shape)
    cfg.init_std = 0.1
    torch.manual_seed(3)
    model = build_model(cfg, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def export_model(model, tokenizer_path: Path, out: Path):
    """Write `model` as an HF folder and load it back with transformers."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    write_hf_folder(state, model.cfg, Tokenizer(tokenizer_path), out, "fp32")
    return transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)


def max_logit_diff(model, hf) -> float:
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        mine = model(tokens)
        assert mine.std() > 0.1
        return (mine - hf(tokens).logits).abs().max().item()


@pytest.mark.parametrize(
    "shape",
    [
        {"n_kv_heads": 2},  # grouped-query attention, tied
        {"tie_embeddings": False},
        {"n_kv_heads": 1, "tie_embeddings": False, "mlp_hidden": 96, "rope_theta": 500000.0},
    ],
    ids=["gqa", "untied", "mqa-untied"],
)
def test_other_shapes_export_with_the_same_logits(shape, run_dir, tmp_path):
    model = random_model(**shape)
    hf = export_model(model, run_dir / "tokenizer.model", tmp_path / "out")
    names = hf_tensors(tmp_path / "out").keys()
    assert ("lm_head.weight" in names) == (not model.cfg.tie_embeddings)
    assert max_logit_diff(model, hf) <= 1e-5


def test_a_document_masked_model_exports_saying_transformers_attends_across_documents(
    run_dir, tmp_path, logs
):
    """transformers' Llama has no per-document mask: the export of an attention_mask=document
    run computes other logits wherever an input holds a document end (lm-eval's EOS prefix:
    log-probabilities 7 apart), and nothing said so. The export says it; one document's logits
    are the same."""
    model = random_model(attention_mask="document", document_end_id=2)
    hf = export_model(model, run_dir / "tokenizer.model", tmp_path / "out")
    tokens = torch.randint(3, 512, (1, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max() <= 1e-5
    said = [line for line in logs if "model.attention_mask=document" in line]
    assert len(said) == 1 and "causal attention over the whole input" in said[0]
    assert "eval.tasks and eval --tasks score through this export" in said[0]


def test_greedy_generation_of_a_random_model(run_dir, tmp_path):
    """Varied tokens (a random model does not repeat itself): ours with the KV cache and
    transformers' with its own cache pick the same ones."""
    model = random_model(n_kv_heads=2, tie_embeddings=False)
    hf = export_model(model, run_dir / "tokenizer.model", tmp_path / "out")
    prompt = [1, 100, 200, 300]
    mine = generate(model, prompt, 24, temperature=0)
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24)
    assert out[0, len(prompt) :].tolist() == mine and len(set(mine)) > 5


def test_rotary_needs_no_permutation(run_dir, tmp_path):
    """The control for the parity above: with the q and k rows permuted the way Meta's
    interleaved RoPE checkpoints need (pairs (2i, 2i+1) <-> (i, i + D/2)), logits disagree."""
    model = random_model(n_kv_heads=2)
    folder = tmp_path / "out"
    assert max_logit_diff(model, export_model(model, run_dir / "tokenizer.model", folder)) <= 1e-5
    tensors = hf_tensors(folder)
    head_dim = 16
    perm = torch.arange(head_dim).view(2, -1).t().reshape(-1)  # 0, 8, 1, 9, ...
    for name, t in tensors.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = t.view(-1, head_dim, t.size(1))[:, perm].reshape(t.shape).contiguous()
    safetensors_torch.save_file(tensors, folder / "model.safetensors", {"format": "pt"})
    permuted = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert max_logit_diff(model, permuted) > 1e-2


# ----------------------------------------------------------------------------- import


def init_cfg(run_dir: Path, folder: Path) -> ModelConfig:
    """The run's model section with init_from set to `folder`."""
    return replace(read_run_config(run_dir).model, init_from=str(folder))


def sha(data_dir: Path) -> str:
    return read_manifest(data_dir)["tokenizer"]["sha256"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_import_then_export_is_bit_identical(dtype, run_dir, exported, data_dir, tmp_path):
    first = exported
    if dtype == "bf16":
        first = tmp_path / "first"
        export(run_dir, first, dtype="bf16")
    cfg = init_cfg(run_dir, first)
    state = init_weights(cfg, sha(data_dir))
    info = json.loads((first / "scale_llm_export.json").read_text())
    info.pop("dtype")
    tok = Tokenizer(first / "tokenizer.model")
    write_hf_folder(state, cfg, tok, tmp_path / "again", dtype, info=info)
    assert_same_tensors(hf_tensors(tmp_path / "again"), hf_tensors(first))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model"):
        assert (tmp_path / "again" / name).read_bytes() == (first / name).read_bytes(), name


def test_a_run_from_init_from_starts_at_the_source_loss(run_dir, exported, theirs, data_dir):
    root = run_dir.parent.parent / "init_runs"
    run = finished_run(
        data_dir, root, f"model.init_from={exported}", "train.max_steps=1", "run.name=init"
    )
    source = first_batch_loss(theirs, data_dir, 4)
    assert abs(rows_of(run)[1]["loss"] - source) <= 1e-5
    assert abs(rows_of(run_dir)[1]["loss"] - source) > 1e-2  # a fresh init starts elsewhere
    # a resume ignores init_from: the checkpoint's weights are newer
    from tests.helpers import make_config

    cfg = make_config(
        data_dir, root, "model.init_from=/nowhere", "train.max_steps=1", "run.name=init"
    )
    assert trainer_for(cfg).fit().complete


IMPORTED = ["ddp", "fsdp", "zero3"]


@pytest.fixture(scope="module")
def imported(exported, data_dir, tmp_path_factory, request) -> Runs:
    """One 1-step 2-rank run per backend (those the selected tests name, in one launch) started
    from the export, at lr 1e-30: the weights cannot move in fp32."""
    runs = Runs(data_dir, tmp_path_factory.mktemp("imported"))
    overrides = [*SPLIT, f"model.init_from={exported}", "train.lr=1e-30", "train.min_lr=0"]
    overrides += ["train.max_steps=1", "eval.every=0"]
    read = wanted(request, {"test_two_rank_runs_import_and_export_the_same_weights": ["{backend}"]})
    runs.start({b: (2, [*BACKENDS[b], *overrides]) for b in IMPORTED if b in read})
    return runs


@pytest.mark.parametrize("backend", IMPORTED)
def test_two_rank_runs_import_and_export_the_same_weights(
    backend, imported, exported, theirs, data_dir, tmp_path
):
    """A 2-rank DDP / FSDP2 / ZeRO-3 run started from the export (lr 1e-30: the weights cannot move
    in fp32) saves a sharded checkpoint; its export holds the source's exact tensors, and its
    first loss is the source model's on the same 8 sequences."""
    ckpt = imported.root / backend / "checkpoints" / "step_00000001"
    assert (ckpt / ("deepspeed" if backend.startswith("zero") else "dcp")).is_dir()
    export(ckpt, tmp_path / "out")
    assert_same_tensors(hf_tensors(tmp_path / "out"), hf_tensors(exported))
    source = first_batch_loss(theirs, data_dir, 8)
    assert abs(imported.rows[backend][1]["loss"] - source) <= 1e-5


def test_what_transformers_computes_otherwise_is_refused_or_read_its_way(
    exported, run_dir, data_dir, tmp_path, logs
):
    """Folders transformers computes otherwise than scale_llm read them (logits 5 to 11 apart,
    no message): rope_parameters' legacy `type` key (linear scaling read as default RoPE), a
    config naming its weights file (transformers_weights), model.safetensors beside an index
    (transformers reads the single file, scale_llm read the index), and a tied config whose
    file holds another lm_head.weight (transformers unties them). And tensors neither reads (a
    bias the config does not declare): left out without a word, now named."""
    from safetensors.torch import load_file, save_file

    from scale_llm.components.hf_files import HFWeights
    from scale_llm.model.hf import from_hf_config
    from scale_llm.train.init_from import check_init_from

    hf = json.loads((exported / "config.json").read_text())
    rope = {"type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    assert from_hf_config({**hf, "rope_parameters": rope})[1] == [
        "rope_parameters.rope_type='linear': unsupported (only 'default' RoPE)"
    ]
    named = from_hf_config({**hf, "transformers_weights": "other.safetensors"})[1]
    assert named and named[0].startswith("transformers_weights='other.safetensors': unsupported")
    folder = shutil.copytree(exported, tmp_path / "both")
    tensors = load_file(folder / "model.safetensors")
    other = {**tensors, "model.norm.weight": tensors["model.norm.weight"] + 1}
    save_file(other, folder / "other.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(other, "other.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    norm = HFWeights(folder, "model.init_from").get("model.norm.weight")
    assert torch.equal(norm, tensors["model.norm.weight"])  # the single file's, as transformers
    cfg = init_cfg(run_dir, folder := shutil.copytree(exported, tmp_path / "head"))
    assert cfg.tie_embeddings and "lm_head.weight" not in tensors
    embedding = tensors["model.embed_tokens.weight"]
    for head, refused in ((embedding.clone(), False), (embedding + 1, True)):
        save_file({**tensors, "lm_head.weight": head}, folder / "model.safetensors")
        if not refused:
            check_init_from(cfg, sha(data_dir))
            continue
        with pytest.raises(UserError, match="lm_head.weight differs from model.embed_tokens"):
            check_init_from(cfg, sha(data_dir))
    bias = torch.zeros(tensors["model.layers.0.self_attn.q_proj.weight"].shape[0])
    inv_freq = torch.ones(4)  # (a buffer older transformers saved: no weight)
    more = {"model.layers.0.self_attn.q_proj.bias": bias}
    more["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv_freq
    save_file({**tensors, **more}, folder / "model.safetensors")
    assert "does not read" not in logs.text
    check_init_from(cfg, sha(data_dir))
    said = f"init_from: {folder} holds 1 tensor(s) the model does not read "
    assert said + "(model.layers.0.self_attn.q_proj.bias): left out" in logs.text


def test_an_hf_config_without_optional_fields_takes_llamas_defaults():
    """config.json files written by other tools leave out fields at their defaults
    (hidden_act 'silu', no biases, no rope scaling): read as Llama's defaults, not a KeyError."""
    from scale_llm.model.hf import from_hf_config, to_hf_config

    cfg = ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, seq_len=64)
    hf = to_hf_config(cfg, torch.float32, bos_id=1, eos_id=2, pad_id=2)
    for key in ("hidden_act", "attention_bias", "mlp_bias", "rope_scaling", "sliding_window"):
        hf.pop(key, None)
    values, problems = from_hf_config(hf)
    assert problems == [] and values["d_model"] == 32 and values["n_layers"] == 2
    values, problems = from_hf_config({**hf, "hidden_act": "gelu"})
    assert problems == ["hidden_act='gelu': unsupported (scale_llm supports 'silu')"]


# ----------------------------------------------------------------------------- eval


def choice_logliks(model, tok: Tokenizer, context: str, choices: list[str]) -> list[float]:
    """log p(" " + choice | context) per choice, from requests built the way lm-eval builds
    them: trailing whitespace of the context moves to the continuation; the continuation's
    tokens are what follows the encoded context in the encoding of the whole text (both with
    BOS); the model reads the context's own tokens, then the continuation's."""
    out = []
    for choice in choices:
        ctx, cont = context, " " + choice
        spaces = len(ctx) - len(ctx.rstrip())
        if spaces:
            ctx, cont = ctx[:-spaces], ctx[-spaces:] + cont
        prefix = tok.encode(ctx)
        cont_ids = tok.encode(ctx + cont)[len(prefix) :]
        tokens = prefix + cont_ids
        with torch.no_grad():
            logp = model(torch.tensor([tokens[:-1]])).float().log_softmax(-1)[0]
        out.append(sum(logp[len(prefix) - 1 + j, t].item() for j, t in enumerate(cont_ids)))
    return out


def document_loglik(model, tok: Tokenizer, text: str) -> float:
    """log p(text) as a document of the training stream: after the EOS that ends the one
    before it, its BOS and its tokens (every one scored, BOS included)."""
    stream = [tok.eos_id, *tok.encode(text)]
    with torch.no_grad():
        logp = model(torch.tensor([stream[:-1]])).float().log_softmax(-1)[0]
    return sum(logp[i, t].item() for i, t in enumerate(stream[1:]))


def test_eval_scores_match_our_loglikelihoods(run_dir, ours, data_dir, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the task's data file path is relative to the repository
    limit = 8  # lm-eval: the first 8 examples; perplexity: the first 8 validation windows
    args = ["eval", str(run_dir), "--tasks", f"{TASK},{ROLLING}", "--include-path", str(TASK_DIR)]
    args += ["--limit", str(limit), "--perplexity", str(data_dir)]
    assert cli.main(args) == 0
    assert "wrote" in capsys.readouterr().out
    record = json.loads((run_dir / "eval" / "step_00000004.json").read_text())
    model, tok = ours
    docs = [json.loads(x) for x in (TASK_DIR / "tiny_mc.jsonl").read_text().splitlines()][:limit]
    acc = acc_norm = 0
    for doc in docs:
        lls = choice_logliks(model, tok, doc["question"], doc["choices"])
        acc += max(range(len(lls)), key=lls.__getitem__) == doc["answer"]
        normed = [ll / len(c) for ll, c in zip(lls, doc["choices"])]
        acc_norm += max(range(len(normed)), key=normed.__getitem__) == doc["answer"]
    assert record["lm_eval"]["limit"] == limit and record["lm_eval"]["version"]
    scores = record["tasks"][TASK]
    assert 0 <= scores["acc"] <= 1 and scores["acc"] == acc / limit
    assert scores["acc_norm"] == acc_norm / limit
    # a rolling (perplexity) task scores each document as training saw it: [EOS] [BOS] text
    # (lm-eval's default prefix, BOS, scored a BOS after a BOS in every document)
    texts = [doc["question"] for doc in docs]
    nll = -sum(document_loglik(model, tok, text) for text in texts)
    n_bytes = sum(len(text.encode()) for text in texts)
    rolling = record["tasks"][ROLLING]
    assert rolling["bits_per_byte"] == pytest.approx(nll / n_bytes / math.log(2), rel=1e-4)
    # 8 windows = eval.steps 2 x 4 sequences: the val_loss the run logged at step 4
    ppl = record["perplexity"]
    assert ppl["windows"] == 8 and ppl["tokens"] == 8 * 32
    assert abs(ppl["loss"] - rows_of(run_dir)[4]["val_loss"]) <= 1e-5
    assert ppl["ppl"] == pytest.approx(math.exp(ppl["loss"]))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for tag, value in [
        (f"eval/{TASK}/acc", scores["acc"]),
        (f"eval/{TASK}/acc_norm", scores["acc_norm"]),
        ("eval/perplexity/ppl", ppl["ppl"]),
    ]:
        (event,) = events.Scalars(tag)
        assert event.step == 4 and event.value == pytest.approx(value, rel=1e-6)


def test_lm_eval_sees_our_loglikelihoods(run_dir, ours, monkeypatch):
    """Request by request: lm-eval's log-likelihoods of each choice on the export equal ours."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from scale_llm.evaluate import export_for_eval

    monkeypatch.chdir(REPO)
    ckpt = run_dir / "checkpoints" / "step_00000004"
    folder = export_for_eval(ckpt, run_dir)
    made = (folder / "config.json").stat().st_ino
    assert export_for_eval(ckpt, run_dir) == folder  # an export of this checkpoint: reused
    assert (folder / "config.json").stat().st_ino == made
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(folder), "dtype": "float32", "device": "cpu"},
        tasks=[TASK],
        limit=4,
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        log_samples=True,
    )
    model, tok = ours
    assert len(out["samples"][TASK]) == 4
    for sample in out["samples"][TASK]:
        doc = sample["doc"]
        theirs = [resp[0] for resp in sample["filtered_resps"]]
        mine = choice_logliks(model, tok, doc["question"], doc["choices"])
        assert mine == pytest.approx(theirs, abs=1e-4), (doc, mine, theirs, sample["arguments"])
