#!/usr/bin/env bash
# torchrun on one node or many.
#   bash launch/torchrun.sh CONFIG [args]                        # this node, NGPU processes
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash launch/torchrun.sh CONFIG [args]   # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash launch/torchrun.sh CONFIG [args]   # on node 1
# NGPU: processes per node (default: every GPU CUDA_VISIBLE_DEVICES leaves, or 2 without GPUs).
# NODE_RANK: required when NNODES > 1 (0 on the node at MASTER_ADDR).
# MASTER_PORT: rendezvous port on MASTER_ADDR (default 29500).
# SIGTERM / SIGINT: every rank saves a checkpoint after its step; the script then prints where it
# is and how to continue, and exits 128 + the signal's number (143 / 130).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
require_config "$@"
NNODES="${NNODES:-1}"
# A node rank left to a default would give two nodes rank 0, and torchrun would wait for a node
# that never comes: a multi-node run names each node's rank, a one-node run has none but 0.
if ! [[ "$NNODES" =~ ^[1-9][0-9]*$ ]]; then
  echo "torchrun.sh: NNODES=$NNODES: NNODES is the number of nodes in the run; set it to 1 or" \
    "more (or unset it for a one-node run)" >&2
  exit 2
fi
others="1 to $(( NNODES - 1 )) on the others"
[[ "$NNODES" == "2" ]] && others="1 on the other"
if [[ "$NNODES" != "1" && -z "${NODE_RANK:-}" ]]; then
  echo "torchrun.sh: NNODES=$NNODES but NODE_RANK is not set; set NODE_RANK to this node's" \
    "index on each node: 0 on the node at MASTER_ADDR, $others" >&2
  exit 2
fi
if [[ "$NNODES" == "1" && "${NODE_RANK:-0}" != "0" ]]; then
  echo "torchrun.sh: NODE_RANK=$NODE_RANK but NNODES is 1 (the default): set NNODES to the" \
    "number of nodes in the run, or unset NODE_RANK for a one-node run" >&2
  exit 2
fi
if ! [[ "${NODE_RANK:-0}" =~ ^(0|[1-9][0-9]*)$ && "${NODE_RANK:-0}" -lt "$NNODES" ]]; then
  echo "torchrun.sh: NODE_RANK=$NODE_RANK but NNODES=$NNODES: set NODE_RANK to this node's" \
    "index: 0 on the node at MASTER_ADDR, $others" >&2
  exit 2
fi
if [[ "$NNODES" != "1" && -z "${MASTER_ADDR:-}" ]]; then  # (before node 0 prepares the data)
  echo "torchrun.sh: NNODES=$NNODES but MASTER_ADDR is not set; set MASTER_ADDR on every node" \
    "to the address of node 0 (NODE_RANK=0)" >&2
  exit 2
fi
check_master_port
check_master_addr
# Nodes 1..N wait in the rendezvous while node 0 prepares the data (hours for a large corpus):
# torchrun's own wait is 15 minutes.
wait_min="${SCALE_LLM_NODE_WAIT_MIN:-1440}"
if ! [[ "$wait_min" =~ ^[1-9][0-9]{0,5}$ ]]; then
  echo "torchrun.sh: SCALE_LLM_NODE_WAIT_MIN='${wait_min:0:60}' is not a number of minutes" \
    "(how long nodes wait for node 0 to prepare the data and join); set 1 or more, or unset" \
    "it (1440)" >&2
  exit 2
fi
refuse_more_ranks_than_gpus
export NODE_RANK="${NODE_RANK:-0}"
launch_world=$(( NGPU * NNODES ))
run_prepare "$@"
# Not exec: the launcher stays to pass a stop signal on to the workers and to end with one line
# saying where the checkpoint is and how to continue (_env.sh, stopping).
if [[ "$NNODES" == "1" ]]; then
  run_job tell_workers "${TORCHRUN[@]}" --standalone --nproc_per_node "$NGPU" \
    -m scale_llm train "$@"
else
  run_job tell_workers "${TORCHRUN[@]}" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --nproc_per_node "$NGPU" --rdzv_conf "timeout=$(( wait_min * 60 ))" \
    --master_addr "$MASTER_ADDR" \
    --master_port "${MASTER_PORT:-29500}" -m scale_llm train "$@"
fi
end_run "$@"
