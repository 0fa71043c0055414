"""The `train.fp8` config section (FP8 matmuls through torchao) and its checks that need no
hardware; parallel/fp8.py converts the model, train/preflight.py checks torchao and the GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from scale_llm.config.schema import config_key


@dataclass
class Fp8Config:
    enabled: bool = config_key(
        False,
        "FP8 matmuls in the transformer blocks' linears (torchao's `Float8Linear`; the embedding, "
        "the output head and any linear whose dims, per tensor-parallel rank, are not multiples of "
        "16 stay in the run's precision). Weights, gradients and optimizer state stay in high "
        "precision, so checkpoints do not change. Needs torchao (`pip install -e '.[fp8]'`) and a "
        "GPU of compute capability 8.9 or newer (H100, H200, L4, RTX 4090); on the CPU an emulated "
        "path runs (for tests and to see the curve). With parallel.backend=single or fsdp. See "
        "[performance.md](performance.md)",
    )
    recipe: Literal["tensorwise", "rowwise"] = config_key(
        "tensorwise",
        "how scales are taken: `tensorwise` (one scale per tensor; fastest, torchtitan's default) "
        "or `rowwise` (one scale per row of each operand; closer to bf16, a little slower)",
    )
    fsdp_float8_all_gather: Literal["auto", True, False] = config_key(
        "auto",
        "FSDP2 all-gathers the weights in fp8 (half of bf16's bytes) and casts them once per "
        "gather. `auto`: on with the tensorwise recipe, off with rowwise (torchao supports it "
        "with tensorwise only)",
    )


# values of other keys that ask for fp8: what the loader says instead of a near match
WRONG_VALUES = {
    ("train.precision", "fp8"): (
        "to train in fp8, keep train.precision=bf16 and set train.fp8.enabled: true (FP8 "
        "matmuls in the blocks' linears, through torchao)"
    ),
}


NOT_FP16 = (  # (the plan's launch_problems: `auto` never resolves to fp16)
    "train.fp8.enabled=true keeps what is not fp8 in bf16, not fp16 (every GPU with fp8 "
    "matmuls has bf16, which needs no loss scaling): set train.precision=bf16"
)


def fp8_all_gathers(fp8: Fp8Config) -> bool:
    """Whether FSDP2 gathers the fp8 linears' weights in fp8 (auto: with tensorwise scales)."""
    gather = fp8.fsdp_float8_all_gather
    return fp8.recipe == "tensorwise" if gather == "auto" else bool(gather)


def validate_fp8(fp8: Fp8Config) -> list[str]:
    """The train.fp8 keys' own consistency (torchao, the GPU and the backend: the preflight)."""
    if fp8.fsdp_float8_all_gather is True and fp8.recipe != "tensorwise":
        return [
            f"train.fp8.fsdp_float8_all_gather=true needs train.fp8.recipe=tensorwise (torchao "
            f"gathers fp8 weights with one scale per tensor only; the recipe is "
            f"{fp8.recipe}); set train.fp8.fsdp_float8_all_gather=auto or false"
        ]
    return []
