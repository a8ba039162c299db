#!/usr/bin/env bash
# Build both wheels (plus the peer package that `bcg bench` compares against, and diffusers,
# which the device machine lacks: pure Python; its dependencies huggingface_hub, safetensors,
# regex, requests, filelock, numpy and Pillow are there already, and importlib_metadata is
# only imported on Python < 3.8) into .whl/, for carrying to a GPU machine that has no
# hatchling and no network. Run here, in the dev env.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
rm -rf .whl && mkdir .whl
PY=.hatch/dev/bin/python
"$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w .whl packages/bcg-core packages/bcg-diffusion
"$PY" -m pip download -q --no-deps -d .whl "breakable-cuda-graphs>=0.1" "diffusers==0.42.1"
ls .whl
