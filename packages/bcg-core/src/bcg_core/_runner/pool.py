"""Turns on a graph pool: what the runners that share one pool share.

Graphs that share a pool must run one at a time: a later capture may have been given memory
that an earlier graph's intermediates use during its replay. Runners sharing a pool therefore
share one :class:`PoolTurn`: a re-entrant lock that serialises their calls on the host, and the
stream of the last use of the pool (a replay and its output clone, or a capture). A use on that
same stream is ordered after it by the stream itself, so the common case (every call from one
stream) costs no event. A use on another stream first records an event on the last use's stream
(marking everything issued there so far, the last use among it) and waits on it before it
writes anything (input copies, a replay, a capture); memory is released only after the last
use's stream is reached. Each use waits on the previous one, so ordering after the last use
orders after *every* earlier one.

The turn of a pool is found by the pool object (weakly, so the registry never keeps a pool
alive). A bare pool id (``torch.cuda.graph_pool_handle()``, a tuple) cannot be registered: a
runner given one orders only its own calls, and runners sharing it must be called from one
stream.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from bcg_core._backends import CaptureStatus, DeviceEvent, GraphBackend
from bcg_core._errors import CaptureError


class PoolTurn:
    """A lock for the host and the last use's stream for the device, shared by the users of
    one pool."""

    def __init__(self, backend: GraphBackend) -> None:
        self.lock = threading.RLock()
        # The user (a runner) capturing or replaying in this pool now, set on the thread that
        # holds the lock: a break of it that calls a user of the same pool gets an eager run,
        # since a replay there would overwrite intermediates the running graph still reads.
        self.busy: object | None = None
        self._backend = backend
        self._stream: Any = None  # of the last use; None before the first

    def wait(self, stream: Any) -> None:
        """Make ``stream`` wait for the last use of the pool (nothing before the first, nothing
        on the same stream: its own order suffices).

        Raises:
            CaptureError: the last use's stream is capturing now (another capture began on
                it since), so no event can mark its work.
        """
        last = self._stream
        # Identity first: the backend hands out one object per stream, and Stream.__eq__ is
        # Python code on a call's hot path.
        if last is None or last is stream or last == stream:
            return
        self._check_not_capturing(last)
        event: DeviceEvent = self._backend.new_event()
        event.record(last)
        event.wait(stream)

    def record(self, stream: Any) -> None:
        """Mark the end of a use of the pool on ``stream``."""
        self._stream = stream

    def drain(self) -> None:
        """Block the host until the last use of the pool has finished on the device (before
        memory it used is released).

        Raises:
            CaptureError: the last use's stream is capturing now.
        """
        if self._stream is not None:
            self._check_not_capturing(self._stream)
            self._backend.synchronize((self._stream,))

    def _check_not_capturing(self, last: Any) -> None:
        if self._backend.capture_info(last).status is not CaptureStatus.NONE:
            raise CaptureError(
                f"this graph pool was last used on stream {last!r}, which is capturing now: its "
                "work cannot be waited for. End that capture first, or call the runner from "
                "the stream it last ran on."
            )


_TURNS: weakref.WeakKeyDictionary[Any, PoolTurn] = weakref.WeakKeyDictionary()
_TURNS_LOCK = threading.Lock()


def share_turn(pool: Any, turn: PoolTurn) -> PoolTurn:
    """The turn registered for ``pool``; ``turn`` (now registered) when there is none yet, or
    when ``pool`` is a bare id that cannot be registered."""
    with _TURNS_LOCK:
        try:
            return _TURNS.setdefault(pool, turn)
        except TypeError:  # not weakly referenceable: a bare id tuple
            return turn
