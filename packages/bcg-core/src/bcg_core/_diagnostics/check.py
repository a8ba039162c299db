"""check_capture: would this callable capture as a breakable CUDA graph? Answered on the CPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bcg_core._capture.capture import BreakableCUDAGraphCapture
from bcg_core._capture.flag import enable_breakable_cuda_graph
from bcg_core._capture.graph import BreakableCUDAGraph
from bcg_core._errors import BreakableGraphError, HostSyncError


@dataclass(frozen=True)
class CaptureCheck:
    """The outcome of :func:`check_capture`; ``str()`` of it says what to do.

    Attributes:
        ok: True when the capture succeeded.
        segments: the graph's segment count (0 when the capture failed).
        breaks: the graph's break count (0 when the capture failed).
        error: on failure, the message (with the note saying in which segment it was raised).
        op: for a host synchronisation, the operation (``aten._local_scalar_dense.default``,
            ``Tensor.tolist`` ...).
        location: for a host synchronisation, the user's source line as ``file:line``.
    """

    ok: bool
    segments: int
    breaks: int
    error: str | None = None
    op: str | None = None
    location: str | None = None

    def __str__(self) -> str:
        if self.ok:
            return f"captures cleanly, {self.segments} segments ({self.breaks} breaks)"
        if self.op is not None:
            where = f" at {self.location}" if self.location else ""
            return (
                f"host synchronisation inside a graph segment: {self.op}{where} (operation not "
                "permitted when stream is capturing); move it into an @eager_on_graph break point"
            )
        return f"capture failed: {self.error}"


def check_capture(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> CaptureCheck:
    """Capture ``fn(*args, **kwargs)`` once with the CPU graph backend and report the outcome.

    The call runs under :func:`enable_breakable_cuda_graph` inside a capture into
    ``BreakableCUDAGraph(backend="cpu")``, which enforces CUDA's capture rules: the first host
    synchronisation inside a graph segment (``.item()``, ``.tolist()``, printing a tensor,
    ``nonzero`` ...) ends the check with ``ok=False``, naming the operation and the source line.
    Use CPU tensors (a model moved to the CPU). ``fn`` really runs once (breaks included), so it
    may update caches or other state; the graph is discarded afterwards.

    Errors that bcg_core raises (:class:`BreakableGraphError`, e.g. a strict break returning a
    tensor) are reported with ``ok=False`` too; any other exception from ``fn`` propagates.

    Args:
        fn: the callable to check (positional only), typically a model or its forward.
        *args: positional arguments for ``fn`` (CPU tensors).
        **kwargs: keyword arguments for ``fn``.

    Returns:
        A ``CaptureCheck``: ``ok``, the segment and break counts, and on failure the error
        message, the host-sync operation and its source line; ``str()`` of it is one line.

    Raises:
        TypeError: ``fn`` is not callable (before anything runs).
        Exception: whatever ``fn`` raises that is not a :class:`BreakableGraphError`.
    """
    if not callable(fn):
        # (It raised the raw "'int' object is not callable" from inside the capture, after
        # logging the capture-failure hint.)
        raise TypeError(f"check_capture needs a callable (a model or a function), got {fn!r}")
    graph = BreakableCUDAGraph(backend="cpu")
    failed: CaptureCheck | None = None
    with enable_breakable_cuda_graph():
        try:
            with BreakableCUDAGraphCapture(graph):
                fn(*args, **kwargs)
        except BreakableGraphError as exc:
            # The outcome, not the error, outlives the except block: a local holding the error
            # made a cycle (its traceback holds this frame) that left the graph, its recorder
            # and the call's tensors to the garbage collector.
            failed = failed_check(exc)
    try:
        if failed is None:
            return CaptureCheck(ok=True, segments=graph.num_segments, breaks=graph.num_breaks)
        return failed
    finally:
        graph.reset()


def failed_check(failure: BreakableGraphError) -> CaptureCheck:
    """The :class:`CaptureCheck` of a failed capture: its message with its notes, and for a
    host synchronisation the operation and the source line."""
    notes = getattr(failure, "__notes__", ())
    error = "; ".join([str(failure), *notes])
    if isinstance(failure, HostSyncError):
        return CaptureCheck(False, 0, 0, error, failure.op, failure.location)
    return CaptureCheck(False, 0, 0, error)
