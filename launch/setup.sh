#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and install scale_llm into it.
#
#   bash launch/setup.sh          # runtime dependencies
#   bash launch/setup.sh --dev    # plus the test and lint tools (pytest, ruff), the
#                                 # Hugging Face bridges their tests use ([hf]: transformers,
#                                 # safetensors, lm-eval) and torchao for train.fp8 ([fp8])
#
# torch: on a machine without an NVIDIA GPU the CPU build is pinned (torch==2.13.0) so pip never
# pulls several GB of CUDA wheels. With a GPU, a torch already in the venv is kept; otherwise pip
# installs its default (CUDA) build. Set SCALE_LLM_TORCH to choose yourself, e.g.
#   SCALE_LLM_TORCH="torch==2.13.0" bash launch/setup.sh
# Re-running is cheap: nothing is reinstalled unless setup.py or SCALE_LLM_TORCH changed.
# SCALE_LLM_VENV=DIR puts the venv there (test.sh, quickstart.sh and the launchers then use it too).
set -euo pipefail
# `python -m pip`, `-m venv` and `-c` put the working folder first on sys.path: a pip/ or torch.py
# there would run in their place (Python 3.11+ honours this; older Pythons are refused below)
export PYTHONSAFEPATH=1

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SCALE_LLM_VENV:-$root/.venv}"
extras=""
if [[ $# -gt 1 || ( $# -eq 1 && "$1" != "--dev" ) ]]; then
  echo "setup.sh: unknown argument(s) '$*'; use: bash launch/setup.sh [--dev]" >&2
  exit 2
fi
[[ "${1:-}" == "--dev" ]] && extras="[dev,hf,fp8]"

python_bin="${PYTHON:-}"
if [[ -z "$python_bin" ]]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python_bin="$candidate"; break; fi
  done
fi
[[ -n "$python_bin" ]] || { echo "setup.sh: no python3 found; install Python 3.11" >&2; exit 2; }

if [[ ! -x "$venv/bin/python" ]]; then
  if ! "$python_bin" -I -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "setup.sh: $python_bin is $("$python_bin" --version 2>&1), and scale_llm needs Python" \
      "3.11 or newer; install it, or name it: PYTHON=python3.12 bash launch/setup.sh" >&2
    exit 2
  fi
  echo "setup.sh: creating $venv with $("$python_bin" --version)"
  "$python_bin" -m venv "$venv"
fi
if ! "$venv/bin/python" -I -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "setup.sh: $venv holds $("$venv/bin/python" --version 2>&1), and scale_llm needs Python" \
    "3.11 or newer; remove $venv and run setup.sh again with one (PYTHON=python3.12)" >&2
  exit 2
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
# On a terminal pip shows what it downloads and installs, with progress bars (a first install
# takes minutes); in a log (CI) it stays quiet.
if [[ ! -t 1 ]]; then pip+=(-q); fi

stamp="$venv/.scale_llm-installed$(echo "$extras" | tr -d '[]' | tr ',' '-')"
# (a new SCALE_LLM_TORCH is a new install: the torch it names is installed over the venv's)
want="$( (cat "$root/setup.py"; echo "torch: ${SCALE_LLM_TORCH:-}") | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "setup.sh: $venv is up to date"
  exit 0
fi

if [[ -n "${SCALE_LLM_TORCH:-}" ]]; then
  "${pip[@]}" install "$SCALE_LLM_TORCH"
elif ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup.sh: NVIDIA GPU found; installing the default (CUDA) torch build"
    "${pip[@]}" install torch
  else
    echo "setup.sh: no GPU found; installing the CPU build torch==2.13.0"
    "${pip[@]}" install torch==2.13.0
  fi
fi

echo "setup.sh: installing scale_llm$extras (editable) and its dependencies"
"${pip[@]}" install -e "$root$extras"
echo "$want" > "$stamp"
"$venv/bin/python" -c "import torch, scale_llm; print(f'setup.sh: ready: torch {torch.__version__}, ' \
  f'cuda={torch.cuda.is_available()}, scale_llm {scale_llm.__version__}')"
