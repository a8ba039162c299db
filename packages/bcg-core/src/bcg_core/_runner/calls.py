"""The calls ``capture_many`` takes: checked, ordered by size, named for the progress bar."""

from __future__ import annotations

from typing import Any

from bcg_core import _trees

Call = tuple[tuple[Any, ...], dict[str, Any]]


def check_call(index: int, call: Any) -> Call:
    """``call`` if it is an ``(args, kwargs)`` pair, else a TypeError naming item ``index``."""
    if (
        not isinstance(call, tuple)
        or len(call) != 2
        or not isinstance(call[0], tuple)
        or not isinstance(call[1], dict)
    ):
        raise TypeError(
            f"capture_many takes (args, kwargs) pairs, e.g. [((x,), {{}}), ((y,), {{'t': t}})]; "
            f"item {index} is {type(call).__name__}"
        )
    return call


def call_shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The first tensor shapes of a call, for the progress bar."""
    shapes = [tuple(t.shape) for t in _trees.tensor_leaves((args, kwargs))[:2]]
    return " ".join(str(list(s)) for s in shapes)


def call_bytes(call: Call) -> int:
    """The bytes of a call's tensors (``largest_first`` captures the biggest call first)."""
    return sum(t.numel() * t.element_size() for t in _trees.tensor_leaves(call))
