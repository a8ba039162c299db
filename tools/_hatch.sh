# Sourced by tools/test.sh and tools/demo.sh: installs hatch into .cache/tools once and sets
# $HATCH. (Kept in one place so the two entry points cannot drift apart.)
HATCH_VERSION=1.18.2
if [ ! -x .cache/tools/bin/hatch ]; then
  python3 -m venv .cache/tools
  .cache/tools/bin/python -m pip install -q "hatch==${HATCH_VERSION}"
fi
HATCH=.cache/tools/bin/hatch
