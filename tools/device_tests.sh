#!/usr/bin/env bash
# Run the test suites on a GPU machine that has torch and cuda-bindings but no hatch/hatchling
# (the device machine): the sources go on PYTHONPATH instead of being installed.
# Usage: tools/device_tests.sh [pytest args...]   e.g. tools/device_tests.sh -m cuda
# Boundary and packaging tests need the dev tools and are left to CI. Third-party packages
# carried as wheels (diffusers) are found in $BCG_SITE (default /tmp/bcg-site, where
# tools/device_run.sh installs .whl/), placed after the sources so it never shadows them.
set -euo pipefail
cd "$(dirname "$0")/.."
site="${BCG_SITE:-/tmp/bcg-site}"
[ -d "$site" ] || site=""
export PYTHONPATH="packages/bcg-core/src:packages/bcg-diffusion/src${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
suites=()
for d in tests/core tests/diffusion; do [ -d "$d" ] && suites+=("$d"); done
exec python3 -m pytest -p no:cacheprovider "${suites[@]}" "$@"
