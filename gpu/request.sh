#!/usr/bin/env bash
# GPU request of the scale branch (issue 23, capture-block cost): where a capture block's time
# goes, plain graphs against bcg graphs at 8B dims; runs from the repo root with $OUT as the
# output folder, in under 3 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="packages/bcg-core/src:packages/bcg-diffusion/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
# 1. Phase times and cProfile of capture blocks (8B dims, 32 layers, 5 sizes).
timeout 120 python3 gpu/profile_capture.py --sizes 256,128,64,8,1 >"$OUT/profile.txt" 2>&1
echo "profile rc=$?"; tail -60 "$OUT/profile.txt"
# 2. The capture-scale workload at 8B dims, for the ratio after this branch's cuts.
timeout 100 python3 -m bcg_core bench capture-scale --json "$OUT/capture-scale.json" \
  >"$OUT/capture-scale.txt" 2>&1
echo "capture-scale rc=$?"; tail -30 "$OUT/capture-scale.txt"
