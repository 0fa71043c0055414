"""Activation memory: what the forward pass saves for backward, predicted op by op for this
project's model, and measured on the CPU to keep the prediction honest."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scale_llm.components.loss import CHUNK_ELEMENTS, compiled_loss, cross_entropy
from scale_llm.config import ActivationCheckpointingConfig as AC
from scale_llm.config import Config, ModelConfig
from scale_llm.config.plan import RunPlan
from scale_llm.config.sections import kv_heads, measures_compiled, mlp_hidden_size
from scale_llm.model import build_model
from scale_llm.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpointed_blocks,
)


@dataclass(frozen=True)
class Numerics:
    """How tensors are stored in the forward pass."""

    compute: int  # bytes of matmul inputs / outputs (2 under bf16 / fp16, 4 in fp32)
    residual: int  # bytes of the residual stream (4 with fp32 params + autocast; 2 in 16 bits)
    autocast: bool  # matmul inputs and weights are cast per op (the casts saved for backward)
    fused_norm: bool = False  # RMSNorm saves its input and rstd (CUDA, the CPU's cpu_kernels)
    tp: int = 1  # each rank holds 1/tp of the heads, the SwiGLU width and the vocabulary
    sequence_parallel: bool = False  # the norms and the residual stream: 1/tp of the sequence
    fp8: bool = False  # train.fp8: the blocks' linears cast their own weights (no autocast copy)
    whole_logits: bool = False  # the loss gathers the vocabulary (a pipeline's, under TP)
    dense_mask: bool = False  # the document mask reaches SDPA as (B, 1, T, T): saved, 16/32-bit

    @property
    def vocab_sharded(self) -> bool:
        """The loss reads 1/tp of the vocabulary's logits (`parallel_cross_entropy`)."""
        return self.tp > 1 and not self.whole_logits

    def stream_tokens(self, tokens: int) -> int:
        """This rank's tokens of the residual stream and the norms."""
        return tokens // self.tp if self.sequence_parallel else tokens


def numerics_for(
    precision: str,
    backend: str,
    fused_norm: bool = False,
    tp: int = 1,
    sp: bool = False,
    fp8: bool = False,
    whole_logits: bool = False,
    dense_mask: bool = False,
) -> Numerics:
    sharded = backend in ("fsdp", "deepspeed")  # (16-bit modules; else fp32 params + autocast)
    kind = (4, 4, False) if precision == "fp32" else (2, 2, False) if sharded else (2, 4, True)
    return Numerics(*kind, fused_norm, tp, sp and tp > 1, fp8, whole_logits, dense_mask)


def norm_saved_bytes(tokens: int, d: int, num: Numerics) -> int:
    """What one RMSNorm over `tokens` x `d` saves for backward: its input and the fp32 rstd
    (CUDA's fused kernel, the CPU's `cpu_kernels.rms_norm`), or torch's composite elsewhere: an
    fp32 copy of its input, the fp32 normalized input and the rstd (measured on the CPU to 0.3%)."""
    return (num.residual if num.fused_norm else 8) * tokens * d + 4 * tokens


def widths(m: ModelConfig, tp: int = 1) -> dict[str, int]:
    """The widths one rank computes: 1/tp of the heads, the SwiGLU width and the vocabulary."""
    head_dim, kv = m.d_model // m.n_heads, kv_heads(m)
    return {
        "d": m.d_model,
        "dq": m.n_heads * head_dim // tp,
        "dkv": kv * head_dim // tp,
        "F": mlp_hidden_size(m) // tp,
        "D": head_dim,
        "H": m.n_heads // tp,
        "V": m.vocab_size // tp,
    }


def block_matmul_params(m: ModelConfig, tp: int = 1) -> int:
    """Elements of one block's matmul weights (on one rank: 1/tp of them)."""
    g = widths(m, tp)
    return g["d"] * (g["dq"] + 2 * g["dkv"]) + g["dq"] * g["d"] + 3 * g["d"] * g["F"]


def block_activation_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """Bytes one transformer block saves for backward without checkpointing, op by op (the table
    in docs/memory.md, "Where memory goes"). Under tensor parallelism attention and the MLP save
    1/tp of their heads and width, their inputs whole; with sequence parallelism the norms save
    1/tp of the sequence (measured on 2 gloo ranks)."""
    g, a, T = widths(m, num.tp), num.compute, m.seq_len
    N = batch * T
    norms = 2 * norm_saved_bytes(num.stream_tokens(N), g["d"], num)
    norm_outputs = a * N * g["d"] * (3 if num.autocast else 2)
    if m.attention == "eager":
        scores = batch * g["H"] * T * T
        attention = a * N * 4 * g["dq"] + T * T + 4 * scores + (a * scores if a != 4 else 0)
        if batch == 1 and g["dkv"] == g["dq"]:  # v reaches the matmul as a view of qkv
            attention += a * N * 2 * g["dkv"]
    else:
        attention = a * N * (3 * g["dq"] + 3 * g["dkv"]) + 4 * batch * g["H"] * T
        attention += a * batch * T * T if num.dense_mask else 0  # (the mask in the compute dtype)
    mlp = 4 * a * N * g["F"]
    # autocast's 16-bit weight copies (an fp8 linear saves its fp32 weight itself: no copy)
    weight_copies = 2 * block_matmul_params(m, num.tp) if num.autocast and not num.fp8 else 0
    rope = 2 * T * g["D"] * a if a != 4 else 0  # 16-bit cos and sin for q and k, (T, D / 2) each
    return norms + norm_outputs + attention + mlp + weight_copies + rope


def selective_block_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """Selective checkpointing keeps the block input and every matmul / attention output (under
    tensor parallelism the row-wise outputs before their reduction: whole sequence, d_model)."""
    g, a, T = widths(m, num.tp), num.compute, m.seq_len
    N = batch * T
    matmuls = a * N * ((g["dq"] + 2 * g["dkv"]) + g["d"] + 2 * g["F"] + g["d"])  # qkv wo w1 w3 w2
    if m.attention == "eager":
        attention = a * batch * g["H"] * T * T + a * N * g["dq"]  # q @ k^T and probs @ v
    else:
        attention = a * N * g["dq"] + 4 * batch * g["H"] * T  # output and log-sum-exp
    return block_input_bytes(m, batch, num) + matmuls + attention


def block_input_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """A checkpointed block's input: the residual stream (this rank's part of the sequence)."""
    return num.residual * num.stream_tokens(batch * m.seq_len) * m.d_model


def head_activation_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """Outside the blocks: token ids and targets, rotary tables, the final norm and head input,
    autocast's copy of the output weight, and the (B, T, V) logits the loss keeps (its backward
    rebuilds the softmax from them; under tensor parallelism `parallel_cross_entropy` keeps the
    fp32 log-softmax of V/tp); under sequence parallelism the final norm's part of the sequence."""
    g, N = widths(m, num.tp), batch * m.seq_len
    final_norm = norm_saved_bytes(num.stream_tokens(N), g["d"], num) + num.compute * N * g["d"]
    head_copy = 2 * g["V"] * g["d"] if num.autocast else 0
    logits = 4 * N * g["V"] if num.vocab_sharded else num.compute * N * m.vocab_size
    return resident_input_bytes(m, batch) + final_norm + head_copy + logits


def checkpointed_flags(m: ModelConfig, ac: AC, flags: Sequence[bool] | None = None) -> list[bool]:
    """Whether each of `m`'s blocks is checkpointed: `flags` where given (a pipeline rank's
    blocks, which every_k picks by their one-process index), else as `ac` picks them."""
    if flags is not None:
        return list(flags)
    chosen = set(checkpointed_blocks(ac, m.n_layers))
    return [i in chosen for i in range(m.n_layers)]


def checkpointed_count(m: ModelConfig, ac: AC, flags: Sequence[bool] | None = None) -> int:
    return sum(checkpointed_flags(m, ac, flags))


def saved_activation_bytes(m: ModelConfig, ac: AC, batch: int, num: Numerics) -> int:
    """Everything the forward pass (with loss) saves for backward, as `measure_saved_bytes`."""
    return sum(kept_per_block(m, ac, batch, num)) + head_activation_bytes(m, batch, num)


def kept_per_block(
    m: ModelConfig, ac: AC, batch: int, num: Numerics, flags: Sequence[bool] | None = None
) -> list[int]:
    """What each block keeps from the forward until its backward (its input when
    checkpointed, the selective subset, or everything); `flags`: `checkpointed_flags`'."""
    full = block_activation_bytes(m, batch, num)
    kept = (selective_block_bytes if ac.mode == "selective" else block_input_bytes)(m, batch, num)
    flags = checkpointed_flags(m, ac, flags)
    out = [kept if chosen else full for chosen in flags]
    if num.dense_mask and True in flags:  # the checkpoints keep the (B, 1, T, T) bools, once
        out[flags.index(True)] += batch * m.seq_len**2
    return out


def loss_backward_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """The chunked loss's backward beyond the kept logits: the logits' gradient and one chunk's
    fp32 work (in 16 bits the upcast and the softmax buffer coexist; in fp32 it is the gradient)."""
    N, V = batch * m.seq_len, m.vocab_size
    fp32_work = loss_forward_bytes(m, batch, num)  # the same fp32 chunk (and its upcast)
    if num.vocab_sharded:  # loss_parallel's backward peaks no higher than its forward
        return fp32_work
    if max(1, CHUNK_ELEMENTS // V) >= N:  # one chunk: its buffer becomes the gradient
        return fp32_work if num.compute == 4 else max(fp32_work, (4 + num.compute) * N * V)
    return num.compute * N * V + fp32_work


def loss_forward_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """The chunked loss's forward beyond what is saved: one chunk's fp32 log-softmax (and in 16
    bits the upcast copy it is computed from)."""
    N, V = batch * m.seq_len, m.vocab_size
    if num.vocab_sharded:  # beyond the fp32 log-softmax it saves: the 16-bit logits, two fp32
        # buffers of loss_parallel's log-softmax at its peak (x - max, its exp), one of them
        # where the saved log-softmax will be (measured on 2 gloo ranks, fp32 and bf16)
        return (4 + (num.compute if num.compute != 4 else 0)) * N * (V // num.tp)
    rows = max(1, CHUNK_ELEMENTS // V)
    return (1 if num.compute == 4 else 2) * 4 * min(N, rows) * V


def block_backward_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """Gradients in flight at a block's backward peak (the MLP product's backward): the three
    hidden-width ones and the residual stream's flowing in (measured on 2 gloo ranks); with
    sequence parallelism that one both as this rank's part and all-gathered."""
    N, width = batch * m.seq_len, mlp_hidden_size(m) // num.tp
    stream = N + (num.stream_tokens(N) if num.sequence_parallel else 0)
    return 3 * num.compute * N * width + num.residual * stream * m.d_model


def fp8_cast_bytes(m: ModelConfig, batch: int, num: Numerics, recipe: str, fused: bool) -> int:
    """train.fp8's casts beside a block's backward at their largest: the MLP up-projection's
    weight-gradient cast (K = d_model, N = this rank's hidden width, M tokens). Eager, each cast
    makes fp32 scaled, clamped copies first (the output gradient's second: 8 MN, beside its first
    and own: MN each, and the weight's: KN); compiled, only the fp8 copies (2 MN, KN, MK). Plus
    fp32 scales: one a tensor, or rowwise one a row of each operand (4 (M + N + K))."""
    if not num.fp8:
        return 0
    M, K, N = batch * m.seq_len, m.d_model, mlp_hidden_size(m) // num.tp
    casts = 2 * M * N + K * N + M * K if fused else 10 * M * N + K * N
    return casts + (4 * (M + N + K) if recipe == "rowwise" else 12)


def resident_input_bytes(m: ModelConfig, batch: int) -> int:
    """Token ids and targets and the rotary tables: alive through the whole step."""
    T = m.seq_len
    return 8 * batch * (T + 1) + 8 * batch * T + 4 * T * (m.d_model // m.n_heads)


def measure_saved_bytes(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    autocast: contextlib.AbstractContextManager | None = None,
    compiled: bool = False,
) -> int:
    """Bytes of the distinct storages (not parameters) the forward and loss keep for backward:
    what saved_tensors_hooks see and (selective checkpointing's own cache) every op output alive
    after the forward. `compiled` (which a dispatch mode cannot run around): only the former."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    outputs: dict[int, tuple[StorageWeakRef, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    st = t.untyped_storage()
                    outputs[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
            return out

    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    autocast = autocast or contextlib.nullcontext()
    loss_fn = compiled_loss() if compiled else cross_entropy
    if compiled:
        with autocast:
            warm = model(inputs)
        loss_fn(warm, targets).backward()  # compiles the blocks and the loss
        model.zero_grad(set_to_none=True)
        del warm
    counting = contextlib.nullcontext() if compiled else Outputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counting:
        with autocast:
            logits = model(inputs)
        loss = loss_fn(logits, targets)
    if compiled:
        return sum(saved.values())
    del logits
    gone = params | {loss.untyped_storage().data_ptr()}  # (the loss is no saved activation)
    alive = {ptr: n for ptr, (ref, n) in outputs.items() if not ref.expired() and ptr not in gone}
    return sum({**alive, **saved}.values())


def measure_activations(cfg: Config, plan: RunPlan) -> tuple[int, int]:
    """(counted, predicted) saved bytes for cfg's model at the plan's micro-batch, on the CPU,
    with the precision the plan's backend would use (autocast, fp32 or a 16-bit module)."""
    document = cfg.model.attention_mask == "document"  # (the CPU's SDPA: a dense mask)
    num = numerics_for(plan.precision, plan.backend, fused_norm=True, dense_mask=document)
    m, ac, mb = cfg.model, cfg.activation_checkpointing, plan.micro_batch_size
    torch.manual_seed(cfg.run.seed)
    model = build_model(m, "cpu")
    if num.compute == 2 and not num.autocast:
        model = model.to(torch.bfloat16)
    apply_activation_checkpointing(model, ac)
    compiled = measures_compiled(cfg, plan.device.type)
    if compiled:
        from scale_llm.parallel.compile import compile_blocks

        compile_blocks(model)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if num.autocast else None
    tokens = torch.randint(0, m.vocab_size, (mb, m.seq_len + 1))
    predicted = saved_activation_bytes(m, ac, mb, num)
    return measure_saved_bytes(model, tokens, autocast, compiled), predicted
