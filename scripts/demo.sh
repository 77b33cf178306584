#!/usr/bin/env bash
# Set up (if needed) and run the demo: a small transformer trained with eager
# and with compiled backward side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
