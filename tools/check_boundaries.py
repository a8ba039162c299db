"""Check the import boundary between bcg_core and bcg_diffusion.

Two tools, each doing what it is built for:

* import-linter (contracts in the root pyproject.toml): core never imports diffusion, diffusion
  imports only the top-level ``bcg_core`` package, underscore modules stay inside their parent.
* ruff PLC2701: name-level private imports such as ``from bcg_core import _x``.

Usage: ``python tools/check_boundaries.py [--root DIR]``. DIR defaults to this repository; the
sources under DIR/packages/*/src are put first on the path, so a copied tree is checked as it is,
not the installed packages. Prints every broken rule with the offending import; exits 1 if any.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def _run(cmd: list[str], root: Path, env: dict[str, str]) -> int:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=root, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args(argv)
    root: Path = args.root.resolve()
    src_dirs = sorted(str(p) for p in (root / "packages").glob("*/src"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*src_dirs, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    bindir = Path(sys.executable).parent
    lint_imports = [str(bindir / "lint-imports"), str(root / "pyproject.toml")]
    ruff = [
        sys.executable,
        "-m",
        "ruff",
        "check",
        "--no-cache",
        "--preview",
        "--select",
        "PLC2701",
        "--config",
        str(root / "pyproject.toml"),
        str(root / "packages"),
    ]
    failures = 0
    if _run([*lint_imports, "--no-cache"], root, env) != 0:
        print("boundary check: import-linter contract broken (see above)", flush=True)
        failures += 1
    if _run(ruff, root, env) != 0:
        print("boundary check: private name imported across packages (ruff PLC2701)", flush=True)
        failures += 1
    print("boundary check:", "FAILED" if failures else "passed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
