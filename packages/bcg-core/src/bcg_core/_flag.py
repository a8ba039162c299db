"""The runtime flag that model code reads to route its uncapturable calls through break points.

The flag is a context variable: it is per thread and per asyncio task, and nesting restores the
previous value. Setting ``BCG_DISABLE=1`` in the environment makes
:func:`enable_breakable_cuda_graph` leave the flag off, so a whole deployment can fall back to
plain eager code without a code change.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from contextvars import ContextVar

from bcg_core._errors import BCG_FAILURE_HINT

logger = logging.getLogger("bcg_core")

_ENABLED: ContextVar[bool] = ContextVar("bcg_core_enabled", default=False)


def bcg_disabled_by_env() -> bool:
    """True when ``BCG_DISABLE`` is set to a true value (1, true, yes, on)."""
    return os.environ.get("BCG_DISABLE", "").strip().lower() in {"1", "true", "yes", "on"}


def is_in_breakable_cuda_graph() -> bool:
    """Whether model code should route through break points (set by the context manager).

    This is a routing decision for model code, not a capture query: it is true for the whole
    ``with enable_breakable_cuda_graph():`` block, at capture and at replay. Use
    :func:`is_breakable_capture_active` to ask whether a capture is running right now.
    """
    return _ENABLED.get()


@contextlib.contextmanager
def enable_breakable_cuda_graph(enabled: bool = True) -> Iterator[None]:
    """Set the runtime flag for the enclosed block and restore the previous value on exit.

    ``BCG_DISABLE=1`` forces the flag off. If the block raises, :data:`BCG_FAILURE_HINT` is logged
    at error level on logger ``bcg_core`` and the exception is re-raised unchanged.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enable_breakable_cuda_graph(enabled=...) takes a bool, got {enabled!r}")
    token = _ENABLED.set(enabled and not bcg_disabled_by_env())
    try:
        yield
    except Exception:
        logger.error(BCG_FAILURE_HINT)
        raise
    finally:
        _ENABLED.reset(token)
