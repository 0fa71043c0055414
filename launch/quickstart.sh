#!/usr/bin/env bash
# The whole path on one machine, no GPU needed: set up, prepare the built-in corpus,
# train the tiny model (about two minutes on 2 CPU cores), and generate text from it.
#   bash launch/quickstart.sh [CONFIG] [extra train args]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
config="${1:-yaml/tiny.yaml}"
shift $(( $# > 0 ? 1 : 0 ))
bash launch/setup.sh
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
start=$(date +%s)
.venv/bin/scale-llm prepare --as-train "$config" "$@"  # the data the train args ask for
.venv/bin/scale-llm train "$config" "$@"
run_dir=$(.venv/bin/python -c 'import sys
from scale_llm.cli import config_from_args, parse_args
args = parse_args(["train", *sys.argv[1:]])
print(config_from_args(args).run_dir)' "$config" "$@")
echo "---- sample from $run_dir ----"
.venv/bin/scale-llm generate "$run_dir" --prompt "def " --max-new-tokens 120 --seed 0
echo "quickstart.sh: prepare + train + generate took $(( $(date +%s) - start ))s"
