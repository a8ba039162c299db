"""The graph backend seam: everything the capture logic asks of a device, in one place.

Capture and replay code never touches ``torch.cuda`` directly for graph objects, pools, streams or
capture status; it asks a :class:`GraphBackend`. The CUDA backend below wraps
``torch.cuda.CUDAGraph``; the CPU graph backend (``_cpu_backend.py``) implements the same two
protocols, and ``torch.accelerator.Graph`` could too.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from bcg_core._cpu_backend import CpuBackend
from bcg_core._cudart import RUNTIME, CaptureInfo, CaptureStatus
from bcg_core._errors import CaptureError


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

    def check_available(self) -> None:
        """Raise :class:`CaptureError` saying what to do when this backend cannot capture."""
        ...

    def new_segment(self) -> Segment: ...

    def new_pool(self) -> Any: ...

    def new_stream(self, device: Any = None) -> Any: ...

    def current_stream(self, device: Any = None) -> Any: ...

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]: ...

    def capture_info(self, stream: Any) -> CaptureInfo: ...

    def synchronize(self, streams: Sequence[Any] | None = None) -> None:
        """Wait for ``streams``, or for the whole device when None."""
        ...

    def recover_after_failure(self, pool: Any) -> None:
        """Undo what a capture that failed half-way leaves behind in the framework (allocator
        routing to the pool, random generators stuck in capture mode)."""
        ...


def pool_id(pool: Any) -> Any:
    """The allocator id of a pool given as a :class:`CudaPool` (or anything with ``.id``, such
    as ``torch.cuda.MemPool``) or as a bare id tuple from ``torch.cuda.graph_pool_handle()``."""
    return getattr(pool, "id", pool)


class CudaPool:
    """A graph memory pool that stays valid while this object lives.

    torch frees a pool (in both its device and its pinned-host allocator) when the last graph
    captured into it is reset; capturing into that id again then fails an allocator assertion.
    So the pool is anchored by an empty graph captured into it at creation and kept here: the
    pool survives ``reset()`` of every graph that uses it, and is returned to the allocator when
    this object (held by every graph that shares it) is collected.
    """

    def __init__(self) -> None:
        self.id = torch.cuda.graph_pool_handle()
        self._anchor = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            # relaxed: the anchor must not disturb (or be disturbed by) captures on other threads
            self._anchor.capture_begin(pool=self.id, capture_error_mode="relaxed")
            self._anchor.capture_end()

    def __repr__(self) -> str:
        return f"CudaPool(id={self.id})"


class CudaSegment:
    """A ``torch.cuda.CUDAGraph`` that knows whether it captured anything."""

    def __init__(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._empty = False
        self._stream: torch.cuda.Stream | None = None

    @property
    def empty(self) -> bool:
        return self._empty

    def capture_begin(self, pool: Any, capture_error_mode: str) -> None:
        self._stream = torch.cuda.current_stream()
        try:
            self._graph.capture_begin(pool=pool_id(pool), capture_error_mode=capture_error_mode)
        except RuntimeError:
            # torch may have registered the pool with the allocator before failing.
            _recover(pool)
            raise

    def capture_end(self) -> None:
        assert self._stream is not None, "capture_end() without capture_begin()"
        info = RUNTIME.capture_info(self._stream)
        nodes = RUNTIME.graph_node_count(info.graph)
        self._empty = nodes == 0
        with warnings.catch_warnings():
            # torch warns about empty graphs; an empty segment is expected between adjacent breaks.
            if self._empty:
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

    def check_available(self) -> None:
        if not torch.cuda.is_available():
            raise CaptureError(
                "breakable CUDA graph capture needs a CUDA device, but torch.cuda.is_available() "
                f"is False (torch {torch.__version__}). Run the model eagerly on this machine "
                "(skip the capture block, or set BCG_DISABLE=1), or install a CUDA build of torch."
            )

    def new_segment(self) -> CudaSegment:
        return CudaSegment()

    def new_pool(self) -> CudaPool:
        return CudaPool()

    def new_stream(self, device: Any = None) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def current_stream(self, device: Any = None) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

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


def _recover(pool: Any) -> None:
    _end_pool_routing(pool)
    _end_generator_capture()


def _end_generator_capture() -> None:
    # A capture that ends in an error leaves torch's CUDA generators in capture mode, and every
    # later eager random op fails ("Offset increment outside graph capture"). Beginning and
    # ending an empty capture takes them out of it; when they were fine it changes nothing.
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with contextlib.suppress(RuntimeError), warnings.catch_warnings(), torch.cuda.stream(side):
        warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
        graph.capture_begin(capture_error_mode="relaxed")
        graph.capture_end()
    graph.reset()


def _end_pool_routing(pool: Any) -> None:
    # torch's capture_end raises before it stops routing allocations to the pool when
    # cudaStreamEndCapture fails; stop the device allocator's routing here. (The pinned-host
    # allocator's routing cannot be stopped from Python: the graph moves to a fresh pool.)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    with contextlib.suppress(RuntimeError):  # torch already ended routing for this pool
        end(torch.cuda.current_device(), pool_id(pool))


_BACKENDS: dict[str, GraphBackend] = {"cuda": CudaBackend(), "cpu": CpuBackend()}


def backend_for(device_type: str = "cuda") -> GraphBackend:
    """The backend for a device type: "cuda" or "cpu"."""
    backend = _BACKENDS.get(device_type)
    if backend is None:
        raise CaptureError(
            f"no breakable graph backend for device type {device_type!r} "
            f"(there are: {', '.join(sorted(_BACKENDS))})"
        )
    return backend


__all__ = [
    "CaptureStatus",
    "CudaBackend",
    "CudaPool",
    "GraphBackend",
    "Segment",
    "backend_for",
    "pool_id",
]
