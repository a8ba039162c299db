"""Side-stream tracking during a breakable capture.

CUDA requires every stream forked from the capturing stream to be joined back before the capture
ends, and a break point's side-stream work must finish before the next segment reads its results.
Both need to know which streams were used, so while any breakable capture is active the backend
wraps its stream and event entry points (for CUDA: ``Event.record``, ``Event.wait``,
``torch.cuda.set_stream`` and ``Stream.__enter__``, see ``_backends/cuda.py``) and reports each
use to the tracker of the capture found in the caller's context; outside a capture the wrappers
only forward.

The wrappers are installed refcounted per backend under a lock (several threads may capture at
once) and always removed when that backend's last capture exits, however it exits.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from bcg_core._backends import CaptureStatus, GraphBackend
from bcg_core._capture.context import active_capture
from bcg_core._source import user_location


class StreamTracker:
    """Forks and joins seen in the current segment, and streams touched by the current break."""

    def __init__(self, origin: Any, backend: GraphBackend) -> None:
        self.origin = origin
        self._origin = origin.cuda_stream
        self._backend = backend
        self._forked: dict[int, Any] = {}
        self._ever_forked: dict[int, Any] = {}
        # id(event) -> (event, the stream it was recorded on, whether it is ordered before the
        # current segment: a break or an earlier segment recorded it)
        self._events: dict[int, tuple[Any, Any, bool]] = {}
        self._break: dict[int, Any] | None = None
        # Streams joined by join_all at a segment's end (auto_join), for the whole capture: a
        # later segment's wait on one is dropped as a wait on uncaptured work, but said so.
        self._auto_joined: dict[int, Any] = {}

    def begin_segment(self) -> None:
        self._forked.clear()
        self._ever_forked.clear()
        # Every record is kept, now ordered before this segment: a wait on one is dropped
        # (drops_wait). Forgotten, such a wait was made, and CUDA refused it (raw error).
        self._events = {key: (event, on, True) for key, (event, on, _) in self._events.items()}

    def unjoined(self) -> list[Any]:
        return list(self._forked.values())

    def forked_this_segment(self) -> list[Any]:
        return list(self._ever_forked.values())

    def join_all(self) -> None:
        # Copied first: each join below reaches on_wait, which takes the stream off _forked.
        joining = dict(self._forked)
        for stream in joining.values():
            self.origin.wait_stream(stream)
        self._auto_joined.update(joining)
        self._forked.clear()

    def begin_break(self) -> None:
        self._break = {}

    def end_break(self) -> tuple[Any, ...]:
        touched = tuple(self._break.values()) if self._break is not None else ()
        self._break = None
        return touched

    def on_record(self, event: Any, stream: Any) -> None:
        # Keep the event object alive while its id is a key, so ids cannot be recycled.
        self._events[id(event)] = (event, stream, self._break is not None)
        self._touch(stream)

    def drops_wait(self, stream: Any, event: Any) -> bool:
        """Whether a wait of ``stream`` on ``event`` is to be dropped (with a warning naming the
        call site): ``stream`` is capturing and ``event`` marks work recorded on a stream that
        is not (``side.wait_stream`` at capture, ``side`` holding eager work from before). CUDA
        refuses such a dependency ("dependency created on uncaptured work in another stream")
        and a replay could not honour it anyway: the work waited for is not in the graph. A
        wait on an event a break recorded is dropped too, silently: it holds already."""
        record = self._events.get(id(event))
        if record is None or self._break is not None:
            return False
        status = self._backend.capture_info
        if status(stream).status is not CaptureStatus.ACTIVE:
            return False
        if record[2]:
            # Recorded by a break or an earlier segment: the streams a break touches are joined
            # into the capturing stream after it, a segment's forks when it ends (auto_join;
            # without it an unjoined fork failed the capture), at capture and at every replay,
            # so the wait holds already. Dropped without a word (made, CUDA refused it as a
            # wait on work outside this segment's capture, failing the capture).
            return True
        if status(record[1]).status is not CaptureStatus.NONE:
            return False
        where = user_location() or "an unknown line"
        if record[1].cuda_stream in self._auto_joined:
            # A fork joined in a later segment than its fork's (the "uncaptured work" text sent
            # users looking for eager work that was never there).
            why = (
                "which was forked in an earlier segment and joined into the capturing stream "
                f"when that segment ended (auto_join) (at {where}): its captured work is already "
                "ordered before this segment, so the wait is not captured. Join a side stream in "
                "the segment that forked it (before the next break); if eager work was issued "
                "on it since, finish that work before the capture starts."
            )
        else:
            why = (
                f"which holds work issued outside the capture (at {where}): a graph cannot "
                "depend on uncaptured work. The wait is not captured, so finish that work before "
                "the capture starts (e.g. side.synchronize(), or order it on the caller's "
                "stream) if the captured code reads its results."
            )
        warnings.warn(
            f"bcg: dropped a wait of the capturing stream {stream!r} on {record[1]!r}, {why}",
            RuntimeWarning,
            stacklevel=2,
        )
        return True

    def on_wait(self, stream: Any, event: Any) -> None:
        self._touch(stream)
        record = self._events.get(id(event))
        if record is None or self._break is not None:
            return
        src, dst = record[1].cuda_stream, stream.cuda_stream
        if dst == self._origin or dst in self._forked:
            self._forked.pop(src, None)  # joined (into the origin, or into a stream that must be)
        elif src == self._origin or src in self._forked:
            self._forked[dst] = stream
            self._ever_forked[dst] = stream

    def on_set_stream(self, stream: Any) -> None:
        self._touch(stream)

    def _touch(self, stream: Any) -> None:
        if self._break is not None and stream.cuda_stream != self._origin:
            self._break[stream.cuda_stream] = stream


def _tracker() -> StreamTracker | None:
    state = active_capture()
    return None if state is None else state.tracker


_lock = threading.Lock()
# backend name -> (refcount, the function that removes its hooks)
_installed: dict[str, tuple[int, Callable[[], None]]] = {}


@contextlib.contextmanager
def stream_hooks(backend: GraphBackend) -> Iterator[None]:
    """Install ``backend``'s stream/event wrappers for the enclosed block (refcounted, always
    removed)."""
    with _lock:
        count, uninstall = _installed.get(backend.name, (0, None))
        if uninstall is None:
            uninstall = backend.install_stream_hooks(_tracker)
        _installed[backend.name] = (count + 1, uninstall)
    try:
        yield
    finally:
        with _lock:
            count, uninstall = _installed.pop(backend.name)
            if count > 1:
                _installed[backend.name] = (count - 1, uninstall)
            else:
                uninstall()


def hooks_installed() -> bool:
    """Whether any backend's wrappers are in place right now (for tests and diagnostics)."""
    with _lock:
        return bool(_installed)
