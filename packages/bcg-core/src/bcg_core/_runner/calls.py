"""The calls ``capture_many`` takes: checked, ordered by size, named for the progress bar."""

from __future__ import annotations

from typing import Any

from bcg_core import _trees

Call = tuple[tuple[Any, ...], dict[str, Any]]


CALLS_EXAMPLE = "(args, kwargs) pairs, e.g. [((x,), {}), ((y,), {'t': t})]"


def check_call(index: int, call: Any) -> Call:
    """``call`` if it is an ``(args, kwargs)`` pair, else a TypeError naming item ``index``."""
    if (
        not isinstance(call, tuple)
        or len(call) != 2
        or not isinstance(call[0], tuple)
        or not isinstance(call[1], dict)
    ):
        raise TypeError(f"capture_many takes {CALLS_EXAMPLE}; item {index} is {_describe(call)}")
    return call


def _describe(item: Any) -> str:
    """What a malformed ``capture_many`` item is: a tuple by its items' types (an args tuple
    without its kwargs is a tuple too, so its type alone names nothing wrong)."""
    if not isinstance(item, tuple):
        return type(item).__name__
    types = ", ".join(type(x).__name__ for x in item[:4]) + (", ..." if len(item) > 4 else "")
    return f"a tuple of {len(item)} item{'' if len(item) == 1 else 's'} ({types})"


def call_shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The first tensor shapes of a call, for the progress bar."""
    shapes = [tuple(t.shape) for t in _trees.tensor_leaves((args, kwargs))[:2]]
    return " ".join(str(list(s)) for s in shapes)


def call_bytes(call: Call) -> int:
    """The bytes of a call's tensors (``largest_first`` captures the biggest call first)."""
    return sum(t.numel() * t.element_size() for t in _trees.tensor_leaves(call))
