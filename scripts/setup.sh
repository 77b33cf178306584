#!/usr/bin/env bash
# Create .venv with the pinned CPU torch and this package (editable).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch is pinned: on this machine pip takes the CPU build from local disk;
# an open range would pull a several-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, compiled_autograd; assert torch.__version__.startswith('2.13.0'), torch.__version__"
