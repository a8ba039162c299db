"""Notices said once per process: the keys seen so far, under a lock (breaks and environment
variables are read from any thread)."""

from __future__ import annotations

import threading
from collections.abc import Hashable

_lock = threading.Lock()
_seen: set[Hashable] = set()


def first_time(key: Hashable) -> bool:
    """Whether ``key`` (a kind of notice and what it is about) is seen for the first time."""
    with _lock:
        first = key not in _seen
        _seen.add(key)
    return first
