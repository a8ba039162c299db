#!/usr/bin/env bash
# Issue 22 (branch first): the CUDA tests this branch adds or touches, on the H200.
# Runs from the repo root; $OUT gets the pytest logs. Diffusers tests skip unless diffusers is
# carried (tools/device_run.sh installs wheels into /tmp/bcg-site).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/out}"
mkdir -p "$out"
site="${BCG_SITE:-/tmp/bcg-site}"
[ -d "$site" ] || site=""
export PYTHONPATH="packages/bcg-core/src:packages/bcg-diffusion/src${site:+:$site}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
timeout 200 python3 -m pytest -p no:cacheprovider -q -rs -m cuda \
  tests/core/test_divergence_first_contact.py tests/core/test_divergence_recipes.py \
  tests/core/test_divergence.py tests/diffusion/test_divergence_diffusers.py \
  tests/core/test_cuda_transformers.py \
  2>&1 | tee "$out/cuda_divergence.log" | tail -30
python3 benchmarks/divergence_demo.py --backend cuda > "$out/divergence_demo.log" 2>&1
echo "divergence_demo rc=$?" >> "$out/divergence_demo.log"
tail -12 "$out/divergence_demo.log"
