#!/usr/bin/env bash
# The cuBLAS-workspace bug behind the third session's illegal address, on a GPU machine: run
# each test of tests/core/test_cuda_workspaces.py in its own process, once with the old rule
# (capture on the caller's stream, whose workspace the warm-ups made outside any pool) and
# once as shipped (capture lanes). Prints PASS/FAIL per test and rule; the log of the H200 run
# is benchmarks/results/workspace-demo-h200-2026-12-01-s4.log.
# Usage: benchmarks/workspace_demo.sh   (sources on PYTHONPATH, as tools/device_tests.sh does)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=packages/bcg-core/src:packages/bcg-diffusion/src:tests/core PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__)"
for t in test_graph_survives_a_workspace_clear_after_warmups \
         test_a_capture_leaves_other_graphs_workspaces_alone \
         test_runner_entries_survive_workspace_clears_and_a_reset_runner; do
  for rule in old lanes; do
    timeout 120 python3 - "$t" "$rule" <<'PY' 2>&1 | tail -1
import sys

import torch

import bcg_core._backends.cuda as cuda

test, rule = sys.argv[1], sys.argv[2]
if rule == "old":  # capture on whatever stream is current, as before capture lanes
    cuda.CudaBackend.capture_stream = lambda self, pool, device: torch.cuda.current_stream()
import test_cuda_workspaces as m

try:
    getattr(m, test)()
    print(test, "rule", rule, "PASS")
except BaseException as e:  # a fault is a result here
    print(test, "rule", rule, "FAIL", type(e).__name__, str(e)[:150].replace("\n", " "))
PY
  done
done
