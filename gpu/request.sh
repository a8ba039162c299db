#!/usr/bin/env bash
# GPU request of the scale branch (issue 23); runs from the repo root with $OUT as the output
# folder, in well under 4 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="packages/bcg-core/src:packages/bcg-diffusion/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
# 1. The start-up tests (CUDA and the shared CPU/CUDA scenarios) and the suites they touch.
timeout 60 python3 -m pytest -q -p no:cacheprovider \
  tests/core/test_cuda_startup_memory.py tests/core/test_cpu_runner_startup.py \
  tests/core/test_cpu_runner_serving.py tests/core/test_cuda_runner_serving.py \
  tests/core/test_cuda_workspaces.py >"$OUT/tests.txt" 2>&1
echo "tests rc=$?"; tail -15 "$OUT/tests.txt"
# 2. The capture-scale workload at 8B dims.
timeout 90 python3 -m bcg_core bench capture-scale --json "$OUT/capture-scale.json" \
  --plot "$OUT/capture-scale.png" >"$OUT/capture-scale.txt" 2>&1
echo "capture-scale rc=$?"; tail -40 "$OUT/capture-scale.txt"
# 3. The runner's cost per call (synchronous and pipelined), if present on this commit.
if [ -f benchmarks/bench_call_cost.py ]; then
  timeout 80 python3 benchmarks/bench_call_cost.py --out "$OUT" --repeats 10 --steps 30 >"$OUT/call-cost.txt" 2>&1
  echo "call-cost rc=$?"; tail -20 "$OUT/call-cost.txt"
fi
