"""The graph backend seam: everything capture and replay ask of a device, as two protocols.

Runtime code (graph, capture, breaks, context, streams, runner) reaches the device only through
a :class:`GraphBackend` picked by ``backend_for`` (``_backends/__init__.py``); each backend module
implements these protocols and imports none of the others. ``CaptureStatus``/``CaptureInfo`` are
the shared vocabulary of capture-status queries (CUDA's ``cudaStreamCaptureStatus``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol


class CaptureStatus(enum.IntEnum):
    """Mirror of ``cudaStreamCaptureStatus``."""

    NONE = 0
    ACTIVE = 1
    INVALIDATED = 2


@dataclass(frozen=True)
class CaptureInfo:
    """What the runtime says about one stream. No handle the runtime owns is kept: the
    graph being captured is asked about only inside the query that found it ACTIVE
    (``cudart.py``)."""

    status: CaptureStatus
    capture_id: int | None = None


class StreamEvents(Protocol):
    """What a capture learns from stream hooks (implemented by ``_streams.StreamTracker``)."""

    def on_record(self, event: Any, stream: Any) -> None: ...

    def drops_wait(self, stream: Any, event: Any) -> bool:
        """Asked before a wait: True when it is dropped (capturing ``stream`` waiting on work
        recorded outside the capture)."""
        ...

    def on_wait(self, stream: Any, event: Any) -> None: ...

    def on_set_stream(self, stream: Any) -> None: ...


StreamObserver = Callable[[], "StreamEvents | None"]
"""Returns the tracker of the capture running in the caller's context, or None."""


class DeviceEvent(Protocol):
    """A marker in a stream's work, for ordering streams (``torch.cuda.Event``'s methods)."""

    def record(self, stream: Any = None) -> None:
        """Mark the work issued to ``stream`` (the current stream when None) so far."""
        ...

    def wait(self, stream: Any = None) -> None:
        """Make work issued to ``stream`` from now on wait for the last recorded mark."""
        ...

    def synchronize(self) -> None:
        """Block the host until the last recorded mark is reached (at once if never recorded)."""
        ...


class Segment(Protocol):
    """One captured graph segment."""

    @property
    def empty(self) -> bool:
        """True when the capture recorded no work (the segment is never launched)."""
        ...

    def capture_begin(self, pool: Any, capture_error_mode: str) -> None: ...

    def capture_end(self) -> None: ...

    def launcher(self) -> Callable[[], None]:
        """The cheapest callable that replays this segment (used by replay plans)."""
        ...

    def reset(self) -> None: ...


class GraphBackend(Protocol):
    """Device services used by capture and replay."""

    name: str
    device_type: str
    """The ``torch.device`` type of the tensors this backend captures ("cuda", "cpu")."""
    alias_device_types: frozenset[str]
    """Device types whose tensors a recorded break holds by alias (a non-owning tensor over the
    same memory) rather than by reference, so a graph never keeps a pool block alive that the
    code around it freed (CUDA: {"cuda"}; CPU: none, its recorded segments hold tensors anyway)."""
    executes_at_capture: bool
    """True when recording a segment also runs it (CPU), so a faithful capture must not launch
    it again; False when capture only records (CUDA)."""
    refuses_compiles: bool
    """True when torch.compile may not compile during a capture (CUDA: compiling allocates and
    synchronises on the capturing stream), so a capture refuses recompiles; False on the CPU
    recorder, under which dynamo re-traces or skips frames (it guards on dispatch modes)."""

    def is_available(self) -> bool:
        """Whether this backend can capture on this machine."""
        ...

    def check_available(self) -> None:
        """Raise :class:`CaptureError` saying what to do when this backend cannot capture."""
        ...

    def prepare(self) -> None:
        """Load, once per process, what a first capture would otherwise load inside the capture
        (the CUDA runtime bindings: about 130 ms on an H200 host; a capture lane, about 25 ms,
        when CUDA is already initialized), so capture time is capture. Never initializes the
        device itself."""
        ...

    def capture_stream(self, pool: Any, device: Any) -> Any:
        """The stream a capture into ``pool`` on ``device`` runs on when the caller names none,
        ready for it. Libraries cache scratch memory per stream (cuBLAS's workspace) and
        captured kernels bake its address, so that memory must outlive the graph whoever
        clears the cache; CUDA: the pool's capture lane (``cuda_lanes.py``)."""
        ...

    def new_segment(self) -> Segment: ...

    def new_pool(self) -> Any: ...

    def check_pool(self, pool: Any) -> None:
        """Raise ``TypeError`` saying what to pass when ``pool`` is not a pool of this backend
        (a capture into it would fail half-way, or on the CPU silently share nothing)."""
        ...

    def check_stream(self, stream: Any) -> None:
        """Raise ``TypeError`` saying what to pass when ``stream`` is not a stream of this
        backend (on CUDA a CPU stream's negative handle went to the driver)."""
        ...

    def new_stream(self, device: Any = None) -> Any: ...

    def current_stream(self, device: Any = None) -> Any: ...

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]: ...

    def new_event(self) -> DeviceEvent:
        """An event for ordering work across streams (no timing)."""
        ...

    def capture_info(self, stream: Any) -> CaptureInfo: ...

    def synchronize(self, streams: Sequence[Any] | None = None) -> None:
        """Wait for ``streams``, or for the whole device when None."""
        ...

    def recover_after_failure(self, pool: Any) -> None:
        """Undo what a capture that failed half-way leaves behind in the framework (allocator
        routing to the pool, random generators stuck in capture mode)."""
        ...

    def install_stream_hooks(self, observer: StreamObserver) -> Callable[[], None]:
        """Wrap the framework's stream and event entry points so that each use is reported to
        ``observer()`` (when it returns one); return the function that undoes it. Called once
        per process at a time, under the runtime's lock (``_streams.py`` refcounts it)."""
        ...

    def pool_bytes(self, pool: Any) -> int | None:
        """Bytes the allocator holds for ``pool`` (as counted by :meth:`count_pool_growth`),
        or None when unknown."""
        ...

    def note_graph_memory(self, pool: Any, tensors: Sequence[Any]) -> None:
        """Tell the backend that ``tensors`` (a break's bridged outputs, and the arguments it
        wrote in place) are memory the capture into ``pool`` writes at every replay, like a
        segment's own outputs."""
        ...

    def range_push(self, name: str) -> None:
        """Open a named range in the device's own profiler timeline (NVTX), if it has one."""
        ...

    def range_pop(self) -> None:
        """Close the range opened by the last :meth:`range_push`."""

    def count_pool_growth(self, pool: Any, device: Any) -> AbstractContextManager[None]:
        """While open, count what the allocator newly reserves on ``device`` as ``pool``'s
        (captures and warm-ups into the pool run inside it); :meth:`pool_bytes` reports the
        sum. A backend that cannot tell counts nothing."""
        ...

    def not_pool_growth(self, pool: Any, device: Any) -> AbstractContextManager[None]:
        """Inside :meth:`count_pool_growth`: what the allocator newly reserves while open is
        not counted as ``pool``'s (a break at capture allocates outside the pool)."""
        ...

    def allocate_to_pool(self, pool: Any, device: Any) -> AbstractContextManager[bool]:
        """While open, route every allocation the calling thread makes on ``device`` to
        ``pool``; yields True. Warm-ups run inside it, and at capture a break's outputs are
        copied into the pool inside it, so the bridges live in the graph's pool like a
        monolithic graph's intermediates.

        Yields False, routing nothing, where the backend has no such routing (CPU pools are
        tokens; a CUDA torch without the thread routing API): the caller then holds what the
        break returned strongly. Routing is undone however the block exits."""
        ...

    def allocate_outside_pool(self, pool: Any, device: Any) -> AbstractContextManager[None]:
        """Inside :meth:`allocate_to_pool` for ``pool`` (when it yielded True): route nothing
        while open (nor count it as the pool's, :meth:`not_pool_growth`), then route to
        ``pool`` again. A break called in a warm-up runs inside it, so its temporaries never
        become pool memory (a replay allocates them outside)."""
        ...


def pool_id(pool: Any) -> Any:
    """The allocator id of a pool given as a pool object (anything with ``.id``, such as
    ``CudaPool`` or ``torch.cuda.MemPool``) or as a bare id tuple from
    ``torch.cuda.graph_pool_handle()``."""
    return getattr(pool, "id", pool)
