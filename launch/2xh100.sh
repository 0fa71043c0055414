#!/usr/bin/env bash
# One node, two processes (two GPUs; on a CPU-only machine, two gloo processes).
#   bash launch/2xh100.sh yaml/400m.yaml [--set key=value ...]
set -euo pipefail
NGPU=2  # before _env.sh: it splits the cores between NGPU processes
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
require_config "$@"
refuse_node_settings "2xh100.sh runs on this node alone (launch/torchrun.sh runs on several)"
if [[ "$visible_gpus" -eq 1 ]]; then  # two processes on one GPU: NCCL refuses the duplicate
  echo "2xh100.sh: this machine leaves 1 GPU visible and 2xh100.sh starts 2 processes, one per" \
    "GPU; use launch/torchrun.sh (one process per visible GPU) or run without a launcher" >&2
  exit 2
fi
launch_world=2
run_prepare "$@"
run_job tell_workers "${TORCHRUN[@]}" --standalone --nproc_per_node 2 -m scale_llm train "$@"
end_run "$@"  # (a stop signal: one line with the checkpoint, exit 128 + its number)
