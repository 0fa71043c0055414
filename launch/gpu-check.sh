#!/usr/bin/env bash
# The first thing to run on a machine with a GPU (a few minutes on one GPU; on a CPU-only
# machine the same checks at tiny size):
#   (a) tiny.yaml curves: CPU fp32, then the GPU in bf16 and fp16, eager and compiled
#   (b) a sweep of 400m.yaml: micro-batch x checkpointing, compiled, vs the memory estimate
#   (c) the framework's step vs a bare PyTorch loop
#   (d) the headline row under FSDP2 in a world of one (bf16 parameters, fp32 master shards)
#   (e) with 2+ GPUs: the headline row's DDP step on 2 GPUs against 1 alone (weak scaling)
# Writes OUT_DIR/report.json and OUT_DIR/report.md (record the tables as a report in benchmarks/:
# docs/benchmarks.md).
#   bash launch/gpu-check.sh [OUT_DIR] [--steps N] [--budget-min M] [--only curves,sweep,...]
#                            [--scratch DIR] [--set key=value ...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
# the check runs on one GPU; its scaling item starts 2 processes where the machine has 2 GPUs
export SCALE_LLM_CHECK_NGPU="$gpus" SCALE_LLM_CHECK_VISIBLE="${CUDA_VISIBLE_DEVICES:-}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"  # one GPU
export OMP_NUM_THREADS="${SCALE_LLM_CHECK_THREADS:-$(nproc)}"  # one process: every core
# GPUs that this Python's torch cannot use (a CPU build found first): stop, rather than spend a
# lent GPU's minutes on the CPU checks. SCALE_LLM_CHECK_ALLOW_CPU=1 runs them anyway.
if [[ "$gpus" -gt 0 && "${SCALE_LLM_CHECK_ALLOW_CPU:-0}" != "1" ]] \
    && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "gpu-check: nvidia-smi lists $gpus GPU(s), but torch" \
    "$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null) in $PY cannot use them" \
    "(a CPU build, or a CUDA build the driver is too old for). Point SCALE_LLM_PYTHON at a" \
    "Python with a CUDA build of torch, or run 'bash launch/setup.sh' (it installs one on a GPU" \
    "machine); SCALE_LLM_CHECK_ALLOW_CPU=1 runs the CPU checks anyway" >&2
  exit 2
fi
out=gpu-check
if [[ $# -gt 0 && "$1" != -* ]]; then out="$1"; shift; fi
exec "$PY" -m scale_llm check "$out" "$@"
