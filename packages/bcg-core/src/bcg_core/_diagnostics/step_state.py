"""State a step keeps in itself, for the divergence check: what one eager run changes there.

A graph replays what it recorded, so a step that advances its own Python state (a module's
``self.step += 1``, a private ``torch.Generator``) gives a replay that never advances it, and two
eager runs of the same inputs that differ. Comparing values alone would call that "not
reproducible" or blame a segment; naming the attribute says what to fix.

Watched: the modules the step calls in this thread (a global forward pre-hook, installed only
while one eager run is watched, then removed), the module ``fn`` is or is bound to, and
generators in ``fn``'s closure. Per module, its own instance attributes that are plain Python
values (numbers, strings, tuples and lists of them) or generators; parameters, buffers,
submodules, tensors and torch's bookkeeping are not state a graph freezes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

_PLAIN = (int, float, bool, str, bytes, type(None))
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


@dataclass(frozen=True)
class StateChange:
    """One piece of state the step changed: ``where`` names it (``Counter.step``), ``kind``
    says what it is, ``before``/``after`` its values around one eager run, in words."""

    where: str
    kind: Literal["attribute", "generator"]
    before: str
    after: str


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value)


def _snapshot(obj: Any, items: Iterator[tuple[str, Any]]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, value in items:
        if isinstance(value, torch.Generator):
            state[name] = value.get_state()
        elif _plain(value):
            state[name] = tuple(value) if isinstance(value, list) else value
    return state


def _module_items(module: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    for name, value in vars(module).items():
        if name not in _MODULE_INTERNALS:
            yield name, value


class StepStateWatch:
    """Watch one eager run of ``fn`` (:meth:`watching`), then list what it changed."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        # id -> (object kept alive so the id stays its own, label, state before the run)
        self._seen: dict[int, tuple[Any, str, dict[str, Any]]] = {}
        self._closure: dict[str, Any] = {}

    def _see(self, module: torch.nn.Module) -> None:
        if id(module) not in self._seen:
            label = type(module).__name__
            self._seen[id(module)] = (module, label, _snapshot(module, _module_items(module)))

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        owner = self._fn if isinstance(self._fn, torch.nn.Module) else None
        bound = getattr(self._fn, "__self__", None)
        for module in (owner, bound):
            if isinstance(module, torch.nn.Module):
                self._see(module)
        self._closure = _snapshot(self._fn, self._closure_items())

        # The hook is process-wide: modules other threads call are not the step's.
        thread = threading.get_ident()

        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            if threading.get_ident() == thread:
                self._see(module)

        handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
        try:
            yield
        finally:
            handle.remove()

    def _closure_items(self) -> Iterator[tuple[str, Any]]:
        code = getattr(self._fn, "__code__", None)
        cells = getattr(self._fn, "__closure__", None) or ()
        names = code.co_freevars if code is not None else ()
        for name, cell in zip(names, cells, strict=False):
            with contextlib.suppress(ValueError):  # an empty cell
                value = cell.cell_contents
                if isinstance(value, torch.Generator):
                    yield name, value

    def changes(self) -> list[StateChange]:
        """What the watched run changed, in the order the modules were first called."""
        found: list[StateChange] = []
        for module, label, before in self._seen.values():
            after = _snapshot(module, _module_items(module))
            found += _changed(label, before, after)
        after = _snapshot(self._fn, self._closure_items())
        name = getattr(self._fn, "__qualname__", "fn")
        found += _changed(f"{name} (closure)", self._closure, after)
        return found


def _changed(label: str, before: dict[str, Any], after: dict[str, Any]) -> list[StateChange]:
    found = []
    for name, old in before.items():
        new = after.get(name)
        if isinstance(old, torch.Tensor):  # a generator's state
            if not (isinstance(new, torch.Tensor) and torch.equal(old, new)):
                found.append(StateChange(f"{label}.{name}", "generator", "", ""))
        elif name in after and new is not old and new != old and not _both_nan(old, new):
            found.append(StateChange(f"{label}.{name}", "attribute", repr(old), repr(new)))
    return found


def _both_nan(old: Any, new: Any) -> bool:
    # float("nan") != itself: a NaN attribute the step leaves alone is no change.
    return isinstance(old, float) and isinstance(new, float) and old != old and new != new
