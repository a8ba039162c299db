"""Turns on a graph pool: what the runners that share one pool share.

Graphs that share a pool must run one at a time: a later capture may have been given memory
that an earlier graph's intermediates use during its replay. Runners sharing a pool therefore
share one :class:`PoolTurn`: a re-entrant lock that serialises their calls on the host, and one
device event recorded after each use of the pool (a replay and its output clone, or a capture),
on whatever stream it ran. The next use waits on that event on its own stream before it writes
anything (input copies, a replay, a capture), and memory is released only after the event is
reached. Each use waits on the previous one, so waiting on the last event orders a use after
*every* earlier one.

The turn of a pool is found by the pool object (weakly, so the registry never keeps a pool
alive). A bare pool id (``torch.cuda.graph_pool_handle()``, a tuple) cannot be registered: a
runner given one orders only its own calls, and runners sharing it must be called from one
stream.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from bcg_core._backends import DeviceEvent, GraphBackend


class PoolTurn:
    """A lock for the host and an event for the device, shared by the users of one pool."""

    def __init__(self, backend: GraphBackend) -> None:
        self.lock = threading.RLock()
        self._backend = backend
        self._event: DeviceEvent | None = None

    def wait(self, stream: Any) -> None:
        """Make ``stream`` wait for the last use of the pool (nothing before the first)."""
        if self._event is not None:
            self._event.wait(stream)

    def record(self, stream: Any) -> None:
        """Mark the end of a use of the pool on ``stream``."""
        if self._event is None:
            self._event = self._backend.new_event()
        self._event.record(stream)

    def drain(self) -> None:
        """Block the host until the last use of the pool has finished on the device (before
        memory it used is released)."""
        if self._event is not None:
            self._event.synchronize()


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
