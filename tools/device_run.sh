#!/usr/bin/env bash
# One device call that does several jobs (the GPU lease is short). Install the carried wheels
# (from tools/build_device_wheels.sh), then run the named phases in order:
#   tests    the CUDA suite from source (tools/device_tests.sh -m cuda; carried diffusers from
#            /tmp/bcg-site, after the sources)
#   bench    the full `bcg bench` (every installed workload), JSON + PNG
#   demo     `bcg demo`
#   scripts  benchmarks/bench_core.py and benchmarks/bench_dit.py
#   stress   the stress suite's long form (BCG_STRESS_CYCLES, default 12000; BCG_STRESS_TIMEOUT)
#            under faulthandler
#   probes   the GPU probes in benchmarks/ (compiled breaks, flag hand-offs), logs only
#   handoff  the flag hand-off probe alone
#   race     benchmarks/probe_graph_race.py: graphs made, captured and dropped in one or two
#            threads, bare torch and through bcg, each variant in a child process
#            (BCG_RACE_ITERATIONS, default 3000)
# `bcg` runs from the installed wheels because workloads are found through entry points, which
# need installed metadata. Logs and results are written to a scratch folder and packed into
# $OUT/results.tgz on exit (the device tool brings back at most 8 files).
# Usage on the GPU machine: tools/device_run.sh tests bench demo [-- extra bench args]
# (BCG_BENCH_TIMEOUT=SECONDS for a longer bench, e.g. `hf-llama flux --repeats 15` alone;
# BCG_TESTS_TIMEOUT for the suite: one process takes about 310 s on the H200)
set -uo pipefail
cd "$(dirname "$0")/.."
dest="${OUT:-device-out}"; out="${BCG_SCRATCH:-/tmp/bcg-results}"; rm -rf "$out"; mkdir -p "$dest" "$out"
trap 'tar czf "$dest/results.tgz" -C "$out" .' EXIT
export PYTHONUNBUFFERED=1
phases=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do phases+=("$1"); shift; done
[ $# -gt 0 ] && shift  # what is left goes to `bcg bench`
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/bcg-site \
  .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
for phase in "${phases[@]}"; do
  start=$SECONDS
  case "$phase" in
    tests)
      timeout "${BCG_TESTS_TIMEOUT:-300}" tools/device_tests.sh -m cuda -q -rfE --tb=short \
        > "$out/cuda_tests.log" 2>&1
      tail -4 "$out/cuda_tests.log" ;;
    stress)
      BCG_STRESS_CYCLES="${BCG_STRESS_CYCLES:-12000}" \
        PYTHONPATH=packages/bcg-core/src:packages/bcg-diffusion/src timeout "${BCG_STRESS_TIMEOUT:-300}" \
        python3 -X faulthandler -m pytest -p no:cacheprovider -q -s -rfE --tb=short -k cuda \
        tests/core/test_stress.py > "$out/stress.log" 2>&1
      echo "stress rc=$?"; grep -E "stress\[|passed|failed" "$out/stress.log" | tail -3 ;;
    probes|handoff)
      export PYTHONPATH=packages/bcg-core/src:packages/bcg-diffusion/src:/tmp/bcg-site
      if [ "$phase" = probes ]; then
        timeout 200 python3 benchmarks/probe_compile.py > "$out/probe_compile.log" 2>&1
        echo "probe_compile rc=$?"; grep -E "^\[" "$out/probe_compile.log" | cut -c1-200
      fi
      # exits 3 at a deadlock: then once more with a hardware queue per stream
      timeout 90 python3 benchmarks/probe_flag_handoff.py > "$out/probe_flag_handoff.log" 2>&1 \
        || CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 60 python3 benchmarks/probe_flag_handoff.py \
          > "$out/probe_flag_handoff_32.log" 2>&1
      echo "probe_flag_handoff rc=$?"; tail -14 "$out/probe_flag_handoff.log" | cut -c1-200
      unset PYTHONPATH ;;
    race)
      mkdir -p "$out/race"
      PYTHONPATH=packages/bcg-core/src timeout 420 python3 benchmarks/probe_graph_race.py \
        --iterations "${BCG_RACE_ITERATIONS:-3000}" --logs "$out/race" > "$out/probe_graph_race.log" 2>&1
      echo "probe_graph_race rc=$?"; cut -c1-400 "$out/probe_graph_race.log" ;;
    bench)
      PYTHONPATH=/tmp/bcg-site timeout "${BCG_BENCH_TIMEOUT:-360}" python3 -m bcg_core bench "$@" \
        --json "$out/bench.json" --plot "$out/bench.png" > "$out/bench.log" 2>&1
      echo "bench rc=$?"; grep -E "WRONG|Error|error" "$out/bench.log" | head -5 ;;
    demo)
      PYTHONPATH=/tmp/bcg-site timeout 90 python3 -m bcg_core demo > "$out/demo.log" 2>&1
      echo "demo rc=$?"; tail -1 "$out/demo.log" ;;
    scripts)
      export PYTHONPATH=packages/bcg-core/src:packages/bcg-diffusion/src
      timeout 200 python3 benchmarks/bench_core.py --out "$out" > "$out/bench_core.log" 2>&1
      echo "bench_core rc=$?"
      timeout 120 python3 benchmarks/bench_dit.py --out "$out" > "$out/bench_dit.log" 2>&1
      echo "bench_dit rc=$?"; unset PYTHONPATH ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
  echo "phase $phase: $((SECONDS - start)) s"
done
