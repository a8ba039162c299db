"""Exceptions raised by bcg_core, and the hint logged when a breakable capture fails."""

from __future__ import annotations

BCG_FAILURE_HINT = (
    "bcg: a breakable CUDA graph capture or replay failed. To rule bcg out, run the same code "
    "with BCG_DISABLE=1 (runners then run every call eagerly, enable_breakable_cuda_graph() "
    "leaves the flag off so model code takes its eager path, and captures refuse to start) or "
    "with enable_breakable_cuda_graph(False). To find the failing break, "
    "set BCG_DEBUG=1: every segment and break is logged (logger 'bcg_core') as it is captured, "
    "and the exception carries a note naming the segment and the last break before it. Host syncs "
    "(.item(), .tolist(), printing a tensor, data-dependent shapes) inside a graph segment must be "
    "moved into a function decorated with @eager_on_graph."
)


class BreakableGraphError(RuntimeError):
    """Base class for errors raised by bcg_core itself (never for errors raised by user code)."""


class CaptureError(BreakableGraphError):
    """A breakable capture could not start, or could not finish (nothing is left half-open)."""


class UnjoinedStreamError(CaptureError):
    """A side stream forked from the capturing stream was not joined back before a segment ended."""


class ConcurrentCaptureError(CaptureError):
    """A capture failed with a CUDA capture error while another thread had a capture open: in
    CUDA's "global" capture mode one thread's capture makes other threads' unsafe calls (an
    allocation, a synchronisation) fail and can invalidate captures. The captured code is
    probably not at fault; capture with ``capture_error_mode="thread_local"`` or one thread at
    a time. The original CUDA error is the ``__cause__``."""


class BreakOutputError(BreakableGraphError):
    """A break point returned something it may not: a CUDA tensor under ``strict=True``, or, at
    replay, tensors whose number, shapes or dtypes differ from those it returned at capture."""


class ReplayError(BreakableGraphError):
    """``replay()`` was called on a graph that holds no successful capture, or during a capture."""


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
