"""Activation memory: what the forward pass saves for backward, predicted op by op for this
project's model, and measured on the CPU to keep the prediction honest."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from scale_llm.config import ActivationCheckpointingConfig, Config, ModelConfig, compiles
from scale_llm.config.plan import RunPlan
from scale_llm.config.sections import mlp_hidden_size


@dataclass(frozen=True)
class Numerics:
    """How tensors are stored in the forward pass.

    compute: bytes of matmul inputs/outputs (2 under bf16/fp16, 4 in fp32)
    residual: bytes of the residual stream (4 with fp32 params + autocast; 2 when the whole module
              runs in 16 bits, as under FSDP's MixedPrecisionPolicy or DeepSpeed bf16/fp16)
    autocast: matmul inputs and weights are cast per op (and the casts saved for backward)
    fused_norm: RMSNorm saves its input, the weight and the fp32 rstd: CUDA's kernel
                (`aten::_fused_rms_norm`, autograd node FusedRmsNormBackward0) and, on the CPU,
                the model's written-out backward (`model/cpu_kernels.py`); else (other devices)
                as torch's composite: an fp32 copy of the input and of the normalized input,
                and the rstd
    tp: the tensor-parallel degree: each rank holds 1/tp of the heads, of the SwiGLU width and
        of the vocabulary (`parallel/tensor_parallel.py`)
    sequence_parallel: the norms and the residual stream hold 1/tp of the sequence; the
        matmuls read the whole sequence, all-gathered
    """

    compute: int
    residual: int
    autocast: bool
    fused_norm: bool = False
    tp: int = 1
    sequence_parallel: bool = False

    def stream_tokens(self, tokens: int) -> int:
        """This rank's tokens of the residual stream and the norms (1/tp with sequence
        parallelism)."""
        return tokens // self.tp if self.sequence_parallel else tokens


def numerics_for(
    precision: str, backend: str, fused_norm: bool = False, tp: int = 1, sp: bool = False
) -> Numerics:
    layout = {"tp": tp, "sequence_parallel": sp and tp > 1}
    if precision == "fp32":
        return Numerics(4, 4, False, fused_norm, **layout)
    if backend in ("fsdp", "deepspeed"):
        return Numerics(2, 2, False, fused_norm, **layout)
    return Numerics(2, 4, True, fused_norm, **layout)


def norm_saved_bytes(tokens: int, d: int, num: Numerics) -> int:
    """What one RMSNorm over `tokens` x `d` saves for backward: its input and the fp32 rstd
    (CUDA's fused kernel, the CPU's `cpu_kernels.rms_norm`), or an fp32 copy of its input (the
    input itself when it is fp32), the fp32 normalized input and the rstd (torch's composite,
    which autograd differentiates where no backward kernel exists: measured on the CPU to 0.3%
    with the CPU kernel switched off). From torch 2.13's source: `rms_norm` calls
    `_fused_rms_norm` wherever input and weight share a dtype (not on MPS), which has a CUDA
    kernel each way and on other devices a forward that decomposes and no backward."""
    if num.fused_norm:
        return num.residual * tokens * d + 4 * tokens
    return 8 * tokens * d + 4 * tokens


def _dims(m: ModelConfig, tp: int = 1) -> dict[str, int]:
    """The widths one rank computes: under tensor parallelism 1/tp of the heads, of the SwiGLU
    width and of the vocabulary; d_model whole."""
    head_dim = m.d_model // m.n_heads
    kv_heads = m.n_kv_heads or m.n_heads
    return {
        "d": m.d_model,
        "dq": m.n_heads * head_dim // tp,
        "dkv": kv_heads * head_dim // tp,
        "F": mlp_hidden_size(m) // tp,
        "D": head_dim,
        "H": m.n_heads // tp,
        "V": m.vocab_size // tp,
    }


def block_matmul_params(m: ModelConfig, tp: int = 1) -> int:
    """Elements of one block's matmul weights (on one rank: 1/tp of them)."""
    g = _dims(m, tp)
    return g["d"] * (g["dq"] + 2 * g["dkv"]) + g["dq"] * g["d"] + 3 * g["d"] * g["F"]


def block_activation_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """Bytes one transformer block saves for backward without checkpointing.

    Per RMSNorm (`norm_saved_bytes`): its input and the rsqrt (4 B x N) on CUDA and the CPU;
    torch's composite elsewhere keeps an fp32 copy of the input and of input * rsqrt instead.
    Attention (sdpa): q, k, the fused qkv output that v views, the output and the log-sum-exp.
    Attention (eager): contiguous q, k, v and output copies, the causal mask, the fp32 softmax
    (B x heads x T x T) and, under 16 bits, its cast (at batch 1 without GQA, v stays a view of
    the fused qkv output, which is kept whole). MLP: w1 and w3 outputs, SiLU output and the
    product (4 x N x mlp_hidden). Autocast saves each matmul's 16-bit input (w1 and w3 cast
    theirs separately) and 16-bit weight copies. 16-bit RoPE saves the rotary table rounded to
    the compute dtype, cos and sin once for q and once for k (fp32 rotates by a view of it).
    Tensor parallelism (`Numerics.tp`): attention and the MLP save 1/tp of their heads and
    width, their inputs (the norms' outputs, all-gathered under sequence parallelism) whole;
    with sequence parallelism the norms save 1/tp of the sequence (measured on 2 gloo ranks)."""
    g, a, T = _dims(m, num.tp), num.compute, m.seq_len
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
    mlp = 4 * a * N * g["F"]
    weight_copies = 2 * block_matmul_params(m, num.tp) if num.autocast else 0
    rope = 2 * T * g["D"] * a if a != 4 else 0  # 16-bit cos and sin for q and k, (T, D / 2) each
    return norms + norm_outputs + attention + mlp + weight_copies + rope


def selective_block_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """Selective checkpointing keeps the block input and every matmul / attention output (under
    tensor parallelism the row-wise outputs before their reduction: whole sequence, d_model)."""
    g, a, T = _dims(m, num.tp), num.compute, m.seq_len
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
    autocast's copy of the output weight, and what the (chunked) loss keeps: the logits in the
    compute dtype (its backward rebuilds the softmax from them). Under tensor parallelism the
    final norm saves this rank's part of the sequence, the head its whole-sequence input."""
    g = _dims(m, num.tp)
    N = batch * m.seq_len
    final_norm = norm_saved_bytes(num.stream_tokens(N), g["d"], num) + num.compute * N * g["d"]
    head_copy = 2 * g["V"] * g["d"] if num.autocast else 0
    return resident_input_bytes(m, batch) + final_norm + head_copy + logits_bytes(m, batch, num)


def logits_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """The (B, T, V) logits the loss keeps for backward, in the compute dtype. Under tensor
    parallelism (`parallel_cross_entropy`: no chunks) the fp32 log-softmax of this rank's V/tp
    columns instead (the logits and their fp32 copy are not saved)."""
    if num.tp > 1:
        return 4 * batch * m.seq_len * (m.vocab_size // num.tp)
    return num.compute * batch * m.seq_len * m.vocab_size


def checkpointed_count(m: ModelConfig, ac: ActivationCheckpointingConfig) -> int:
    from scale_llm.parallel.activation_checkpointing import checkpointed_blocks

    return len(checkpointed_blocks(ac, m.n_layers))


def saved_activation_bytes(
    m: ModelConfig, ac: ActivationCheckpointingConfig, batch: int, num: Numerics
) -> int:
    """Everything the forward pass (with loss) saves for backward: what `measure_saved_bytes`
    counts on the CPU."""
    full = block_activation_bytes(m, batch, num)
    ckpt = checkpointed_count(m, ac)
    if ac.mode == "selective":
        per_ckpt = selective_block_bytes(m, batch, num)
    else:
        per_ckpt = block_input_bytes(m, batch, num)  # only the block input
    return (m.n_layers - ckpt) * full + ckpt * per_ckpt + head_activation_bytes(m, batch, num)


def recompute_bytes(
    m: ModelConfig, ac: ActivationCheckpointingConfig, batch: int, num: Numerics
) -> int:
    """Extra during backward: the one checkpointed block whose forward is being recomputed."""
    if checkpointed_count(m, ac) == 0:
        return 0
    full = block_activation_bytes(m, batch, num)
    if ac.mode == "selective":
        return full - selective_block_bytes(m, batch, num)
    return full


# ----------------------------------------------------------------------------- over the step


def kept_per_block(
    m: ModelConfig, ac: ActivationCheckpointingConfig, batch: int, num: Numerics
) -> list[int]:
    """What each block keeps from the forward until its backward (its input when
    checkpointed, the selective subset, or everything)."""
    from scale_llm.parallel.activation_checkpointing import checkpointed_blocks

    full = block_activation_bytes(m, batch, num)
    if ac.mode == "selective":
        per_ckpt = selective_block_bytes(m, batch, num)
    else:
        per_ckpt = block_input_bytes(m, batch, num)
    chosen = set(checkpointed_blocks(ac, m.n_layers))
    return [per_ckpt if i in chosen else full for i in range(m.n_layers)]


def loss_backward_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """The chunked loss's backward beyond the kept logits: the gradient of the logits (compute
    dtype) and the fp32 work of one chunk (in 16 bits the upcast copy and the softmax buffer
    briefly coexist; in fp32 one chunk is the gradient itself)."""
    from scale_llm.components.loss import CHUNK_ELEMENTS

    N, V = batch * m.seq_len, m.vocab_size
    if num.tp > 1:  # loss_parallel's backward peaks no higher than its forward (measured)
        return loss_forward_bytes(m, batch, num)
    rows = max(1, CHUNK_ELEMENTS // V)
    fp32_work = loss_forward_bytes(m, batch, num)  # the same fp32 chunk (and its upcast)
    if rows >= N:  # one chunk: its buffer becomes the gradient
        return fp32_work if num.compute == 4 else max(fp32_work, (4 + num.compute) * N * V)
    return num.compute * N * V + fp32_work


def loss_forward_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """The chunked loss's forward beyond what is saved: one chunk's fp32 log-softmax (and in 16
    bits the upcast copy it is computed from)."""
    from scale_llm.components.loss import CHUNK_ELEMENTS

    N, V = batch * m.seq_len, m.vocab_size
    if num.tp > 1:  # beyond the fp32 log-softmax it saves: the 16-bit logits, and two fp32
        # buffers of loss_parallel's log-softmax at its peak (x - max, its exp), one of them
        # where the saved log-softmax will be (measured on 2 gloo ranks, fp32 and bf16)
        return (4 + (num.compute if num.compute != 4 else 0)) * N * (V // num.tp)
    rows = max(1, CHUNK_ELEMENTS // V)
    return (1 if num.compute == 4 else 2) * 4 * min(N, rows) * V


def block_backward_bytes(m: ModelConfig, batch: int, num: Numerics) -> int:
    """Gradients in flight inside one block's backward at its peak (the MLP product's
    backward): those of the MLP's three hidden-width tensors (compute dtype) and the one of the
    residual stream's width flowing in (measured on 2 gloo ranks, every backend). Under tensor
    parallelism 1/tp of the width; with sequence parallelism the gradient flows in as this
    rank's part of the sequence and is all-gathered whole (both alive)."""
    N = batch * m.seq_len
    width = mlp_hidden_size(m) // num.tp
    stream = N + (num.stream_tokens(N) if num.sequence_parallel else 0)
    return 3 * num.compute * N * width + num.residual * stream * m.d_model


def resident_input_bytes(m: ModelConfig, batch: int) -> int:
    """Token ids and targets and the rotary tables: alive through the whole step."""
    T = m.seq_len
    return 8 * batch * (T + 1) + 8 * batch * T + 4 * T * (m.d_model // m.n_heads)


# ----------------------------------------------------------------------------- measurement


def measure_saved_bytes(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    autocast: contextlib.AbstractContextManager | None = None,
    compiled: bool = False,
) -> int:
    """Bytes of the distinct storages the forward pass and loss keep for backward.

    saved_tensors_hooks see everything autograd saves (checkpointed blocks save only their
    inputs). Selective checkpointing keeps matmul outputs in its own cache rather than through
    autograd, so a dispatch mode also records every op output and counts those still alive
    after the forward pass. Parameters are not activations and are left out.

    compiled: the blocks are torch.compile'd (and the loss is the compiled one): a dispatch mode
    cannot run around compiled code, so only what autograd saves is counted (enough: compiled
    graphs save through autograd), after a first forward and backward that compiles them.
    """
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    from scale_llm.components.loss import cross_entropy

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
    if compiled:
        from scale_llm.components.loss import compiled_loss

        loss_fn = compiled_loss()
        with autocast or contextlib.nullcontext():
            warm = model(inputs)
        loss_fn(warm, targets).backward()  # compiles the blocks and the loss
        model.zero_grad(set_to_none=True)
        del warm
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with autocast or contextlib.nullcontext():
                logits = model(inputs)
            loss = loss_fn(logits, targets)
        del logits
        total = sum(saved.values())
        del loss
        return total
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Outputs():
        with autocast or contextlib.nullcontext():
            logits = model(inputs)
        loss = cross_entropy(logits, targets)
    del logits
    alive = {
        ptr: nbytes
        for ptr, (ref, nbytes) in outputs.items()
        if not ref.expired() and ptr not in params
    }
    alive.pop(loss.untyped_storage().data_ptr(), None)
    total = sum({**alive, **saved}.values())
    del loss
    return total


def measure_activations(cfg: Config, plan: RunPlan) -> tuple[int, int]:
    """(counted, predicted) saved bytes for cfg's model at the plan's micro-batch, on the CPU,
    with the precision the plan's backend would use (autocast, fp32 or a 16-bit module)."""
    from scale_llm.model import build_model
    from scale_llm.parallel.activation_checkpointing import apply_activation_checkpointing

    num = numerics_for(plan.precision, plan.backend, fused_norm=True)  # the CPU's RMSNorm
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, "cpu")
    if num.compute == 2 and not num.autocast:
        model = model.to(torch.bfloat16)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    compiled = compiles(cfg.train, plan.device.type)
    compiled = compiled and cfg.activation_checkpointing.mode != "selective"
    if compiled:  # (selective keeps its cache outside autograd: counted eager only)
        from scale_llm.parallel.compile import compile_blocks

        compile_blocks(model)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if num.autocast else None
    mb = plan.micro_batch_size
    tokens = torch.randint(0, cfg.model.vocab_size, (mb, cfg.model.seq_len + 1))
    predicted = saved_activation_bytes(cfg.model, cfg.activation_checkpointing, mb, num)
    return measure_saved_bytes(model, tokens, autocast, compiled), predicted
