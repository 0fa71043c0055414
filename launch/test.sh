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
# Two pytest workers (pytest-xdist), each given a whole test file at a time (a module's worlds
# start once; files that share runs go together: tests/conftest.py): on 2 cores the
# multi-process tests leave a core idle about half the time.
# SCALE_LLM_TEST_WORKERS=0 runs the tests in one process.
workers="${SCALE_LLM_TEST_WORKERS:-2}"
if ! [[ "$workers" =~ ^(0|[1-9][0-9]?)$ ]]; then
  echo "test.sh: SCALE_LLM_TEST_WORKERS='${workers:0:40}' is not a number of workers (0-99)" >&2
  exit 2
fi
bash launch/setup.sh --dev
venv="${SCALE_LLM_VENV:-.venv}"  # (setup.sh's: SCALE_LLM_VENV names another)
per_worker=$(( $(nproc) / (workers > 1 ? workers : 1) ))  # (torch's threads in each worker)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( per_worker > 0 ? per_worker : 1 ))}"
start=$(date +%s)
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/python" -m pytest tests -n "$workers" --dist loadfile ${select[@]+"${select[@]}"} "$@"
echo "test.sh: lint + tests took $(( $(date +%s) - start ))s"
