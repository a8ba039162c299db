#!/usr/bin/env bash
# The test command (README.md, .ci/run): from a fresh machine to the full check in one step.
# Installs hatch into .cache/tools, lets hatch build the dev environment (both packages editable
# plus the dev tools, see hatch.toml), then runs lint, types, the import boundary and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
HATCH_VERSION=1.18.2
if [ ! -x .cache/tools/bin/hatch ]; then
  python3 -m venv .cache/tools
  .cache/tools/bin/python -m pip install -q "hatch==${HATCH_VERSION}"
fi
exec .cache/tools/bin/hatch run dev:ci
