#!/usr/bin/env bash
# torchrun on one node or many.
#   bash launch/torchrun.sh CONFIG [args]                        # this node, NGPU processes
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash launch/torchrun.sh CONFIG [args]   # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash launch/torchrun.sh CONFIG [args]   # on node 1
# NGPU: processes per node (default: every GPU, or 2 on a CPU-only machine).
# MASTER_PORT: rendezvous port on MASTER_ADDR (default 29500).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
require_config "$@"
NNODES="${NNODES:-1}"
export NODE_RANK="${NODE_RANK:-0}"
run_prepare "$@"
if [[ "$NNODES" == "1" ]]; then
  exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
    -m scale_llm train "$@"
fi
exec "$PY" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" \
  --nproc_per_node "$NGPU" --master_addr "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}" \
  --master_port "${MASTER_PORT:-29500}" -m scale_llm train "$@"
