"""Device backends behind the seam (``seam.py``), and the registry that picks one.

This module is the only place that knows every backend: ``cuda.py`` (with its cuda-bindings
wrapper ``cudart.py``) and ``cpu.py`` (with its recorder ``cpu_recorder.py``) import the seam,
never each other, so a new backend (``torch.accelerator.Graph``, say) is one module plus one line
here.
"""

from __future__ import annotations

from bcg_core._backends.cpu import CpuBackend
from bcg_core._backends.cpu_recorder import record_source_locations
from bcg_core._backends.cuda import CudaBackend
from bcg_core._backends.seam import (
    CaptureInfo,
    CaptureStatus,
    DeviceEvent,
    GraphBackend,
    Segment,
    StreamEvents,
    StreamObserver,
    pool_id,
)
from bcg_core._errors import CaptureError

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
    "CaptureInfo",
    "CaptureStatus",
    "DeviceEvent",
    "GraphBackend",
    "Segment",
    "StreamEvents",
    "StreamObserver",
    "backend_for",
    "pool_id",
    "record_source_locations",
]
