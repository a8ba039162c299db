"""The boundary check passes on the real tree and fails, naming the import, when violated."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "tools" / "check_boundaries.py"


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), "--root", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copytree(
        REPO / "packages",
        root / "packages",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )
    return root


def _plant(root: Path, package: str, module: str, text: str) -> None:
    dist = package.replace("_", "-")
    (root / "packages" / dist / "src" / package / module).write_text(text)


def test_clean_tree_passes() -> None:
    result = _check(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "boundary check: passed" in result.stdout


def test_core_importing_diffusion_at_top_level_fails(tree: Path) -> None:
    _plant(tree, "bcg_core", "planted.py", "import bcg_diffusion\n")
    result = _check(tree)
    assert result.returncode == 1
    assert "bcg_core.planted -> bcg_diffusion" in result.stdout


def test_core_importing_diffusion_lazily_fails(tree: Path) -> None:
    _plant(
        tree,
        "bcg_core",
        "planted.py",
        "def helper() -> None:\n    from bcg_diffusion import __version__  # noqa: F401\n",
    )
    result = _check(tree)
    assert result.returncode == 1
    assert "bcg_core.planted -> bcg_diffusion" in result.stdout


def test_diffusion_importing_core_submodule_fails(tree: Path) -> None:
    _plant(tree, "bcg_diffusion", "planted.py", "from bcg_core import _version  # noqa: F401\n")
    result = _check(tree)
    assert result.returncode == 1
    assert "bcg_diffusion.planted -> bcg_core._version" in result.stdout


def test_diffusion_importing_core_private_name_fails(tree: Path) -> None:
    # A private *name* re-exported by the top-level package: import-linter sees only
    # `bcg_core`, so ruff's PLC2701 must catch it.
    init = tree / "packages" / "bcg-core" / "src" / "bcg_core" / "__init__.py"
    init.write_text(init.read_text() + "\n_secret = 1\n")
    _plant(tree, "bcg_diffusion", "planted.py", "from bcg_core import _secret  # noqa: F401\n")
    result = _check(tree)
    assert result.returncode == 1
    assert "PLC2701" in result.stdout
    assert "planted.py" in result.stdout
    assert "_secret" in result.stdout


def test_diffusion_importing_core_bench_passes(tree: Path) -> None:
    # bcg_core.bench is the public door for workload plugins.
    _plant(
        tree, "bcg_diffusion", "planted.py", "from bcg_core.bench import Contender  # noqa: F401\n"
    )
    result = _check(tree)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("statement", "target"),
    [
        ("from bcg_core.bench import _harness", "bcg_core.bench._harness"),
        ("import bcg_core._backends.cuda", "bcg_core._backends.cuda"),
    ],
)
def test_diffusion_importing_core_internals_fails(tree: Path, statement: str, target: str) -> None:
    _plant(tree, "bcg_diffusion", "planted.py", f"{statement}  # noqa: F401\n")
    result = _check(tree)
    assert result.returncode == 1
    assert f"bcg_diffusion.planted -> {target}" in result.stdout
