"""Build both wheels offline and install them into fresh virtual environments with no index.

The fresh environments must resolve ``torch`` and ``cuda-bindings`` without a network. Rather
than reinstalling torch (hundreds of MB) into every venv, each venv gets one ``.pth`` line that
points at a read-only "dependency site": a directory of links to everything installed in the
running environment *except* the bcg distributions. pip sees those distributions as installed and
resolves against them, while bcg-core / bcg-diffusion can only come from the freshly built wheels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = (REPO / "packages/bcg-core/src/bcg_core/_version.py").read_text().split('"')[1]

pytestmark = pytest.mark.packaging


def _sh(*cmd: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no index, no find-links, no constraints from the host
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    for dist in ("bcg-core", "bcg-diffusion"):
        r = _sh(
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "-w",
            out,
            REPO / "packages" / dist,
        )
        assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        f"bcg_core-{VERSION}-py3-none-any.whl",
        f"bcg_diffusion-{VERSION}-py3-none-any.whl",
    ]
    return out


@pytest.fixture(scope="module")
def dependency_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("depsite")
    purelib = Path(sysconfig.get_paths()["purelib"])
    for entry in purelib.iterdir():
        name = entry.name.lower()
        if name.startswith(("bcg_", "_bcg_", "bcg-", "_editable_impl_bcg")) or name.endswith(
            ".pth"
        ):
            continue
        (site / entry.name).symlink_to(entry)
    return site


def _fresh_venv(root: Path, dependency_site: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(root)
    python = root / "bin" / "python"
    # ensurepip's old setuptools would shadow the dependency site's (torch needs a newer one).
    r = _sh(python, "-m", "pip", "uninstall", "-y", "-q", "setuptools")
    assert r.returncode == 0, r.stderr
    purelib = _sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    Path(purelib.stdout.strip(), "deps.pth").write_text(f"{dependency_site}\n")
    return python


def _install(python: Path, wheels: Path, requirement: str) -> None:
    r = _sh(python, "-m", "pip", "install", "--no-index", "--find-links", wheels, requirement)
    assert r.returncode == 0, r.stdout + r.stderr


def test_core_alone(tmp_path: Path, wheels: Path, dependency_site: Path) -> None:
    python = _fresh_venv(tmp_path / "core", dependency_site)
    _install(python, wheels, "bcg-core")
    ok = _sh(python, "-c", "import bcg_core; print(bcg_core.__version__)", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == VERSION
    missing = _sh(python, "-c", "import bcg_diffusion", cwd=tmp_path)
    assert missing.returncode != 0
    assert "No module named 'bcg_diffusion'" in missing.stderr


def test_core_with_diffusion_extra(tmp_path: Path, wheels: Path, dependency_site: Path) -> None:
    python = _fresh_venv(tmp_path / "full", dependency_site)
    _install(python, wheels, "bcg-core[diffusion]")
    script = (
        "import bcg_core, bcg_diffusion\n"
        "for mod in (bcg_core, bcg_diffusion):\n"
        "    for name in mod.__all__:\n"
        "        getattr(mod, name)\n"
        "print(len(bcg_core.__all__), len(bcg_diffusion.__all__))\n"
    )
    r = _sh(python, "-c", script, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert all(int(n) > 0 for n in r.stdout.split())


def _metadata(wheel: Path) -> list[tuple[str, str]]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(zf.read(name).decode()).items()


def test_wheel_metadata(wheels: Path) -> None:
    core = _metadata(wheels / f"bcg_core-{VERSION}-py3-none-any.whl")
    assert ("Provides-Extra", "diffusion") in core
    requires = [v for k, v in core if k == "Requires-Dist"]
    assert f"bcg-diffusion=={VERSION}; extra == 'diffusion'" in requires
    assert any(r.startswith("torch>=") for r in requires)
    assert any(r.startswith("cuda-bindings") and "linux" in r for r in requires)
    assert not any(r.startswith("cuda-python") for r in requires)
    diffusion = _metadata(wheels / f"bcg_diffusion-{VERSION}-py3-none-any.whl")
    drequires = [v for k, v in diffusion if k == "Requires-Dist"]
    assert f"bcg-core=={VERSION}" in drequires
    runtime = [r for r in drequires if "extra ==" not in r]
    assert sorted(r.split(">")[0].split("=")[0] for r in runtime) == ["bcg-core", "torch"]
    assert "diffusers>=0.42; extra == 'diffusers'" in drequires
    assert "transformers>=5; extra == 'transformers'" in requires


def test_wheels_ship_py_typed(wheels: Path) -> None:
    for wheel, pkg in (
        (f"bcg_core-{VERSION}", "bcg_core"),
        (f"bcg_diffusion-{VERSION}", "bcg_diffusion"),
    ):
        with zipfile.ZipFile(wheels / f"{wheel}-py3-none-any.whl") as zf:
            assert f"{pkg}/py.typed" in zf.namelist()
