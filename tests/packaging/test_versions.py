"""Versions move in lockstep: one bump script, and this check that fails when they disagree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _version(path: str) -> str:
    match = re.search(r'__version__ = "([^"]+)"', (REPO / path).read_text())
    assert match, path
    return match.group(1)


def test_versions_agree() -> None:
    core = _version("packages/bcg-core/src/bcg_core/_version.py")
    diffusion = _version("packages/bcg-diffusion/src/bcg_diffusion/_version.py")
    assert core == diffusion
    core_toml = (REPO / "packages/bcg-core/pyproject.toml").read_text()
    diffusion_toml = (REPO / "packages/bcg-diffusion/pyproject.toml").read_text()
    assert f'"bcg-diffusion=={core}"' in core_toml
    assert f'"bcg-core=={core}"' in diffusion_toml


def test_bump_script_check_mode_agrees() -> None:
    r = subprocess.run(
        [sys.executable, str(REPO / "tools/bump_version.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
