#!/usr/bin/env bash
# Create ./.venv (or $CKPT_VENV) and install ckpt with its extras. torch is installed only when the
# venv lacks it, pinned to the CPU wheel this machine provides; override with TORCH_SPEC, e.g.
#   TORCH_SPEC="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130" scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CKPT_VENV:-.venv}"
PY="${PYTHON:-python3}"
EXTRAS="${CKPT_EXTRAS:-dev,s3,zarr,hf,plot}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  # shellcheck disable=SC2086
  "${PIP[@]}" ${TORCH_SPEC:-torch==2.13.0}
fi
"${PIP[@]}" -e ".[${EXTRAS}]"
echo "ckpt installed in $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
