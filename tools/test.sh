#!/usr/bin/env bash
# The test command (README.md, .ci/run): from a fresh machine to the full check in one step.
# Installs hatch into .cache/tools, lets hatch build the dev environment (both packages editable
# plus the dev tools, see hatch.toml), then runs lint, types, the import boundary, pytest, and
# the CLI on CPU (`bcg demo`, `bcg bench --smoke`).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/_hatch.sh
exec "$HATCH" run dev:ci
