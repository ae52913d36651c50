#!/usr/bin/env bash
# Set up the venv, then run the main job: `ckpt demo` (train, fail, resume, reshard, verify, export).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
VENV="${CKPT_VENV:-.venv}"
exec "$VENV/bin/ckpt" demo "$@"
