"""Break points: the decorator that marks eager functions, and the explicit split."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar, overload

import torch

from bcg_core._context import active_capture

F = TypeVar("F", bound=Callable[..., Any])

# -- the break observer of the divergence check (_divergence.py) -------------------------------
BreakObserver = Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
_OBSERVER: ContextVar[BreakObserver | None] = ContextVar("bcg_break_observer", default=None)
_observer_lock = threading.Lock()
_observing = 0  # observe_breaks() blocks open in any context; the eager path reads only this


@contextlib.contextmanager
def observe_breaks(observer: BreakObserver | None) -> Iterator[None]:
    """In this block (this context only), an enabled break called outside a capture is handed
    to ``observer(name, fn, args, kwargs)``, which must call ``fn`` and return its result;
    ``None`` calls through (for breaks nested in an observed one). Refcounted, so a break
    costs one global read when no block is open anywhere."""
    global _observing
    with _observer_lock:
        _observing += 1
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)
        with _observer_lock:
            _observing -= 1


@overload
def eager_on_graph(fn: F, /) -> F: ...


@overload
def eager_on_graph(
    fn: None = None,
    /,
    *,
    enable: bool = True,
    capture_stub: Callable[..., Any] | None = None,
    strict: bool = False,
    name: str | None = None,
) -> Callable[[F], F]: ...


def eager_on_graph(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    enable: bool = True,
    capture_stub: Callable[..., Any] | None = None,
    strict: bool = False,
    name: str | None = None,
) -> Any:
    """Mark a function (or method) as a break point of breakable CUDA graphs.

    During a breakable capture a call ends the current graph segment, runs eagerly (the
    ``capture_stub`` instead, if given, with the same arguments), and the next segment starts.
    At every replay the real function runs again on the tensors it saw at capture (held as
    non-owning aliases: the caller keeps static inputs alive) and its returned tensors are copied
    into the ones returned at capture, which the next segment reads. Return values must keep the
    same structure, shapes and dtypes; non-tensor values are frozen at capture. With
    ``strict=True`` returning a CUDA tensor fails at capture: write into an argument buffer.

    Outside a capture, inside another break, under ``torch.compile`` tracing, or with
    ``enable=False`` the function is simply called. Usable bare (``@eager_on_graph``) or
    configured (``@eager_on_graph(strict=True)``); the wrapper keeps name and docstring.
    """
    if capture_stub is not None and not callable(capture_stub):
        raise TypeError(f"capture_stub must be callable, got {capture_stub!r}")

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise TypeError(f"@eager_on_graph decorates a callable, got {f!r}")
        break_name: str = name or getattr(f, "__qualname__", None) or repr(f)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            state = active_capture()
            if state is None:
                if _observing and enable and not torch.compiler.is_compiling():
                    observe = _OBSERVER.get()
                    if observe is not None:
                        return observe(break_name, f, args, kwargs)
                return f(*args, **kwargs)
            if state.in_break or not enable or torch.compiler.is_compiling():
                return f(*args, **kwargs)
            return state.record_break(f, capture_stub, strict, break_name, args, kwargs)

        return wrapper

    return decorate if fn is None else decorate(fn)


def break_graph() -> None:
    """Split the current graph segment here, with no eager work; a no-op outside a capture."""
    state = active_capture()
    if state is not None and not torch.compiler.is_compiling():
        state.split()
