"""Bump bcg-core and bcg-diffusion together: ``python tools/bump_version.py 0.2.0``.

``--check`` exits 1 when the four places that carry the version disagree.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLACES = {
    REPO / "packages/bcg-core/src/bcg_core/_version.py": r'(__version__ = ")([^"]+)(")',
    REPO / "packages/bcg-diffusion/src/bcg_diffusion/_version.py": r'(__version__ = ")([^"]+)(")',
    REPO / "packages/bcg-core/pyproject.toml": r'("bcg-diffusion==)([^"]+)(")',
    REPO / "packages/bcg-diffusion/pyproject.toml": r'("bcg-core==)([^"]+)(")',
}


def current() -> dict[Path, str]:
    found = {}
    for path, pattern in PLACES.items():
        match = re.search(pattern, path.read_text())
        if match is None:
            raise SystemExit(f"{path}: no version matching {pattern!r}")
        found[path] = match.group(2)
    return found


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        versions = current()
        if len(set(versions.values())) != 1:
            for path, version in versions.items():
                print(f"{path.relative_to(REPO)}: {version}")
            print("versions disagree: run tools/bump_version.py NEW_VERSION")
            return 1
        return 0
    if len(argv) != 1 or not re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc)?\d*", argv[0]):
        print("usage: tools/bump_version.py NEW_VERSION | --check")
        return 2
    for path, pattern in PLACES.items():
        path.write_text(re.sub(pattern, rf"\g<1>{argv[0]}\g<3>", path.read_text(), count=1))
    print(f"bumped to {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
