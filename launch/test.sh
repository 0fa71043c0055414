#!/usr/bin/env bash
# Set up the virtual environment with the dev tools, then lint and run the tests.
#   bash launch/test.sh [pytest args]          everything (what CI runs)
#   bash launch/test.sh --fast [pytest args]   the inner loop: the in-process tests and one
#                                              multi-process parity case (tests not marked slow)
set -euo pipefail
unset CDPATH
root="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${SCALE_LLM_VENV:-}" && "$SCALE_LLM_VENV" != /* ]]; then  # (from where it was started)
  export SCALE_LLM_VENV="$PWD/$SCALE_LLM_VENV"
fi
cd "$root"
select=()
if [[ "${1:-}" == "--fast" ]]; then
    shift
    select=(-m "not slow")
fi
bash launch/setup.sh --dev
venv="${SCALE_LLM_VENV:-.venv}"  # (setup.sh's: SCALE_LLM_VENV names another)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
start=$(date +%s)
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/python" -m pytest tests ${select[@]+"${select[@]}"} "$@"
echo "test.sh: lint + tests took $(( $(date +%s) - start ))s"
