"""The runtime flag that model code reads to route its uncapturable calls through break points,
and the switch that turns breakable graphs off.

The flag is a context variable: it is per thread and per asyncio task, and nesting restores the
previous value.

Breakable graphs are *disabled* when ``BCG_DISABLE`` is set to a true value in the environment
(the whole process, no code change) or inside :func:`disable_breakable_graphs` (this context).
Disabled, :func:`enable_breakable_cuda_graph` leaves the flag off (model code takes its eager
path), ``BreakableGraphRunner`` runs every call eagerly, and ``BreakableCUDAGraphCapture``
refuses to start (a capture without breaks would freeze the eager code inside one graph).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from typing import Any, TypeVar

from bcg_core._context_reset import context_key, reset_var
from bcg_core._env import EnvFlag, env_word
from bcg_core._errors import BCG_FAILURE_HINT

logger = logging.getLogger("bcg_core")

_ENABLED: ContextVar[bool] = ContextVar("bcg_core_enabled", default=False)
_DISABLED: ContextVar[bool] = ContextVar("bcg_core_disabled", default=False)
_BCG_DISABLE = EnvFlag("BCG_DISABLE")
_F = TypeVar("_F", bound=Callable[..., Any])
_open_lock = threading.Lock()  # FlagBlock._open's exits, left on any thread


def bcg_disabled_by_env() -> bool:
    """True when ``BCG_DISABLE`` is set to a true value (1, true, yes, on)."""
    return _BCG_DISABLE()


def breakable_graphs_disabled() -> bool:
    """Whether breakable graphs are off in this context.

    Code that captures by hand should run eagerly when this is true: a capture would raise
    :class:`CaptureError`, and :func:`enable_breakable_cuda_graph` leaves the flag off.

    Returns:
        True when ``BCG_DISABLE`` is set to a true value (1, true, yes, on) or the caller is
        inside :func:`disable_breakable_graphs`; else False.
    """
    # The flag itself, not bcg_disabled_by_env(): this runs before every runner call.
    return _DISABLED.get() or _BCG_DISABLE()


def disabled_reason() -> str:
    """Why :func:`breakable_graphs_disabled` is true, in words (for log lines and errors)."""
    if bcg_disabled_by_env():
        return f"BCG_DISABLE={env_word('BCG_DISABLE')} is set"
    return "the call is inside disable_breakable_graphs()"


class FlagBlock(contextlib.ContextDecorator):
    """A block of :func:`disable_breakable_graphs` or :func:`enable_breakable_cuda_graph`: a
    ``with`` block, or a decorator. ``contextlib``'s decorator wraps the call, and calling an
    ``async def`` function only makes its coroutine: its body ran later, when awaited, outside
    the block (``@disable_breakable_graphs()`` over a request handler disabled nothing). Over
    an ``async def`` the block covers each await of its coroutine; over a generator or async
    generator function, whose body runs as it is iterated, it raises ``TypeError``."""

    def __init__(self, block: Callable[[], AbstractContextManager[None]], name: str) -> None:
        self._block = block
        self._name = name
        # Open blocks with the thread and task that entered them: one block object entered in
        # two threads at once (a module-level ``NO_BCG = disable_breakable_graphs()``) exited
        # the other thread's block, whose reset cannot reach that thread, and both threads
        # were left with the flag set.
        self._open: list[tuple[tuple[int, object], AbstractContextManager[None]]] = []

    def _recreate_cm(self) -> FlagBlock:
        return FlagBlock(self._block, self._name)

    def __enter__(self) -> None:
        block = self._block()
        block.__enter__()
        # (No lock: an append moves no entry an exit's scan found.)
        self._open.append((context_key(), block))

    def __exit__(self, *exc_info: Any) -> bool | None:
        key = context_key()
        with _open_lock:
            # The last block entered here, found from the end (usually the last one): a scan
            # of the whole list made every block's enter and exit cost twice what it did.
            blocks = self._open
            i = len(blocks) - 1
            while i >= 0 and blocks[i][0] != key:
                i -= 1
            if not blocks:  # (the raw error was IndexError: pop from empty list)
                raise RuntimeError(
                    f"a {self._name}() block was exited more times than it was entered; use "
                    "it as a `with` block or a decorator"
                )
            # None entered here: left in another context (a generator's finaliser), the last.
            _, block = blocks.pop(i if i >= 0 else -1)
        return block.__exit__(*exc_info)

    def __call__(self, func: _F) -> _F:
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"@{self._name}() cannot decorate the generator function {func.__qualname__}: "
                "its body runs as it is iterated, outside the block; put the with block inside "
                "its body"
            )
        if not inspect.iscoroutinefunction(func):
            return super().__call__(func)

        @functools.wraps(func)
        async def run(*args: Any, **kwargs: Any) -> Any:
            with self._recreate_cm():
                return await func(*args, **kwargs)

        return run  # type: ignore[return-value]


@contextlib.contextmanager
def _disabled_block() -> Iterator[None]:
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        reset_var(token)  # left in another context (a generator's finaliser): see reset_var


def disable_breakable_graphs() -> FlagBlock:
    """Context manager that turns breakable graphs off for the enclosed block.

    It does for this thread or asyncio task what ``BCG_DISABLE=1`` does for the whole process:
    the flag stays off (model code takes its eager path), runners run every call eagerly, and
    captures refuse to start (:class:`CaptureError`). Nesting restores the previous state on
    exit, also when the block raises. As a decorator it covers the function's body, also an
    ``async def`` one's (a generator function is refused with ``TypeError``).

    Returns:
        The block, to enter with ``with`` or to decorate a function with.
    """
    return FlagBlock(_disabled_block, "disable_breakable_graphs")


def is_in_breakable_cuda_graph() -> bool:
    """Whether model code should route through break points (set by the context manager).

    This is a routing decision for model code, not a capture query: it is true for the whole
    ``with enable_breakable_cuda_graph():`` block, at capture and at replay. Use
    :func:`is_breakable_capture_active` to ask whether a capture is running right now.

    Returns:
        The flag in this context: True inside ``enable_breakable_cuda_graph()`` (unless
        breakable graphs are disabled there), False outside it and by default.
    """
    return _ENABLED.get()


def enable_breakable_cuda_graph(enabled: bool = True) -> FlagBlock:
    """Context manager that sets the runtime flag for the enclosed block.

    The flag (read with :func:`is_in_breakable_cuda_graph`) is a context variable: per thread
    and per asyncio task, and the previous value is restored on exit. Disabled breakable graphs
    (``BCG_DISABLE=1``, :func:`disable_breakable_graphs`) force the flag off. If the block
    raises, :data:`BCG_FAILURE_HINT` is logged at error level on logger ``bcg_core`` and the
    exception is re-raised unchanged. As a decorator it covers the function's body, also an
    ``async def`` one's (a generator function is refused with ``TypeError``).

    Args:
        enabled: the value to set (default True); False routes model code to its eager path
            for the block, for example to rule bcg out.

    Returns:
        The block, to enter with ``with`` or to decorate a function with.

    Raises:
        TypeError: ``enabled`` is not a bool (raised when the block is entered).
    """
    return FlagBlock(functools.partial(_enabled_block, enabled), "enable_breakable_cuda_graph")


@contextlib.contextmanager
def _enabled_block(enabled: bool) -> Iterator[None]:
    if not isinstance(enabled, bool):
        raise TypeError(f"enable_breakable_cuda_graph(enabled=...) takes a bool, got {enabled!r}")
    token = _ENABLED.set(enabled and not breakable_graphs_disabled())
    try:
        yield
    except Exception:
        logger.error(BCG_FAILURE_HINT)
        raise
    finally:
        reset_var(token)  # left in another context (a generator's finaliser): see reset_var


# A replay's cheap form of enable_breakable_cuda_graph() (no generator, no hint): flag_on() sets
# the flag and returns the token that flag_reset(token) restores; the caller checked that graphs
# are not disabled. Bound C methods, not functions: no Python frame before a replay's launch.
flag_on: Callable[[], Token[bool]] = functools.partial(_ENABLED.set, True)
flag_reset: Callable[[Token[bool]], None] = _ENABLED.reset
