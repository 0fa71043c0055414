"""Model: shapes, causality, attention variants, checkpointing numerics, KV-cache decoding."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from scale_llm.components.loss import cross_entropy
from scale_llm.config import ModelConfig
from scale_llm.config.parallel import ActivationCheckpointingConfig as AC
from scale_llm.generate import generate, sample_next
from scale_llm.model import KVCache, build_model
from scale_llm.parallel.activation_checkpointing import apply_activation_checkpointing


def small(**kw) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, seq_len=24)
    base.update(kw)
    return ModelConfig(**base)


def test_meta_build_then_materialize_is_seeded_and_shapes_are_right():
    torch.manual_seed(3)
    a = build_model(small(), "cpu")
    torch.manual_seed(3)
    b = build_model(small(), "cpu")
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    assert build_model(small()).tok_embeddings.weight.is_meta
    logits = a(torch.randint(0, 97, (3, 24)))
    assert logits.shape == (3, 24, 97)
    # SwiGLU hidden 8/3 * 32 -> 128 (rounded up to 128); tied head adds no parameters
    per_block = 32 * (4 * 8 * 3) + 32 * 32 + 3 * 32 * 128 + 2 * 32
    assert a.num_params() == 97 * 32 + 2 * per_block + 32


def test_scaled_init_shrinks_residual_projections():
    torch.manual_seed(0)
    m = build_model(small(d_model=256, n_layers=8, n_heads=8, vocab_size=512), "cpu")
    std = 0.02
    assert m.layers[0].attention.wqkv.weight.std().item() == pytest.approx(std, rel=0.05)
    assert m.layers[0].attention.wo.weight.std().item() == pytest.approx(std / 4, rel=0.05)
    assert m.layers[0].feed_forward.w2.weight.std().item() == pytest.approx(std / 4, rel=0.05)
    assert torch.equal(m.norm.weight, torch.ones(256))


def test_untied_embeddings_have_their_own_head():
    m = build_model(small(tie_embeddings=False), "cpu")
    assert m.output is not None
    assert m.num_params() == build_model(small(), "cpu").num_params() + 97 * 32


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_changing_a_future_token_never_changes_earlier_logits(attention):
    m = build_model(small(attention=attention), "cpu")
    x = torch.randint(0, 97, (2, 24))
    y = x.clone()
    y[:, 15] = (y[:, 15] + 1) % 97
    with torch.no_grad():
        a, b = m(x), m(y)
    assert torch.equal(a[:, :15], b[:, :15])
    assert not torch.allclose(a[:, 15:], b[:, 15:])


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
def test_eager_attention_matches_sdpa(n_kv_heads):
    torch.manual_seed(0)
    sdpa = build_model(small(n_kv_heads=n_kv_heads), "cpu")
    eager = build_model(small(n_kv_heads=n_kv_heads, attention="eager"), "cpu")
    eager.load_state_dict(sdpa.state_dict())
    x = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(sdpa(x), eager(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("mode", "expected"), [("full", 3), ("every_k", 2), ("selective", 3)]
)  # every_k with k=2 over 3 blocks: blocks 0 and 2
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_activation_checkpointing_gives_identical_loss_and_gradients(mode, expected, attention):
    torch.manual_seed(0)
    plain = build_model(small(n_layers=3, attention=attention), "cpu")
    ckpt = copy.deepcopy(plain)
    assert apply_activation_checkpointing(ckpt, AC(mode=mode, k=2)) == expected
    x, y = torch.randint(0, 97, (4, 24)), torch.randint(0, 97, (4, 24))
    loss_a = cross_entropy(plain(x), y)
    loss_b = cross_entropy(ckpt(x), y)
    loss_a.backward()
    loss_b.backward()
    assert torch.equal(loss_a, loss_b)
    for (name, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    # parameter names (and so checkpoints) do not change
    assert list(plain.state_dict()) == list(ckpt.state_dict())


def test_activation_checkpointing_recomputes_the_block_forward():
    m = build_model(small(n_layers=2), "cpu")
    apply_activation_checkpointing(m, AC(mode="full"))
    calls = []
    # a pre-hook: recomputation stops early once the last saved tensor is rebuilt, so hooks
    # that fire after a module's forward may not run during the recomputation
    m.layers[0].feed_forward.register_forward_pre_hook(lambda *a: calls.append(1))
    cross_entropy(m(torch.randint(0, 97, (2, 8))), torch.randint(0, 97, (2, 8))).backward()
    assert len(calls) == 2  # forward, then recomputation during backward


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_kv_cache_logits_equal_full_forward(n_kv_heads):
    m = build_model(small(n_kv_heads=n_kv_heads), "cpu")
    x = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full = m(x)
        cache = KVCache(m.cfg.n_layers, m.cfg.seq_len)
        parts = [m(x[:, :12], cache, 0)]  # prefill
        parts.append(m(x[:, 12:15], cache, 12))  # a chunk after earlier tokens
        parts += [m(x[:, i : i + 1], cache, i) for i in range(15, 20)]  # one at a time
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_greedy_generation_with_cache_equals_without(attention):
    torch.manual_seed(1)
    m = build_model(small(attention=attention, seq_len=64), "cpu")
    prompt = torch.randint(0, 97, (7,)).tolist()
    with_cache = generate(m, prompt, 40, temperature=0, use_cache=True)
    without = generate(m, prompt, 40, temperature=0, use_cache=False)
    assert with_cache == without
    assert len(with_cache) == 40


def test_under_a_document_mask_the_cached_generation_reads_the_prompts_last_document():
    """The cache holds no mask: a prompt of [EOS] + text (a tokenizer without BOS) attended to
    the EOS training's document mask hid; generation equals the uncached model's, which masks,
    and stops at a document end."""
    torch.manual_seed(0)
    cfg = small(seq_len=64, attention_mask="document", document_end_id=2, tie_embeddings=False)
    m = build_model(cfg, "cpu")  # (untied: a random tied model repeats its last token)
    prompt = [2, *torch.randint(3, 97, (6,)).tolist()]
    with_cache = generate(m, prompt, 30, temperature=0, use_cache=True)
    assert with_cache == generate(m, prompt, 30, temperature=0, use_cache=False)
    assert with_cache == generate(m, prompt[1:], 30, temperature=0)  # (the text alone)
    end = next(t for t in with_cache if t not in prompt)  # (as the document end: a stop)
    m.cfg = dataclasses.replace(m.cfg, document_end_id=end)
    stopped = generate(m, prompt[1:], 30, temperature=0)
    assert stopped == with_cache[: with_cache.index(end) + 1] and len(stopped) < 30


def test_generation_samples_only_the_tokenizers_ids():
    """A model's rows past its tokenizer's ids (a padded vocabulary) are no token: sampled,
    they were dropped from the text and fed back."""
    torch.manual_seed(5)
    m = build_model(small(), "cpu")
    free = generate(m, [1, 5, 9], 40, temperature=5.0, top_k=0, seed=0)
    capped = generate(m, [1, 5, 9], 40, temperature=5.0, top_k=0, seed=0, vocab_size=90)
    assert max(free) >= 90 and max(capped) < 90 and len(capped) == 40


def test_generated_text_is_decoded_after_the_prompt(tmp_path):
    """A decoder that strips a text's leading space (Llama 2's, Mistral's) ran on the new ids
    alone: "Hello" + "world" printed "Helloworld"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from scale_llm.data.pretrained_tokenizer import PretrainedTokenizer, build_bundle
    from scale_llm.data.tokenizer import continuation

    words = ["Hello", "world", "again"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"\u2581{w}": i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="always")])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    (tmp_path / "hf").mkdir()
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "bundle").write_bytes(build_bundle(tmp_path / "hf")[0])
    words = PretrainedTokenizer(tmp_path / "bundle")
    prompt, new = words.encode("Hello"), words.encode("world again", bos=False)
    assert words.decode(new) == "world again"  # (the leading space stripped)
    assert "Hello" + continuation(words, prompt, new) == "Hello world again"


def test_generation_continues_past_seq_len():
    m = build_model(small(seq_len=16), "cpu")
    out = generate(m, [1, 2, 3], 40, temperature=0.9, top_k=10, seed=0)
    assert len(out) == 40


def test_past_seq_len_the_cache_starts_over_from_the_newest_half():
    """What the cached path is documented to do once prompt + new tokens pass seq_len: greedy
    tokens equal to a full recompute over the context since its last restart, which begins at
    the newest seq_len // 2 tokens each time the context would exceed seq_len."""
    torch.manual_seed(2)
    m = build_model(small(seq_len=16), "cpu")
    prompt = torch.randint(0, 97, (5,)).tolist()
    got = generate(m, prompt, 40, temperature=0)
    tokens, start, want = list(prompt), 0, []
    with torch.no_grad():
        for _ in range(40):
            want.append(int(m(torch.tensor([tokens[start:]]))[0, -1].argmax()))
            tokens.append(want[-1])
            if len(tokens) - start > 16:
                start = len(tokens) - 8
    assert got == want


def test_sampling_filters():
    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0]])
    assert sample_next(logits, 0, None, None, None).item() == 1
    g = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, 1.0, 2, None, g).item() for _ in range(50)}
    assert picks == {1, 2}  # top-k 2 keeps exactly the two best
    picks = {sample_next(logits, 1.0, None, 0.3, g).item() for _ in range(50)}
    assert picks == {1}  # the best token alone already covers 30% of the mass
    same = [sample_next(logits, 1.0, None, None, torch.Generator().manual_seed(5)) for _ in "ab"]
    assert torch.equal(*same)
    # a temperature so small that logits / temperature overflows: the best token, not a NaN
    assert sample_next(logits * 1e3, 1e-40, None, None, g).item() == 1


def test_flops_per_token_counts_tied_head():
    cfg = small()
    m = build_model(cfg)
    linear = sum(p.numel() for n, p in m.named_parameters() if "norm" not in n) - 97 * 32
    assert m.flops_per_token() == 6 * (linear + 97 * 32) + 12 * 2 * 32 * 24


@pytest.mark.parametrize("tie", [True, False])
def test_flops_per_token_equals_a_count_of_every_matmul(tie):
    """6 x matmul params + 12 x n_layers x d_model x seq_len per token (forward + backward) is
    what torch's FLOP counter sees for one training step (eager attention: the full T x T
    products, as the formula counts them), and a hand count for this shape."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = small(n_layers=2, attention="eager", tie_embeddings=tie)
    m = build_model(cfg, "cpu")
    B, T, d, V = 3, cfg.seq_len, cfg.d_model, cfg.vocab_size
    x = torch.randint(0, V, (B, T + 1))
    with FlopCounterMode(display=False) as counter:
        cross_entropy(m(x[:, :-1]), x[:, 1:]).backward()
    assert counter.get_total_flops() == m.flops_per_token() * B * T
    hidden = 128 * math.ceil(8 * d / 3 / 128)
    per_block = d * 3 * d + d * d + 3 * d * hidden  # wqkv, wo, w1 / w3 / w2
    by_hand = 6 * (2 * per_block + V * d) + 12 * 2 * d * T
    assert m.flops_per_token() == by_hand
    # causal: what a causal kernel computes, the lower half of each T x T product
    assert m.flops_per_token(causal=True) == by_hand - 6 * 2 * d * T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [7, 40])  # 6 chunks of the 40 rows; one chunk
def test_chunked_loss_equals_the_plain_one_and_keeps_no_fp32_logits(dtype, chunk_rows, monkeypatch):
    import scale_llm.components.loss as loss_mod

    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", chunk_rows * 97)
    torch.manual_seed(0)
    logits = torch.randn(4, 10, 97, dtype=dtype, requires_grad=True)
    before = logits.detach().clone()
    targets = torch.randint(0, 97, (4, 10))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chunked = loss_mod.cross_entropy(logits, targets)
    (g_chunked,) = torch.autograd.grad(chunked, logits)
    plain = loss_mod.plain_cross_entropy(logits, targets)
    (g_plain,) = torch.autograd.grad(plain, logits)
    rtol = 1e-6 if dtype == torch.float32 else 2**-7  # bf16: both fp32 math, one rounding each
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_chunked, g_plain, atol=1e-6, rtol=rtol)
    assert g_chunked.dtype == dtype
    assert torch.equal(logits.detach(), before)  # the in-place backward never wrote the logits
    # kept for backward: the logits in their own dtype and the targets, nothing in fp32 besides
    fp32_saved = sum(t.numel() for t in saved if t.dtype == torch.float32)
    assert fp32_saved == (logits.numel() if dtype == torch.float32 else 0)


def test_rope_tables_are_computed_once_and_survive_inference_mode_then_training():
    m = build_model(small(), "cpu")
    x = torch.randint(0, 97, (2, 24))
    with torch.inference_mode():  # generate first (tables made here are normal tensors)
        m(x[:, :5])
    table = m._rope_tables[torch.device("cpu")]
    assert not table.is_inference() and table.dtype == torch.float32
    assert table.shape == (2, 24, 4)  # ((cos, sin), seq_len, head_dim / 2)
    m(x).float().sum().backward()  # would raise if the tables were inference tensors
    assert m._rope_tables[torch.device("cpu")] is table  # not recomputed
    assert "_rope_tables" not in str(list(m.state_dict()))


def test_rope_is_hugging_face_llamas_rotate_half():
    from scale_llm.model.transformer import apply_rope, rope_table

    def rotate_half(x):  # transformers' modeling_llama, verbatim
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    torch.manual_seed(0)
    rope = rope_table(64, 512, 10000.0)
    x = torch.randn(2, 512, 4, 64)
    cos, sin = (torch.cat((t, t), dim=-1)[:, None, :] for t in rope)  # HF's (T, D) tables
    assert torch.equal(apply_rope(x, rope), x * cos + rotate_half(x) * sin)


def test_the_cpu_rmsnorm_is_f_rms_norm_with_its_own_backward():
    import torch.nn.functional as F

    from scale_llm.model.transformer import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(16))
    norm64 = copy.deepcopy(norm).double()
    x64 = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: norm64(x), (x64, norm64.weight))
    saved: list[torch.Tensor] = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        n = copy.deepcopy(norm).to(dtype)
        x = x64.detach().to(dtype).requires_grad_()
        grad = torch.randn_like(x)
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = n(x)
        assert y.grad_fn.name() == "_RMSNormBackward"
        # what CUDA's fused kernel keeps: the input, the weight and the fp32 rstd
        assert [t.shape for t in saved] == [x.shape, (16,), (3, 5, 1)]
        assert saved[0] is x and saved[2].dtype == torch.float32
        expected = F.rms_norm(x, (16,), n.weight, 1e-5)
        assert torch.equal(y, expected)  # the same forward, bit for bit
        got = torch.autograd.grad(y, (x, n.weight), grad)
        want = torch.autograd.grad(expected, (x, n.weight), grad)  # the decomposition's
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, atol=tol, rtol=tol)


def test_only_eager_cpu_code_runs_the_written_out_rmsnorm(monkeypatch):
    from scale_llm.model import cpu_kernels

    x, w = torch.randn(2, 3), torch.randn(3)
    assert cpu_kernels.enabled(x, w) and cpu_kernels.enabled(x.bfloat16(), w.bfloat16())
    assert not cpu_kernels.enabled(x.to("meta"), w.to("meta"))  # (as on CUDA: F.rms_norm)
    assert not cpu_kernels.enabled(x.bfloat16(), w)  # (F.rms_norm does not fuse mixed dtypes)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not cpu_kernels.enabled(x, w)
    assert cpu_kernels.rms_norm(x.requires_grad_(), w, 1e-5).grad_fn.name() != "_RMSNormBackward"


def test_rope_runs_in_the_compute_dtype_close_to_fp32_math():
    from scale_llm.model.transformer import apply_rope, rope_table

    torch.manual_seed(0)
    rope = rope_table(64, 512, 10000.0)
    x = torch.randn(2, 512, 4, 64)
    exact = apply_rope(x.double(), rope.double())  # (fp64: the half-split order)
    assert apply_rope(x, rope).dtype == torch.float32
    low = apply_rope(x.bfloat16(), rope)
    assert low.dtype == torch.bfloat16
    rel = ((low.double() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt()
    rounded = ((exact.bfloat16().double() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt()
    assert rel < 2.5 * rounded  # a few bf16 roundings, not a lost bit pattern


def test_shipped_configs_use_tensor_core_widths():
    from pathlib import Path

    from scale_llm.config import load_config
    from scale_llm.model import mlp_hidden_size

    shipped = sorted((Path(__file__).parents[1] / "yaml").glob("*.yaml"))
    assert shipped
    for path in shipped:
        m = load_config(path).model
        for name, width in (("vocab_size", m.vocab_size), ("mlp", mlp_hidden_size(m))):
            assert width % 128 == 0, f"{path.name}: {name}={width} is not a multiple of 128"
        assert m.d_model % 64 == 0 and (m.d_model // m.n_heads) % 16 == 0, path.name
    assert mlp_hidden_size(ModelConfig(d_model=1024)) == 2816  # 8/3 * 1024 = 2730.7 -> 22 x 128


def test_odd_widths_warn_on_gpu_plans_only(logs):
    from scale_llm.config import Config
    from scale_llm.config.plan import Launch, resolve_plan

    cfg = Config()
    cfg.model.vocab_size = 50257
    resolve_plan(cfg, Launch(world_size=1), cuda=False)
    assert "multiple of 128" not in logs.text
    resolve_plan(cfg, Launch(world_size=1), cuda=True, bf16=True)
    assert "model.vocab_size=50257 is not a multiple of 128" in logs.text
    assert "50304" in logs.text
