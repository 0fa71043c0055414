#!/usr/bin/env bash
# The deepspeed launcher, for configs with parallel.backend: deepspeed.
#   bash launch/deepspeed.sh yaml/400m-zero3-offload.yaml [args]        # this node, NGPU processes
#   HOSTFILE=hosts bash launch/deepspeed.sh CONFIG [args]               # nodes listed in a hostfile
# A hostfile has one line per node: "node0 slots=8". MASTER_ADDR / MASTER_PORT are optional.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
require_config "$@"
run_prepare "$@"
launcher=("$PY" -m deepspeed.launcher.runner --no_local_rank)
if [[ -n "${HOSTFILE:-}" ]]; then
  launcher+=(--hostfile "$HOSTFILE")
  [[ -n "${MASTER_ADDR:-}" ]] && launcher+=(--master_addr "$MASTER_ADDR")
else
  launcher+=(--num_gpus "$NGPU")
fi
[[ -n "${MASTER_PORT:-}" ]] && launcher+=(--master_port "$MASTER_PORT")
exec "${launcher[@]}" --module scale_llm train "$@"
