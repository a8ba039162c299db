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
from contextvars import ContextVar, Token

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


class ReplayTokenScope(contextlib.ContextDecorator):
    """The context manager :func:`replay_token_scope` returns: entering it sets a fresh token
    (and returns it), leaving it restores the previous one. A class rather than a generator:
    :class:`DiTRunner` enters one right before every replay's first launch, and making and
    entering it costs one Python frame where a generator-based one costs several. Each
    instance is entered once; as a decorator (like the generator-based scope it replaced) it
    makes a fresh one per call. Entering an instance that is entered already (nested, or in
    another thread) raises: its second reset token overwrote the first, so the outer exit
    raised contextvars' raw "Token has already been used once" and left its token set after
    the block (eager code outside any replay then trusted a replay's cache). Left in another
    context than it was entered in (a generator's finaliser), it leaves quietly."""

    _reset: Token[int | None] | None = None

    def _recreate_cm(self) -> ReplayTokenScope:
        return type(self)()

    def __enter__(self) -> int:
        with _counter_lock:
            if self._reset is not None:
                raise RuntimeError(
                    "this replay_token_scope() is entered already (nested, or in another "
                    "thread); enter a fresh replay_token_scope() for each block"
                )
            token = next(_counter)
            self._reset = _TOKEN.set(token)
        return token

    def __exit__(self, *exc_info: object) -> None:
        reset, self._reset = self._reset, None
        if reset is not None:
            # Left in another context than it was entered in (held across a yield, closed by a
            # generator's finaliser), contextvars refuses the reset with a raw ValueError; the
            # leaving context never saw the token, so there is nothing to undo in it (as
            # bcg_core's own blocks do).
            with contextlib.suppress(ValueError):
                _TOKEN.reset(reset)


def replay_token_scope() -> ReplayTokenScope:
    """Context manager that runs the enclosed replay under a fresh token.

    :class:`DiTRunner` enters one for every replay (not for its eager calls, whose token
    stays None); use it to replay by hand
    (``with replay_token_scope() as token: graph.replay()``), or as a decorator
    (``@replay_token_scope()``: a fresh token for each call). The token is set in a context
    variable (this thread or task), and the previous token is restored on exit.

    Returns:
        A context manager whose ``__enter__`` returns the new token, a positive int larger than
        every token before it in the process; also a decorator (typed as one, so
        ``@replay_token_scope()`` needs no cast).
    """
    return ReplayTokenScope()
