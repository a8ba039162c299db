"""Every public class and function documents itself in the Google style torch uses: a one-line
summary, every parameter under ``Args:`` (dataclass fields may be ``Attributes:`` instead),
``Returns:``/``Yields:`` for a function that returns something, and ``Raises:`` entries that name
real exception classes. Public means the ``__all__`` of ``bcg_core``, ``bcg_core.bench`` and
``bcg_diffusion``, and the public methods (and ``__call__``) those classes define."""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

PACKAGES = ("bcg_core", "bcg_core.bench", "bcg_diffusion")
SECTIONS = ("Args", "Attributes", "Returns", "Yields", "Raises", "Example", "Examples", "Note")
_HEADER = re.compile(rf"^({'|'.join(SECTIONS)}):\s*$")
_ENTRY = re.compile(r"^    (\*{0,2})(\w+)(?: \([^)]*\))?:")


def _public() -> Iterator[tuple[str, Any, bool]]:
    """``(qualified name, object, is a property)`` for every class and function in the three
    ``__all__`` lists, and for the public methods and properties (their getters) those classes
    define."""
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue  # constants (__version__, EAGER, BCG_FAILURE_HINT ...)
            yield f"{package}.{name}", obj, False
            if inspect.isclass(obj):
                yield from _methods(f"{package}.{name}", obj)


def _methods(owner: str, cls: type) -> Iterator[tuple[str, Any, bool]]:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for name, attr in vars(cls).items():
        if (name.startswith("_") and name != "__call__") or name in fields:
            continue
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        is_property = isinstance(attr, property)
        if is_property:
            attr = attr.fget
        if inspect.isfunction(attr):
            yield f"{owner}.{name}", attr, is_property


_WALKED = list(_public())
PUBLIC = {name: obj for name, obj, _ in _WALKED}
PROPERTIES = {name for name, _, is_property in _WALKED if is_property}  # no Returns: needed


def _sections(doc: str) -> dict[str, list[str]]:
    """The docstring's sections by header, each as its indented lines; ``""`` holds the text
    before the first header."""
    sections: dict[str, list[str]] = {"": []}
    current = ""
    for line in doc.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            sections[current] = []
        else:
            sections[current].append(line)
    return sections


def _entries(lines: list[str]) -> list[str]:
    """The names an ``Args:``/``Raises:`` section documents (stars stripped)."""
    return [m.group(2) for line in lines if (m := _ENTRY.match(line))]


def _parameters(obj: Any) -> list[str]:
    """The parameter names a caller passes (no ``self``/``cls``); none for a type whose
    signature Python cannot tell (the exception classes take a message)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    names = list(signature.parameters)
    is_method = not inspect.isclass(obj) and "." in obj.__qualname__
    if is_method and names and names[0] in ("self", "cls"):
        names = names[1:]
    return names


def _resolves(name: str, obj: Any) -> bool:
    """Whether ``name`` is an exception class in scope where ``obj`` is defined (or builtin)."""
    scopes = [vars(builtins), vars(sys.modules[obj.__module__])]
    scopes += [vars(importlib.import_module(p)) for p in PACKAGES]
    found = next((s[name] for s in scopes if name in s), None)
    return isinstance(found, type) and issubclass(found, BaseException)


def problems(name: str, obj: Any) -> list[str]:
    """What the docstring of ``obj`` lacks, in words; empty when it is complete."""
    raw = obj.__doc__  # not inspect.getdoc: that falls back to a base class's docstring
    if not raw or not raw.strip():
        return [f"{name}: no docstring"]
    doc = inspect.cleandoc(raw)
    lines = doc.splitlines()
    found = []
    if len(lines) > 1 and lines[1].strip():
        found.append(f"{name}: the summary is not one line (add a blank line after it)")
    sections = _sections(doc)
    params = _parameters(obj)
    documented = _entries(sections.get("Args", []))
    if dataclasses.is_dataclass(obj):
        documented += _entries(sections.get("Attributes", []))
    missing = [p for p in params if p not in documented]
    if missing:
        found.append(f"{name}: parameters not under Args: {missing}")
    stale = [d for d in documented if d not in params]
    if stale:
        found.append(f"{name}: Args names what is no parameter: {stale}")
    returns = inspect.signature(obj).return_annotation if inspect.isfunction(obj) else "None"
    returns_something = returns not in ("None", None, inspect.Signature.empty)
    if returns_something and name not in PROPERTIES and not {"Returns", "Yields"} & set(sections):
        found.append(f"{name}: returns {returns} but has no Returns:/Yields: section")
    unknown = [e for e in _entries(sections.get("Raises", [])) if not _resolves(e, obj)]
    if unknown:
        found.append(f"{name}: Raises: names no exception class in scope: {unknown}")
    return found


def test_the_walk_sees_the_public_surface() -> None:
    import bcg_core

    assert "bcg_core.BreakableGraphRunner.capture_many" in PUBLIC
    assert "bcg_core.BreakableGraphRunner.__call__" in PUBLIC
    assert "bcg_core.enable_breakable_cuda_graph" in PUBLIC  # a contextlib context manager
    assert "bcg_diffusion.replay_token_scope" in PUBLIC
    assert "bcg_core.bench.BenchContext.compare" in PUBLIC
    assert "bcg_core.bench.BenchContext.progress" not in PUBLIC  # a field, not a method
    assert "bcg_core.__version__" not in PUBLIC
    callables = [n for n in bcg_core.__all__ if callable(getattr(bcg_core, n))]
    assert len([n for n in PUBLIC if n.count(".") == 1 and n.startswith("bcg_core.")]) == len(
        callables
    )


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_docstring_is_complete(name: str) -> None:
    assert problems(name, PUBLIC[name]) == []


def _planted(size: int, *args: Any, scale: float = 1.0, **kwargs: Any) -> int:
    """Two lines of
    summary.

    Args:
        size: documented.
        *args: documented.
        shape: not a parameter.

    Raises:
        NoSuchError: never.
    """
    return size


def test_the_check_catches_what_is_missing() -> None:
    found = problems("planted", _planted)
    assert any("summary is not one line" in p for p in found), found
    assert any("['scale', 'kwargs']" in p for p in found), found
    assert any("['shape']" in p for p in found), found
    assert any("no Returns:" in p for p in found), found
    assert any("['NoSuchError']" in p for p in found), found
    assert len(found) == 5


def _complete(size: int, **kwargs: Any) -> Callable[[], int]:
    """A complete docstring.

    Args:
        size (int): documented, with a type.
        **kwargs: documented.

    Returns:
        A callable.

    Raises:
        ValueError: when it is.
    """
    return lambda: size


def test_the_check_passes_a_complete_docstring() -> None:
    assert problems("complete", _complete) == []
