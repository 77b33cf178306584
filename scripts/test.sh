#!/usr/bin/env bash
# Set up (if needed) and run the test suite: all of it (what CI runs), or with --fast the
# subset without the tests marked slow or inductor (pyproject.toml's markers; ~2 min on 2 cores).
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
select=()
if [ "${1:-}" = "--fast" ]; then
  shift
  select=(-m "not slow and not inductor")
fi
bash scripts/setup.sh
# the format and the lint (pyproject.toml's [tool.ruff]): `.venv/bin/ruff format .` fixes the first
.venv/bin/ruff format --check --quiet . || { echo "not formatted: run .venv/bin/ruff format ." >&2; exit 1; }
.venv/bin/ruff check --quiet .
# build the native helper once, outside pytest's output capture
.venv/bin/python -c "from compiled_autograd import native; native.load()"
exec .venv/bin/python -m pytest -q -x -p no:cacheprovider "${select[@]}" "$@"
