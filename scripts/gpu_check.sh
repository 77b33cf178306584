#!/usr/bin/env bash
# One prepared check on a machine with a CUDA GPU (CI has none): the CUDA tests, then the
# benchmark on the GPU (eager, torch's compiled autograd and ours, with inductor).
#   bash scripts/gpu_check.sh [OUT_DIR]
# Uses the machine's python3 and torch as they are. A torch other than the tested release
# (NOTE [Torch versions]) is allowed here with COMPILED_AUTOGRAD_UNTESTED_TORCH=1: this is a check.
set -u
OUT=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1 COMPILED_AUTOGRAD_UNTESTED_TORCH=1
export COMPILED_AUTOGRAD_CACHE_DIR=/tmp/ca_cache
PY=${PYTHON:-python3}
t0=$(date +%s)
stamp() { echo "=== $* (t=$(( $(date +%s) - t0 ))s)"; }

stamp versions
nvidia-smi -L
$PY -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
stamp helper
timeout 150 $PY -c "from compiled_autograd import native; native.load(); print('helper ok')" 2>&1 | tail -5
stamp tests
timeout ${TEST_TIMEOUT:-220} $PY -m pytest -q -p no:cacheprovider -rfE tests/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.log" | grep -v "^DEBUG\|^INFO" | tail -40
stamp bench
timeout ${BENCH_TIMEOUT:-280} $PY -m benchmarks.run --device cuda --threads 8 \
  --workloads "${WORKLOADS:-mlp256,transformer,chain}" --modes eager,torch-ca:inductor,ours:inductor \
  --iters 10 --min-time 1 --timeout 150 --out "$OUT/bench" 2>&1 | tail -30
cat "$OUT/bench/results.md" 2>/dev/null | head -60
stamp done
