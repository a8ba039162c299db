"""Replay tokens: one fresh value per graph replay, shared by every break point of that replay.

Eager attention code inside breaks often derives metadata from its inputs (varlen masks, block
tables, cumulative sequence lengths). The inputs are identical for every layer of one replay, so
the metadata can be built once per replay and reused: compare :func:`get_current_replay_token`
with the token the cache was built under. Tokens are positive integers, strictly increasing in
the process, held in a context variable (per thread and task; nested scopes restore the outer
token), and ``None`` outside replays — including during capture, when no cache may be trusted.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from contextvars import ContextVar

_TOKEN: ContextVar[int | None] = ContextVar("bcg_diffusion_replay_token", default=None)
_counter = itertools.count(1)
_counter_lock = threading.Lock()


def get_current_replay_token() -> int | None:
    """The token of the replay running in this context, or None outside replays."""
    return _TOKEN.get()


@contextlib.contextmanager
def replay_token_scope() -> Iterator[int]:
    """Run the enclosed replay under a fresh token (yielded); the previous token is restored."""
    with _counter_lock:
        token = next(_counter)
    reset = _TOKEN.set(token)
    try:
        yield token
    finally:
        _TOKEN.reset(reset)
