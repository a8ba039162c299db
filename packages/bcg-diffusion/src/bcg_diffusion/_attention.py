"""The breakable attention adapter: DiT attention modules become eager break points.

While :func:`bcg_core.is_in_breakable_cuda_graph` is true, an adapted ``forward`` runs as one
``@eager_on_graph`` break: at capture it ends the graph segment and runs eagerly, at every replay
it runs again on the capture-time inputs and its output is copied into the capture-time output.
Otherwise it is the original forward, untouched. Whatever structure the forward returns (a
tensor, a ``(out, lse)`` tuple, a NamedTuple, a dataclass) reaches the caller with its type: the
bridge is the capture-time output itself, refreshed in place at every replay.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from bcg_core import eager_on_graph, is_in_breakable_cuda_graph

_ORIGINAL = "__bcg_original_forward__"


def make_breakable_attention_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an attention ``forward(self, *args, **kwargs)`` so it is a break point while the
    breakable-graph flag is set, and a transparent pass-through otherwise."""
    if getattr(forward, _ORIGINAL, None) is not None:
        return forward  # already adapted

    name = f"{getattr(forward, '__qualname__', 'attention')}"

    attention_break = eager_on_graph(name=name)(forward)

    @functools.wraps(forward)
    def adapted(*args: Any, **kwargs: Any) -> Any:
        if not is_in_breakable_cuda_graph():
            return forward(*args, **kwargs)
        return attention_break(*args, **kwargs)

    setattr(adapted, _ORIGINAL, forward)
    return adapted


class AttentionPatch:
    """Handle returned by :func:`install_breakable_attention`; :meth:`remove` undoes it (also on
    leaving a ``with`` block). Removing twice is harmless."""

    def __init__(self, classes: tuple[type, ...]) -> None:
        self.classes = classes

    def remove(self) -> None:
        uninstall_breakable_attention(*self.classes)

    def __enter__(self) -> AttentionPatch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()


_lock = threading.Lock()
# class -> the forward it defined itself before patching (None: it inherited forward).
_patched: dict[type, Callable[..., Any] | None] = {}


def install_breakable_attention(*classes: type) -> AttentionPatch:
    """Adapt ``forward`` of each attention class in place. Installing twice changes nothing."""
    for cls in classes:
        if not isinstance(cls, type) or not callable(getattr(cls, "forward", None)):
            raise TypeError(
                f"install_breakable_attention takes classes with a forward, got {cls!r}"
            )
    with _lock:
        for cls in classes:
            if cls in _patched:
                continue
            own = cls.__dict__.get("forward")
            _patched[cls] = own
            cls.forward = make_breakable_attention_forward(cls.forward)  # type: ignore[attr-defined]
    return AttentionPatch(classes)


def uninstall_breakable_attention(*classes: type) -> None:
    """Restore the original ``forward`` of each class patched by this module."""
    with _lock:
        for cls in classes:
            if cls not in _patched:
                continue
            own = _patched.pop(cls)
            if own is None:
                delattr(cls, "forward")
            else:
                cls.forward = own  # type: ignore[attr-defined]


def is_breakable_attention_installed(cls: type) -> bool:
    """Whether ``cls.forward`` is currently adapted by this module."""
    with _lock:
        return cls in _patched
