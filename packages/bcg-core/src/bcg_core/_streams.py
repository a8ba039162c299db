"""Side-stream tracking during a breakable capture.

CUDA requires every stream forked from the capturing stream to be joined back before the capture
ends, and a break point's side-stream work must finish before the next segment reads its results.
Both need to know which streams were used, so while any breakable capture is active a few torch
entry points are wrapped: ``Event.record`` and ``Event.wait`` (which ``Stream.record_event``,
``Stream.wait_event`` and ``Stream.wait_stream`` go through) and ``torch.cuda.set_stream`` (which
``torch.cuda.stream`` goes through). The wrappers call the original first and then report to
the tracker of the capture found in the caller's context; outside a capture they only forward.

The wrappers are installed refcounted under a lock (several threads may capture at once) and
always removed when the last capture exits, however it exits.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from bcg_core._context import active_capture


class StreamTracker:
    """Forks and joins seen in the current segment, and streams touched by the current break."""

    def __init__(self, origin: torch.cuda.Stream) -> None:
        self.origin = origin
        self._origin = origin.cuda_stream
        self._forked: dict[int, torch.cuda.Stream] = {}
        self._ever_forked: dict[int, torch.cuda.Stream] = {}
        self._events: dict[int, tuple[Any, int]] = {}
        self._break: dict[int, torch.cuda.Stream] | None = None

    def begin_segment(self) -> None:
        self._forked.clear()
        self._ever_forked.clear()
        self._events.clear()

    def unjoined(self) -> list[torch.cuda.Stream]:
        return list(self._forked.values())

    def forked_this_segment(self) -> list[torch.cuda.Stream]:
        return list(self._ever_forked.values())

    def join_all(self) -> None:
        for stream in self.unjoined():
            self.origin.wait_stream(stream)
        self._forked.clear()

    def begin_break(self) -> None:
        self._break = {}

    def end_break(self) -> tuple[torch.cuda.Stream, ...]:
        touched = tuple(self._break.values()) if self._break is not None else ()
        self._break = None
        return touched

    def on_record(self, event: Any, stream: torch.cuda.Stream) -> None:
        # Keep the event object alive while its id is a key, so ids cannot be recycled.
        self._events[id(event)] = (event, stream.cuda_stream)
        self._touch(stream)

    def on_wait(self, stream: torch.cuda.Stream, event: Any) -> None:
        self._touch(stream)
        record = self._events.get(id(event))
        if record is None or self._break is not None:
            return
        src, dst = record[1], stream.cuda_stream
        if dst == self._origin or dst in self._forked:
            self._forked.pop(src, None)  # joined (into the origin, or into a stream that must be)
        elif src == self._origin or src in self._forked:
            self._forked[dst] = stream
            self._ever_forked[dst] = stream

    def on_set_stream(self, stream: torch.cuda.Stream) -> None:
        self._touch(stream)

    def _touch(self, stream: torch.cuda.Stream) -> None:
        if self._break is not None and stream.cuda_stream != self._origin:
            self._break[stream.cuda_stream] = stream


def _tracker() -> StreamTracker | None:
    state = active_capture()
    return None if state is None else state.tracker


_lock = threading.Lock()
_refcount = 0
_originals: dict[str, Any] = {}


def _install() -> None:
    record = torch.cuda.Event.record
    wait = torch.cuda.Event.wait
    set_stream = torch.cuda.set_stream
    _originals.update(record=record, wait=wait, set_stream=set_stream)

    def event_record(self: Any, stream: Any = None) -> None:
        record(self, stream)
        tracker = _tracker()
        if tracker is not None:
            tracker.on_record(self, stream if stream is not None else torch.cuda.current_stream())

    def event_wait(self: Any, stream: Any = None) -> None:
        wait(self, stream)
        tracker = _tracker()
        if tracker is not None:
            tracker.on_wait(stream if stream is not None else torch.cuda.current_stream(), self)

    def set_stream_hook(stream: Any) -> None:
        set_stream(stream)
        tracker = _tracker()
        if tracker is not None and stream is not None:
            tracker.on_set_stream(stream)

    torch.cuda.Event.record = event_record  # type: ignore[method-assign]
    torch.cuda.Event.wait = event_wait  # type: ignore[method-assign]
    torch.cuda.set_stream = set_stream_hook


def _uninstall() -> None:
    torch.cuda.Event.record = _originals["record"]  # type: ignore[method-assign]
    torch.cuda.Event.wait = _originals["wait"]  # type: ignore[method-assign]
    torch.cuda.set_stream = _originals["set_stream"]
    _originals.clear()


@contextlib.contextmanager
def stream_hooks() -> Iterator[None]:
    """Install the stream/event wrappers for the enclosed block (refcounted, always removed)."""
    global _refcount
    with _lock:
        if _refcount == 0:
            _install()
        _refcount += 1
    try:
        yield
    finally:
        with _lock:
            _refcount -= 1
            if _refcount == 0:
                _uninstall()


def hooks_installed() -> bool:
    """Whether the wrappers are in place right now (for tests and diagnostics)."""
    with _lock:
        return _refcount > 0
