#!/usr/bin/env bash
# Issue 24 (branch serve): the continuous-batching CUDA tests, then the serve bench.
# Runs from the repo root with $OUT as the output folder, in well under 4 minutes: the full
# `bcg bench serve` (about 5-7 minutes) is for one separate device call.
set -uo pipefail
export PYTHONPATH="packages/bcg-core/src:packages/bcg-diffusion/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
python3 -m pytest -p no:cacheprovider -q -x tests/core/test_cuda_continuous_batching.py \
  tests/core/test_cpu_continuous_batching.py 2>&1 | tail -30 | tee "$OUT/tests.txt"
timeout 150 python3 -m bcg_core bench --smoke serve --json "$OUT/serve-smoke.json" \
  2>&1 | grep -v ContinuousBatchingLogger | tail -40 | tee "$OUT/serve-smoke.txt"
