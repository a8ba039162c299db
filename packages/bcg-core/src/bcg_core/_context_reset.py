"""Context variables left in another context than they were set in."""

from __future__ import annotations

import contextlib
import sys
import threading
from contextvars import Token
from typing import Any


def reset_var(token: Token[Any]) -> None:
    """Reset a context variable to before ``token``'s ``set``, if this context made it.

    A ``with`` block held open across a ``yield`` (a generator, an async generator) can be left
    in another context than it was entered in: resumed from another task, or closed by its
    finaliser (an async generator's by the event loop). Python refuses the reset there with a
    raw ValueError ("created in a different Context"); the leaving context never saw the value,
    so there is nothing to undo in it. The entering context keeps it: bcg's readers of such
    values check whether they are still live (a closed capture is no capture).
    """
    with contextlib.suppress(ValueError):
        token.var.reset(token)


def running_task() -> object:
    """The asyncio task running on this thread, or None (no loop running, or a callback)."""
    asyncio = sys.modules.get("asyncio")
    if asyncio is None or asyncio.events._get_running_loop() is None:
        return None
    return asyncio.current_task()


def context_key() -> tuple[int, object]:
    """This thread and the asyncio task running on it (None outside one): what tells apart
    the contexts that enter one block object at once."""
    return threading.get_ident(), running_task()
