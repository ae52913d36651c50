#!/usr/bin/env bash
# Set up the venv, then run lint, type checks and the test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
VENV="${CKPT_VENV:-.venv}"
"$VENV/bin/ruff" check ckpt tests bench
"$VENV/bin/mypy" ckpt
# Tests run on min(cores, 4) pytest-xdist workers (most of the suite waits on forked ranks and
# subprocesses: 2 workers on 2 cores take ~35% less time than one); CKPT_TEST_WORKERS=0 runs them
# in this process. worksteal: the long tests (started first, see tests/conftest.py) don't pile up.
WORKERS="${CKPT_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 2); echo $(( n < 4 ? n : 4 )))}"
"$VENV/bin/python" -m pytest tests -n "$WORKERS" --dist worksteal "$@"
