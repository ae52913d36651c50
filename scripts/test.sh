#!/usr/bin/env bash
# Set up the venv, then run lint, type checks and the test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
VENV="${CKPT_VENV:-.venv}"
"$VENV/bin/ruff" check ckpt tests bench
"$VENV/bin/mypy" ckpt
"$VENV/bin/python" -m pytest tests "$@"
