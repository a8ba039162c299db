"""The backend seam holds: runtime modules outside ``_backends/`` (and the bench, which names the
devices it measures) never compare against the device-type strings "cuda" or "cpu"; what differs
between backends is a property or method of the backend."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import bcg_core

DEVICE_TYPES = {"cuda", "cpu"}
SRC = Path(bcg_core.__file__).parent
EXEMPT = {"_backends", "bench"}


def _strings(node: ast.AST) -> set[str]:
    """The string constants in a comparison operand (a constant, or a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {s for elt in node.elts for s in _strings(elt)}
    return set()


def _device_type_comparisons(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            hits = set().union(*(_strings(o) for o in operands)) & DEVICE_TYPES
            if hits:
                found.append(f"{name}:{node.lineno} compares with {sorted(hits)}")
        elif isinstance(node, ast.MatchValue) and _strings(node.value) & DEVICE_TYPES:
            found.append(f"{name}:{node.lineno} matches a device type")
    return found


def test_runtime_modules_do_not_branch_on_device_type_strings() -> None:
    modules = [p for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] not in EXEMPT]
    assert len(modules) > 20  # the walk really sees the runtime
    found = [
        hit
        for path in sorted(modules)
        for hit in _device_type_comparisons(path.read_text(), str(path.relative_to(SRC)))
    ]
    assert found == [], "device-type branches outside _backends/:\n" + "\n".join(found)


def test_the_walk_catches_a_device_type_branch() -> None:
    source = 'def f(t):\n    return t.device.type == "cuda" or t in ("cpu",)\n'
    assert len(_device_type_comparisons(source, "planted.py")) == 2


def test_importing_bcg_core_does_not_import_dynamo() -> None:
    # torch._dynamo costs about 1.4 s to import; bcg only needs it once something compiles
    # (a module-level torch._dynamo.disable in opaque.py once made every import pay for it).
    code = "import sys, bcg_core; print('torch._dynamo' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert done.stdout.strip() == "False"
