# Sourced by the launchers: one place for the environment every run starts with.
# Sets: ROOT, PY (the venv's python), NGPU, OMP_NUM_THREADS, PYTORCH_CUDA_ALLOC_CONF,
# DS_ACCELERATOR (CPU-only machines), and the function run_prepare.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${SCALE_LLM_PYTHON:-$ROOT/.venv/bin/python}"
if [[ ! -x "$PY" ]]; then
  echo "launch: $PY not found; run 'bash launch/setup.sh' first (or set SCALE_LLM_PYTHON)" >&2
  exit 2
fi

# Expandable segments let the CUDA caching allocator grow blocks instead of fragmenting.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
fi
if [[ "$gpus" -eq 0 ]]; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"  # DeepSpeed's CPU accelerator (gloo)
fi
# Processes per node: every GPU, or 2 CPU processes on a machine without GPUs.
NGPU="${NGPU:-$([[ "$gpus" -gt 0 ]] && echo "$gpus" || echo 2)}"
# Split the cores between the local processes instead of letting each take all of them.
cores=$(nproc)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / NGPU > 0 ? cores / NGPU : 1 ))}"

# Prepare the data (a no-op when it is up to date) before training starts. In multi-node jobs
# only node 0 prepares; the others wait for it in the rendezvous. SKIP_PREPARE=1 skips it.
run_prepare() {
  if [[ "${SKIP_PREPARE:-0}" != "1" && "${NODE_RANK:-0}" == "0" ]]; then
    "$PY" -m scale_llm prepare "$@"
  fi
}

require_config() {
  if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: bash $0 CONFIG.yaml [scale-llm train args...]" >&2
    exit 2
  fi
}
