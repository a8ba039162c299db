"""The CPU graph backend: breakable graphs on CPU tensors, with CUDA graph capture rules.

A CPU "graph" segment is the list of aten operations the segment issued, recorded at the
dispatch level (see ``cpu_recorder.py``), replayed by re-running them against the same storage.
It implements the ``Segment`` and ``GraphBackend`` protocols of ``seam.py``, so capture and
replay code runs unchanged: ``BreakableCUDAGraph(backend="cpu")``, ``backend_for("cpu")`` and
``BreakableGraphRunner(device="cpu")`` select it.

Streams are stand-ins that carry what the capture logic asks of a stream: a ``cuda_stream``
handle unique per stream object (negative, so it can never equal a CUDA stream handle in the
capture registry), and ``wait_stream``/``wait_event``/``synchronize`` that do nothing (CPU work
is synchronous). The current CPU stream is a context variable; ``stream_context`` sets it.

Pools are tokens: the memory of a CPU graph is the set of tensors its segments hold (every
tensor a replay step reads or writes), released when the segments are reset or collected.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any

import torch

from bcg_core._backends.cpu_recorder import (
    HostScalar,
    LocatingRecorder,
    Recorder,
    Step,
    WrittenStorages,
    host_wait,
    new_recorder,
)
from bcg_core._backends.seam import CaptureInfo, CaptureStatus, StreamObserver
from bcg_core._context_reset import reset_var
from bcg_core._errors import CaptureError, HostSyncError

_stream_ids = itertools.count(1)


class CpuStream:
    """A CPU stand-in for a CUDA stream: an identity, a capture slot and no-op waits."""

    def __init__(self) -> None:
        self.cuda_stream: int = -next(_stream_ids)
        self.device = torch.device("cpu")
        self.capturing: CpuSegment | None = None

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for: CPU work is synchronous."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for: CPU work is synchronous."""

    def synchronize(self) -> None:
        """Nothing to wait for (CPU work is synchronous); inside a graph segment a
        :class:`HostSyncError`, as CUDA refuses a stream synchronisation in a capture."""
        host_wait("Stream.synchronize")

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<bcg_core CPU stream {-self.cuda_stream}>"


class CpuEvent:
    """A CPU stand-in for a CUDA event: CPU work is synchronous, so there is nothing to order."""

    def record(self, stream: Any = None) -> None:
        """Nothing to mark: CPU work is done when it returns."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for: CPU work is synchronous."""

    def synchronize(self) -> None:
        """Nothing to wait for (CPU work is synchronous); inside a graph segment a
        :class:`HostSyncError`, as CUDA refuses an event synchronisation in a capture."""
        host_wait("Event.synchronize")


_DEFAULT_STREAM = CpuStream()
_CURRENT: ContextVar[CpuStream | None] = ContextVar("bcg_core_cpu_stream", default=None)


def current_cpu_stream() -> CpuStream:
    """The CPU stream set by the innermost ``stream_context`` in this context, else the default."""
    return _CURRENT.get() or _DEFAULT_STREAM


@contextlib.contextmanager
def _use_stream(stream: CpuStream) -> Iterator[CpuStream]:
    token = _CURRENT.set(stream)
    try:
        yield stream
    finally:
        reset_var(token)  # left in another context: see reset_var


def _not_a_cpu_stream(stream: Any) -> str:
    return (
        # (It named backend_for('cpu').new_stream(), which bcg_core does not export.)
        f"the CPU graph backend captures on its own streams, got {stream!r}; leave "
        "stream=None (the pool's capture lane)"
    )


def _as_cpu_stream(stream: Any) -> CpuStream:
    if not isinstance(stream, CpuStream):
        raise CaptureError(_not_a_cpu_stream(stream))
    return stream


class CpuPool:
    """A CPU graph pool: a token (each segment holds the tensors it replays on) that also keeps
    the storages its captures write, so the recorder can tell memory of the graph (outputs of its
    ops and breaks) from values that come from outside it."""

    def __init__(self) -> None:
        self.graph_memory = WrittenStorages()
        # The stream captures into this pool run on when the caller names none, as a CUDA
        # pool's lane: one per pool, so a runner's ``stream`` is the stream it captures on.
        self.lane = CpuStream()

    def __repr__(self) -> str:
        return f"<bcg_core CPU graph pool at {id(self):#x}>"


class CpuSegment:
    """One recorded CPU segment; ``replay`` re-runs its steps below autograd and autocast."""

    def __init__(self) -> None:
        self._recorder: Recorder | None = None
        self._stream: CpuStream | None = None
        self._steps: tuple[Step, ...] = ()
        self._host_scalars: tuple[HostScalar, ...] = ()
        self._locations: tuple[str, ...] = ()
        self._empty = False

    @property
    def empty(self) -> bool:
        return self._empty

    @property
    def invalidated(self) -> bool:
        """True while capturing after a host synchronisation (CUDA: capture invalidated)."""
        return self._recorder is not None and self._recorder.error is not None

    @property
    def capture_id(self) -> int | None:
        return None if self._recorder is None else self._recorder.capture_id

    @property
    def source_locations(self) -> tuple[str, ...]:
        """The distinct user source lines (``file:line``, in first-use order) of this segment's
        operations; empty unless captured inside ``record_source_locations()``."""
        return self._locations

    def capture_begin(self, pool: Any, capture_error_mode: str) -> None:
        stream = current_cpu_stream()
        if stream is _DEFAULT_STREAM:
            # torch's CUDAGraph.capture_begin refuses the default stream; refused here too, so
            # code that captures on get_current_stream() fails on CPU as it will on CUDA.
            raise CaptureError(
                "CUDA graphs must be captured on a non-default stream, and so are CPU graphs: "
                "leave stream=None (the pool's capture lane)"
            )
        if stream.capturing is not None:
            raise CaptureError(f"{stream!r} is already capturing")
        recorder = new_recorder(pool.graph_memory if isinstance(pool, CpuPool) else None)
        recorder.start()
        self._recorder, self._stream = recorder, stream
        stream.capturing = self

    def capture_end(self) -> None:
        recorder, stream = self._recorder, self._stream
        if recorder is None or stream is None:
            return  # not capturing (already ended, e.g. by a failed end and then an abort)
        try:
            recorder.stop()
        finally:
            self._recorder = None
            stream.capturing = None
        # Taken from the recorder: the error's traceback holds the recorder (a cycle that kept
        # its recorded steps and tensors until the garbage collector ran).
        error, recorder.error = recorder.error, None
        if error is not None and not isinstance(error, HostSyncError):
            raise CaptureError(f"capture invalidated: {error}") from error
        if error is not None:
            raise HostSyncError(
                f"operation failed due to previous error during capture: {error}",
                error.op,
                error.location,
            ) from error
        self._steps = tuple(recorder.steps)
        self._host_scalars = tuple(recorder.host_scalars)
        if isinstance(recorder, LocatingRecorder):
            self._locations = tuple(dict.fromkeys(recorder.locations))
        self._empty = not self._steps

    def launcher(self) -> Callable[[], None]:
        """Replay the steps; a segment that read 0-dim tensors from outside the graph first
        checks they still hold their capture-time values (see ``HostScalar``)."""
        steps: tuple[Step, ...] = self._steps
        if self._host_scalars:
            steps = (*(s.check for s in self._host_scalars), *steps)
        below_autograd = torch._C._AutoDispatchBelowADInplaceOrView
        no_autocast = torch._C._DisableAutocast

        def launch() -> None:
            with below_autograd(), no_autocast():
                for step in steps:
                    step()

        return launch

    def reset(self) -> None:
        self._steps = ()
        self._host_scalars = ()
        self._locations = ()


class CpuBackend:
    """Graph backend for CPU tensors (recorded aten segments; see the module docstring)."""

    name = "cpu"
    device_type = "cpu"
    alias_device_types: frozenset[str] = frozenset()
    executes_at_capture = True
    refuses_compiles = False

    def is_available(self) -> bool:
        return True

    def prepare(self) -> None:
        """Nothing is loaded lazily."""

    def capture_stream(self, pool: Any, device: Any) -> CpuStream:
        """The pool's lane (no CPU library caches memory per stream, but a runner's ``stream``
        and the stream ``get_current_stream()`` names at capture must be one stream)."""
        return pool.lane if isinstance(pool, CpuPool) else CpuStream()

    def check_available(self) -> None:
        """Always available."""

    def new_segment(self) -> CpuSegment:
        return CpuSegment()

    def check_pool(self, pool: Any) -> None:
        if not isinstance(pool, CpuPool):
            raise TypeError(
                f"the CPU graph backend captures into its own pools, got {pool!r}; pass another "
                "CPU graph's pool(), or leave pool=None"
            )

    def check_stream(self, stream: Any) -> None:
        if not isinstance(stream, CpuStream):
            raise TypeError(_not_a_cpu_stream(stream))

    def new_pool(self) -> CpuPool:
        return CpuPool()

    def new_stream(self, device: Any = None) -> CpuStream:
        return CpuStream()

    def current_stream(self, device: Any = None) -> CpuStream:
        return current_cpu_stream()

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        return _use_stream(_as_cpu_stream(stream))

    def new_event(self) -> CpuEvent:
        return CpuEvent()

    def capture_info(self, stream: Any) -> CaptureInfo:
        segment = _as_cpu_stream(stream).capturing
        if segment is None:
            return CaptureInfo(CaptureStatus.NONE)
        status = CaptureStatus.INVALIDATED if segment.invalidated else CaptureStatus.ACTIVE
        return CaptureInfo(status, segment.capture_id)

    def synchronize(self, streams: Sequence[Any] | None = None) -> None:
        """Nothing to wait for (CPU work is synchronous); inside a graph segment a
        :class:`HostSyncError`, as CUDA refuses a synchronisation in a capture."""
        host_wait("synchronize")

    def recover_after_failure(self, pool: Any) -> None:
        """Nothing is routed to CPU pools."""

    def install_stream_hooks(self, observer: StreamObserver) -> Callable[[], None]:
        """CPU streams are synchronous stand-ins: there is nothing to fork, join or wait for."""
        return _no_hooks

    def pool_bytes(self, pool: Any) -> int | None:
        """Unknown: a CPU pool is a token (its segments hold their tensors)."""
        return None

    def note_graph_memory(self, pool: Any, tensors: Sequence[Any]) -> None:
        if isinstance(pool, CpuPool):
            pool.graph_memory.add(tensors)

    def range_push(self, name: str) -> None:
        """No device timeline: ``torch.profiler.record_function`` names CPU steps already."""

    def range_pop(self) -> None:
        """No device timeline (see :meth:`range_push`)."""

    def count_pool_growth(self, pool: Any, device: Any) -> AbstractContextManager[None]:
        """Counts nothing: a CPU pool is a token, not memory."""
        return contextlib.nullcontext()

    def allocate_to_pool(self, pool: Any, device: Any) -> AbstractContextManager[bool]:
        """Routes nothing (yields False): a CPU pool is a token, so the capture holds a break's
        output strongly, and each segment holds the tensors it replays on."""
        return contextlib.nullcontext(False)

    def allocate_outside_pool(self, pool: Any, device: Any) -> AbstractContextManager[None]:
        """Nothing is routed on the CPU (see :meth:`allocate_to_pool`)."""
        return contextlib.nullcontext()

    def not_pool_growth(self, pool: Any, device: Any) -> AbstractContextManager[None]:
        """Nothing is counted on the CPU (see :meth:`count_pool_growth`)."""
        return contextlib.nullcontext()


def _no_hooks() -> None:
    """Nothing was installed."""


__all__ = ["CpuBackend", "CpuEvent", "CpuPool", "CpuSegment", "CpuStream", "current_cpu_stream"]
