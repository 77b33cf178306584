#!/usr/bin/env bash
# Set up (if needed) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# build the native helper once, outside pytest's output capture
.venv/bin/python -c "from compiled_autograd import native; native.load()"
exec .venv/bin/python -m pytest -q -x -p no:cacheprovider "$@"
