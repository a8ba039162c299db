#!/usr/bin/env bash
# The main job (README.md): from a fresh machine to `bcg demo` in one step. Builds the same
# hatch dev environment as tools/test.sh, then runs the demo (CUDA if present, else the CPU
# graph backend).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/_hatch.sh
exec "$HATCH" run dev:demo
