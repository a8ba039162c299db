#!/usr/bin/env bash
# Issue 21 (branch trust): the new CUDA tests, the CUDA tests touching capture queries, then
# the stress suite's long form. Runs from the repo root; output under $OUT. < 4 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="packages/bcg-core/src:packages/bcg-diffusion/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
out="${OUT:-/tmp/out}"; mkdir -p "$out"
timeout 60 python3 -m pytest -p no:cacheprovider -q -m cuda \
    tests/core/test_cuda_trust.py tests/core/test_cpu_trust.py tests/core/test_cuda_capture.py \
    tests/core/test_cuda_errors.py tests/core/test_cuda_recovery.py tests/core/test_cuda_streams.py \
    2>&1 | tail -40 > "$out/cuda_tests.txt"
BCG_STRESS_CYCLES=12000 timeout 160 python3 -X faulthandler -m pytest -p no:cacheprovider -q -s \
    tests/core/test_stress.py -k cuda 2>&1 | tail -30 > "$out/stress.txt"
echo "stress rc=$?" >> "$out/stress.txt"
