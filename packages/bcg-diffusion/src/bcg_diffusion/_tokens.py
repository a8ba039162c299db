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
    """The token of the replay running in this context, or None outside replays.

    Compare it with the token a cache was built under to reuse per-replay metadata across the
    layers of one replay.

    Returns:
        A positive int, strictly increasing in the process, inside a replay (a
        :class:`DiTRunner` call that replays, or :func:`replay_token_scope`); None outside
        one, including during capture, when no cache may be trusted.
    """
    return _TOKEN.get()


@contextlib.contextmanager
def replay_token_scope() -> Iterator[int]:
    """Context manager that runs the enclosed replay under a fresh token.

    :class:`DiTRunner` enters one for every call; use it to replay by hand. The token is set
    in a context variable (this thread or task), and the previous token is restored on exit.

    Yields:
        The new token, a positive int larger than every token before it in the process.
    """
    with _counter_lock:
        token = next(_counter)
    reset = _TOKEN.set(token)
    try:
        yield token
    finally:
        _TOKEN.reset(reset)
