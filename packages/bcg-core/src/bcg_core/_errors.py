"""Exceptions raised by bcg_core, and the hint logged when a breakable capture fails."""

from __future__ import annotations

BCG_FAILURE_HINT = (
    "bcg: a breakable CUDA graph capture or replay failed. Rerun with BCG_DISABLE=1 to rule "
    "bcg out (every call then runs eagerly); set BCG_DEBUG=1 to log each segment and break "
    "(logger 'bcg_core'; the exception's note names the segment and the last break); move host "
    "syncs (.item(), .tolist(), printing a tensor, data-dependent shapes) out of graph segments "
    "into an @eager_on_graph function."
)

# torch's messages for work a CUDA capture refuses, and what to do about each.
_CAPTURE_REFUSALS = (
    (
        "Cannot copy between CPU and CUDA tensors during CUDA graph capture",
        "bcg: a segment copies a host tensor to the GPU (a tensor built on the CPU, then "
        ".to('cuda')): a graph would replay the capture's values. Build that tensor on the "
        "device or once before the capture, or move the code that makes it into an "
        "@eager_on_graph function.",
    ),
    (
        "Attempt to increase offset for a CUDA generator not in capture mode",
        "bcg: a segment draws from a private torch.Generator, which a graph draws from only if "
        "registered with it (bcg registers the default one): draw from the default generator "
        "(seeded by torch.manual_seed), or move the draw into an @eager_on_graph function.",
    ),
    (
        "operation not permitted when stream is capturing",
        "bcg: a segment synchronises with the host (.item(), .tolist(), .cpu(), printing a "
        "tensor, a data-dependent shape such as nonzero()): move that call into an "
        "@eager_on_graph function, or run this step eagerly.",
    ),
)


def capture_refusal_hint(exc: BaseException) -> str | None:
    """What to do about a raw CUDA capture refusal ``exc`` (torch's own error), or None."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, BreakableGraphError):
        return None
    text = str(exc)
    return next((hint for message, hint in _CAPTURE_REFUSALS if message in text), None)


class BreakableGraphError(RuntimeError):
    """Base class for errors raised by bcg_core itself (never for errors raised by user code).

    Catch it to tell bcg's own failures from the model's. A capture that fails with one leaves
    no capture state behind: the stream is out of capture mode, context variables and stream
    hooks are reset, and the graph is in the failed state, ready for ``reset()``. To rule bcg
    out, rerun with ``BCG_DISABLE=1``; to find the failing break, set ``BCG_DEBUG=1`` (see
    :data:`BCG_FAILURE_HINT`).
    """


class CaptureError(BreakableGraphError):
    """A breakable capture could not start, or could not finish (nothing is left half-open).

    Raised when a capture starts while breakable graphs are disabled (``BCG_DISABLE=1``,
    :func:`disable_breakable_graphs`), inside another capture, into a graph that already holds a
    capture (call :meth:`BreakableCUDAGraph.reset` first), on a stream that is already capturing,
    or where the backend has no device (no CUDA); when a break is reached on another thread than
    the segment's without ``capture_error_mode="relaxed"``; when a break leaves a fresh device
    tensor alive under ``debug="strict"``; when the CPU backend meets a host sync
    (:class:`HostSyncError`); when a :func:`breakable_attention` implementation meets a
    sliding-window layer it cannot capture (not a ``StaticCache``'s, a step of several tokens,
    a compiled step); when a runner's step changes a container argument (its signature then
    runs eagerly); and by :func:`check_divergence` called inside a capture. The
    message says what to do: run eagerly, capture again after ``reset()``, or move the call
    into an :func:`eager_on_graph` break.
    """


class UnjoinedStreamError(CaptureError):
    """A side stream forked from the capturing stream was not joined back before a segment ended.

    Raised at the end of a segment (at a break or at the end of the capture) when work was put
    on a side stream that waited on the capturing stream but the capturing stream never waited
    on it, and ``auto_join=False``, or when CUDA still reports unjoined work as the segment
    ends. The message names the stream(s). Make the capturing stream wait on the side stream
    (``torch.cuda.current_stream().wait_stream(side)`` or an event) before the break, or leave
    ``auto_join=True``.
    """


class ConcurrentCaptureError(CaptureError):
    """A capture failed with a CUDA capture error while another thread had a capture open.

    Capture with ``capture_error_mode="thread_local"`` or one thread at a time: in CUDA's
    "global" capture mode one thread's capture makes other threads' unsafe calls (an
    allocation, a synchronisation) fail and can invalidate captures, so the captured code is
    probably not at fault. The original CUDA error is the ``__cause__``.
    """


class BreakOutputError(BreakableGraphError):
    """A break point returned something it may not.

    Raised at capture when an :func:`eager_on_graph` function with ``strict=True`` returns a
    device tensor, and at replay when a break returns another structure, or tensors whose number,
    shapes or dtypes differ from those it returned at capture (the next segment was recorded
    against those). Return the same structure every call, write the result into a buffer passed
    as an argument, or capture a graph per shape.
    """


class ReplayError(BreakableGraphError):
    """``replay()`` or ``reset()`` was called when the graph cannot do it.

    Raised by :meth:`BreakableCUDAGraph.replay` on a graph that holds no successful capture (never
    captured, reset, or its capture failed) or that is being captured, and by
    :meth:`BreakableCUDAGraph.reset` during that graph's capture; the CPU backend also raises it
    when a segment read a 0-dim tensor from outside the graph whose value changed since capture.
    Capture the graph (again) first, or replay after the ``with`` block of the capture exited.
    """


class HostSyncError(CaptureError):
    """A graph segment needed a value on the host (``.item()``, ``.tolist()``, printing a tensor,
    a data-dependent output shape): what CUDA reports as "operation not permitted when stream is
    capturing". Raised by the CPU graph backend, which enforces CUDA's capture rules; ``op`` names
    the operation and ``location`` the user's source line (``file:line``) when known."""

    def __init__(self, message: str, op: str, location: str | None) -> None:
        super().__init__(message)
        self.op = op
        self.location = location

    def __reduce__(self) -> tuple[type[HostSyncError], tuple[str, str, str | None]]:
        return (type(self), (str(self), self.op, self.location))
