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
# build the native helper once, outside pytest's output capture
.venv/bin/python -c "from compiled_autograd import native; native.load()"
exec .venv/bin/python -m pytest -q -x -p no:cacheprovider "${select[@]}" "$@"
