#!/usr/bin/env bash
# The first thing to run on a machine with a GPU (a few minutes on one GPU; on a CPU-only
# machine the same checks at tiny size):
#   (a) tiny.yaml curves: CPU fp32, then the GPU in bf16 and fp16, eager and compiled
#   (b) a sweep of 400m.yaml: micro-batch x checkpointing, compiled, vs the memory estimate
#   (c) the framework's step vs a bare PyTorch loop
#   (d) the headline row under FSDP2 in a world of one (bf16 parameters, fp32 master shards)
# Writes OUT_DIR/report.json and OUT_DIR/report.md (record the tables in docs/benchmarks.md).
#   bash launch/gpu-check.sh [OUT_DIR] [--steps N] [--budget-min M] [--only curves,sweep,...]
#                            [--scratch DIR] [--set key=value ...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"  # one GPU
export OMP_NUM_THREADS="${SCALE_LLM_CHECK_THREADS:-$(nproc)}"  # one process: every core
out=gpu-check
if [[ $# -gt 0 && "$1" != -* ]]; then out="$1"; shift; fi
exec "$PY" -m scale_llm check "$out" "$@"
