#!/usr/bin/env bash
# GPU probe for issue 20 (compiled breaks); output in $OUT/probe_compile.txt. < 4 minutes.
cd "$(dirname "$0")/.."
export PYTHONPATH="packages/bcg-core/src:packages/bcg-diffusion/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
timeout 220 python3 gpu/probe_compile.py > "${OUT:-/tmp}/probe_compile.txt" 2>&1
echo "rc=$?" >> "${OUT:-/tmp}/probe_compile.txt"
tail -c 6000 "${OUT:-/tmp}/probe_compile.txt"
