#!/usr/bin/env bash
# Set up the virtual environment with the dev tools, then lint and run the whole test suite.
#   bash launch/test.sh [pytest args]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash launch/setup.sh --dev
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
start=$(date +%s)
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest tests "$@"
echo "test.sh: lint + tests took $(( $(date +%s) - start ))s"
