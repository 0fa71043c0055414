#!/usr/bin/env bash
# The whole path on one machine, no GPU needed: set up, prepare the built-in corpus, train the
# tiny model and generate text from it; a line says each phase as it starts, and the last lines
# give the commands to look at the run (TensorBoard, `scale-llm runs`, `scale-llm export`).
#   bash launch/quickstart.sh [CONFIG] [extra train args]
set -euo pipefail
unset CDPATH
root="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${SCALE_LLM_VENV:-}" && "$SCALE_LLM_VENV" != /* ]]; then  # (from where it was started)
  export SCALE_LLM_VENV="$PWD/$SCALE_LLM_VENV"
fi
here="$PWD"
config="${1:-yaml/tiny.yaml}"
shift $(( $# > 0 ? 1 : 0 ))
# a config in the folder the script was started from, else the checkout's (the shipped ones)
if [[ "$config" != /* && -f "$here/$config" ]]; then config="$here/$config"; fi
cd "$root"
say() { echo "quickstart.sh: $*"; }
venv="${SCALE_LLM_VENV:-.venv}"  # (setup.sh's: SCALE_LLM_VENV names another)
shown="$(printf '%q' "$venv")"

if [[ -x "$venv/bin/python" ]]; then
  say "[1/4] checking $venv (set up earlier: a few seconds)"
else
  say "[1/4] setting up $venv (first time: a few minutes; PyTorch and the other dependencies" \
    "are downloaded, with pip's progress below)"
fi
bash launch/setup.sh
if [[ -z "${PYTORCH_CUDA_ALLOC_CONF+set}" && -z "${PYTORCH_ALLOC_CONF+set}" ]]; then
  export PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"  # (_env.sh says why)
fi
start=$(date +%s)
# What the run will use, read once from the config and the train args: run dir, its parent (the
# run.dir), data dir (full paths), steps (a bad config or argument: its one paragraph, exit 2).
facts="$("$venv/bin/python" -c '
import os, sys
from scale_llm.cli import config_from_args, parse_args
from scale_llm.errors import UserError
try:
    cfg = config_from_args(parse_args(["train", *sys.argv[1:]]))
except (UserError, OSError) as e:  # (a config this user may not read: said, no traceback)
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
full = [os.path.abspath(p) for p in (cfg.run_dir, cfg.run.dir, cfg.data.dir)]  # (here: the checkout)
print(*full, cfg.train.max_steps, sep="\n")' "$config" "$@")"
{ read -r run_dir; read -r runs; read -r data_dir; read -r steps; } <<< "$facts"
say "[2/4] preparing data in $data_dir (first time only: a tokenizer, then token shards)"
"$venv/bin/scale-llm" prepare --as-train "$config" "$@"  # the data the train args ask for
say "[3/4] training $run_dir for $steps steps (a step line every logging.every steps)"
"$venv/bin/scale-llm" train "$config" "$@"
say "[4/4] generating text from $run_dir"
echo "---- sample from $run_dir ----"
"$venv/bin/scale-llm" generate "$run_dir" --prompt "def " --max-new-tokens 120 --seed 0
say "prepare + train + generate took $(( $(date +%s) - start ))s"
name="$(basename "$run_dir")"
where=""
if [[ "$here" != "$root" ]]; then where=" (from $root: cd $(printf '%q' "$root"))"; fi
cat <<EOF
Next$where:
  $shown/bin/tensorboard --logdir $(printf '%q' "$runs")   # the curves and samples, on http://localhost:6006
  $shown/bin/scale-llm runs $(printf '%q' "$runs")   # every run there: step, loss, status, checkpoint
  $shown/bin/scale-llm export $(printf '%q' "$run_dir") --out $(printf '%q' "exports/$name")   # a Hugging Face folder (bash launch/setup.sh --dev first)
EOF
