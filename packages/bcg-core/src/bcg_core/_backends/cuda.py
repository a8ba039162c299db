"""The CUDA graph backend: ``torch.cuda.CUDAGraph`` segments, CUDA streams, capture status
through cuda-bindings (``cudart.py``), and the stream/event hooks that tell a capture which side
streams were used. Pools and routing are in ``cuda_pool.py``, capture lanes in
``cuda_lanes.py``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from bcg_core._backends.cuda_graph import TorchGraph
from bcg_core._backends.cuda_lanes import lease_lane, make_spare_lane
from bcg_core._backends.cuda_pool import (
    CudaPool,
    _routing_api,
    allocate_outside_pool,
    allocate_to_pool,
    count_pool_growth,
    device_index,
    not_pool_growth,
)
from bcg_core._backends.cudart import RUNTIME
from bcg_core._backends.seam import CaptureInfo, StreamObserver, pool_id
from bcg_core._errors import CaptureError
from bcg_core._patching import hook_attribute

_STREAMS_KEPT = 256  # Stream objects kept per backend, by raw pointer (a process uses a few)


class CudaSegment:
    """A ``torch.cuda.CUDAGraph`` that knows whether it captured anything."""

    def __init__(self) -> None:
        self._graph = TorchGraph()
        self._empty = False
        self._stream: torch.cuda.Stream | None = None

    @property
    def empty(self) -> bool:
        return self._empty

    def capture_begin(self, pool: Any, capture_error_mode: str) -> None:
        self._stream = torch.cuda.current_stream()
        try:
            self._graph.capture_begin(pool_id(pool), capture_error_mode)
        except RuntimeError:
            # torch may have registered the pool with the allocator before failing.
            _recover(pool)
            raise

    def capture_end(self) -> None:
        assert self._stream is not None, "capture_end() without capture_begin()"
        self._empty = RUNTIME.capture_node_count(self._stream) == 0
        if not self._empty:
            # Most segments: no warning to silence, so no catch_warnings (it copies the filter
            # list on every call).
            self._graph.capture_end()
            return
        with warnings.catch_warnings():
            # torch warns about empty graphs; an empty segment is expected between adjacent breaks.
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            self._graph.capture_end()

    def launcher(self) -> Callable[[], None]:
        return self._graph.replay

    def reset(self) -> None:
        self._graph.reset()


class CudaBackend:
    """Graph backend for CUDA devices (``torch.cuda.CUDAGraph`` segments, one private pool)."""

    name = "cuda"
    device_type = "cuda"
    alias_device_types = frozenset({"cuda"})
    executes_at_capture = False
    refuses_compiles = True

    def __init__(self) -> None:
        # A runner asks for the current stream at every call: torch.cuda.current_stream builds
        # a Stream object through several Python layers (~5 us on an H200 host), where the raw
        # stream pointer is one C call; the Stream made for a pointer is kept (bounded).
        self._streams: dict[tuple[int, int], torch.cuda.Stream] = {}
        self._lock = threading.Lock()
        self._available = False  # True once seen: CUDA does not leave a process
        self._initialized = False  # likewise for torch's CUDA state

    def is_available(self) -> bool:
        if self._available:
            return True
        available = torch.cuda.is_available()
        if available:
            with self._lock:
                self._available = True
        return available

    def prepare(self) -> None:
        if torch.cuda.is_available():
            RUNTIME.module()
            # About 25 ms once per device; never the reason CUDA starts (a process that forks
            # workers after making graph objects must not have a CUDA context yet).
            if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
                make_spare_lane(torch.cuda.current_device())

    def capture_stream(self, pool: Any, device: Any) -> torch.cuda.Stream:
        lane = lease_lane(pool, device_index(device))
        lane.ensure_workspaces()
        return lane.stream

    def check_available(self) -> None:
        if not torch.cuda.is_available():
            raise CaptureError(
                "breakable CUDA graph capture needs a CUDA device, but torch.cuda.is_available() "
                f"is False (torch {torch.__version__}). Without a GPU, the CPU graph backend "
                "captures and replays CPU tensors under CUDA's capture rules: "
                'BreakableCUDAGraph(backend="cpu"), BreakableGraphRunner(device="cpu"). '
                "Otherwise run the model eagerly on this machine (skip the capture block, or set "
                "BCG_DISABLE=1), or install a CUDA build of torch."
            )

    def new_segment(self) -> CudaSegment:
        return CudaSegment()

    def check_pool(self, pool: Any) -> None:
        ident = pool_id(pool)
        if not (
            isinstance(ident, tuple) and len(ident) == 2 and all(type(i) is int for i in ident)
        ):
            raise TypeError(
                f"pool must be a graph memory pool, got {pool!r}; pass another graph's pool(), "
                "torch.cuda.graph_pool_handle() or a torch.cuda.MemPool, or leave pool=None"
            )

    def check_stream(self, stream: Any) -> None:
        if not isinstance(stream, torch.cuda.Stream):  # ExternalStream is one too
            raise TypeError(
                f"stream must be a torch.cuda.Stream or None, got {stream!r}; a CPU graph's "
                'stream captures only into BreakableCUDAGraph(backend="cpu")'
            )

    def new_pool(self) -> CudaPool:
        self.check_available()  # else torch's "dummy base class _graph_pool_handle" error
        return CudaPool()

    def new_stream(self, device: Any = None) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def current_stream(self, device: Any = None) -> torch.cuda.Stream:
        if not self._initialized:
            if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
                return torch.cuda.current_stream(device)
            with self._lock:
                self._initialized = True
        index = torch._C._cuda_getDevice() if device is None else device_index(device)
        key = (index, torch._C._cuda_getCurrentRawStream(index))
        stream = self._streams.get(key)
        if stream is None:
            stream = torch.cuda.current_stream(index)
            with self._lock:
                if len(self._streams) >= _STREAMS_KEPT:
                    self._streams.clear()
                self._streams[key] = stream
        return stream

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()  # type: ignore[no-untyped-call]

    def capture_info(self, stream: Any) -> CaptureInfo:
        return RUNTIME.capture_info(stream)

    def synchronize(self, streams: Sequence[Any] | None = None) -> None:
        if streams is None:
            torch.cuda.synchronize()
            return
        for stream in streams:
            stream.synchronize()

    def recover_after_failure(self, pool: Any) -> None:
        _recover(pool)

    def install_stream_hooks(self, observer: StreamObserver) -> Callable[[], None]:
        return _install_stream_hooks(observer)

    def pool_bytes(self, pool: Any) -> int | None:
        """What :meth:`count_pool_growth` counted for a :class:`CudaPool`; None for a bare
        pool id, which nothing counts."""
        return pool.bytes if isinstance(pool, CudaPool) else None

    def count_pool_growth(self, pool: Any, device: Any) -> AbstractContextManager[None]:
        return count_pool_growth(pool, device)

    def allocate_to_pool(self, pool: Any, device: Any) -> AbstractContextManager[bool]:
        return allocate_to_pool(pool, device)

    def allocate_outside_pool(self, pool: Any, device: Any) -> AbstractContextManager[None]:
        return allocate_outside_pool(pool, device)

    def not_pool_growth(self, pool: Any, device: Any) -> AbstractContextManager[None]:
        return not_pool_growth(pool, device)

    def note_graph_memory(self, pool: Any, tensors: Sequence[Any]) -> None:
        """Nothing to note: a CUDA kernel reads device memory at replay wherever it came from."""

    def range_push(self, name: str) -> None:
        torch.cuda.nvtx.range_push(name)  # type: ignore[no-untyped-call]

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]


def _recover(pool: Any) -> None:
    _end_pool_routing(pool)
    _end_generator_capture()
    if isinstance(pool, CudaPool):
        pool.renew()  # the old id may still be routed to by the pinned-host allocator


def _end_generator_capture() -> None:
    # A capture that ends in an error leaves torch's CUDA generators in capture mode, and every
    # later eager random op fails ("Offset increment outside graph capture"). Beginning and
    # ending an empty capture takes them out of it; when they were fine it changes nothing.
    graph = TorchGraph()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with contextlib.suppress(RuntimeError), warnings.catch_warnings(), torch.cuda.stream(side):
        warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
        graph.capture_begin(None, "relaxed")
        graph.capture_end()
    graph.reset()


def _end_pool_routing(pool: Any) -> None:
    # torch's capture_end raises before it stops routing allocations to the pool when
    # cudaStreamEndCapture fails, and before it gives back the pool reference capture_begin
    # took (nothing ever would: the pool could never be freed). End the device allocator's
    # routing here and give that reference back. (The pinned-host allocator's routing cannot
    # be stopped from Python: the pool moves to a fresh id.)
    api = _routing_api()
    if api is None:
        return
    _, end, release = api
    index, pid = torch.cuda.current_device(), pool_id(pool)
    try:
        end(index, pid)
    except RuntimeError:  # torch already ended routing (and kept the reference for its graph)
        return
    release(index, pid)


def _cuda_stream(stream: Any) -> Any:
    """``stream`` (None: the current one) as a ``torch.cuda.Stream``: torch.accelerator hands
    out ``torch.Stream`` objects, which have no ``cuda_stream`` (the tracker's key; an event
    recorded on one failed the capture with an AttributeError)."""
    if stream is None:
        return torch.cuda.current_stream()
    if isinstance(stream, torch.cuda.Stream):
        return stream
    return torch.cuda.Stream(  # type: ignore[no-untyped-call]
        stream_id=stream.stream_id,
        device_index=stream.device_index,
        device_type=stream.device_type,
    )


def _install_stream_hooks(observer: StreamObserver) -> Callable[[], None]:
    # Event.record/Event.wait are what Stream.record_event, Stream.wait_event and
    # Stream.wait_stream go through; set_stream is what torch.cuda.stream goes through, and
    # Stream.__enter__ is `with side:` (torch.Stream's own context manager, which sets the
    # stream in C++, past set_stream: a break's side stream used so was never joined). Each
    # wrapper calls the original first, then reports to the capture found in the caller's
    # context; a wait the capture drops (on uncaptured work, see StreamTracker.drops_wait) is
    # not made at all. Installed and removed with hook_attribute: a patch another library put
    # over one of them meanwhile survives the removal (our hook, under it, then only forwards).

    def event_record(record: Any) -> Any:
        def hook(self: Any, stream: Any = None) -> None:
            record(self, stream)
            events = observer()
            if events is not None:
                events.on_record(self, _cuda_stream(stream))

        return hook

    def event_wait(wait: Any) -> Any:
        def hook(self: Any, stream: Any = None) -> None:
            events = observer()
            target = _cuda_stream(stream)
            if events is not None and events.drops_wait(target, self):
                return
            wait(self, stream)
            if events is not None:
                events.on_wait(target, self)

        return hook

    def set_stream_hook(set_stream: Any) -> Any:
        def hook(stream: Any) -> None:
            set_stream(stream)
            events = observer()
            if events is not None and stream is not None:
                events.on_set_stream(_cuda_stream(stream))

        return hook

    def stream_enter(enter: Any) -> Any:
        def hook(self: Any) -> Any:
            entered = enter(self)
            events = observer()
            if events is not None:
                events.on_set_stream(self)
            return entered

        return hook

    removers = [
        hook_attribute(torch.cuda.Event, "record", event_record),
        hook_attribute(torch.cuda.Event, "wait", event_wait),
        hook_attribute(torch.cuda, "set_stream", set_stream_hook),
    ]
    if getattr(torch.cuda.Stream, "__enter__", None) is not None:  # None: a CPU-only torch
        removers.append(hook_attribute(torch.cuda.Stream, "__enter__", stream_enter))

    def uninstall() -> None:
        for remove in reversed(removers):
            remove()

    return uninstall
