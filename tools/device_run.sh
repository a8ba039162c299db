#!/usr/bin/env bash
# One device call that does everything (the GPU lease is short): install the carried wheels,
# run the CUDA suite from source, then `bcg demo` and `bcg bench` from the installed wheels
# (entry points need installed metadata). Logs and results go to $OUT (or ./device-out).
# Usage on the GPU machine: tools/device_run.sh [extra bench args, e.g. --skip torch.compile]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-device-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/bcg-site .whl/*.whl || exit 1
PYTHONPATH=packages/bcg-core/src:packages/bcg-diffusion/src timeout 240 \
  python3 -m pytest -p no:cacheprovider tests/core tests/diffusion -m cuda -q -rf > "$out/cuda_tests.log" 2>&1
tail -5 "$out/cuda_tests.log"
export PYTHONPATH=/tmp/bcg-site
timeout 90 python3 -m bcg_core demo > "$out/demo.log" 2>&1; tail -3 "$out/demo.log"
for w in break-overhead dit decoder; do
  timeout 240 python3 -m bcg_core bench "$w" "$@" --json "$out/bench_$w.json" --plot "$out/bench_$w.png" \
    > "$out/bench_$w.log" 2>&1
  echo "bench $w: rc=$?"; tail -2 "$out/bench_$w.log"
done
