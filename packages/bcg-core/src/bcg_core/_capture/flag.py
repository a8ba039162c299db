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
import logging
from collections.abc import Callable, Iterator
from contextvars import ContextVar, Token

from bcg_core._context_reset import reset_var
from bcg_core._env import EnvFlag, env_word
from bcg_core._errors import BCG_FAILURE_HINT

logger = logging.getLogger("bcg_core")

_ENABLED: ContextVar[bool] = ContextVar("bcg_core_enabled", default=False)
_DISABLED: ContextVar[bool] = ContextVar("bcg_core_disabled", default=False)
_BCG_DISABLE = EnvFlag("BCG_DISABLE")


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


@contextlib.contextmanager
def disable_breakable_graphs() -> Iterator[None]:
    """Context manager that turns breakable graphs off for the enclosed block.

    It does for this thread or asyncio task what ``BCG_DISABLE=1`` does for the whole process:
    the flag stays off (model code takes its eager path), runners run every call eagerly, and
    captures refuse to start (:class:`CaptureError`). Nesting restores the previous state on
    exit, also when the block raises.

    Yields:
        None.
    """
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        reset_var(token)  # left in another context (a generator's finaliser): see reset_var


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


@contextlib.contextmanager
def enable_breakable_cuda_graph(enabled: bool = True) -> Iterator[None]:
    """Context manager that sets the runtime flag for the enclosed block.

    The flag (read with :func:`is_in_breakable_cuda_graph`) is a context variable: per thread
    and per asyncio task, and the previous value is restored on exit. Disabled breakable graphs
    (``BCG_DISABLE=1``, :func:`disable_breakable_graphs`) force the flag off. If the block
    raises, :data:`BCG_FAILURE_HINT` is logged at error level on logger ``bcg_core`` and the
    exception is re-raised unchanged.

    Args:
        enabled: the value to set (default True); False routes model code to its eager path
            for the block, for example to rule bcg out.

    Yields:
        None.

    Raises:
        TypeError: ``enabled`` is not a bool (raised when the block is entered).
    """
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
