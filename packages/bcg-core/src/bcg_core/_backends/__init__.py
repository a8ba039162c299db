"""Device backends behind the seam (``seam.py``), and the registry that picks one.

This module is the only place that knows every backend: ``cuda.py`` (with its cuda-bindings
wrapper ``cudart.py``) and ``cpu.py`` (with its recorder ``cpu_recorder.py``) import the seam,
never each other, so a new backend (``torch.accelerator.Graph``, say) is one module plus one line
here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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

# In order of preference: accelerators first, the host (CPU) backend last. Runtime code outside
# this package never names a backend; it asks one of the functions below.
_BACKENDS: dict[str, GraphBackend] = {"cuda": CudaBackend(), "cpu": CpuBackend()}
_HOST = _BACKENDS["cpu"]


def backend_for(device_type: str = "cuda") -> GraphBackend:
    """The backend for a device type: "cuda" or "cpu"; :class:`CaptureError` for another."""
    backend = _BACKENDS.get(device_type)
    if backend is None:
        raise CaptureError(
            f"no breakable graph backend for device type {device_type!r} "
            f"(there are: {', '.join(sorted(_BACKENDS))})"
        )
    return backend


def backend_named(name: str) -> GraphBackend:
    """The backend a user named (``BreakableCUDAGraph(backend=...)``); ValueError for another."""
    backend = _BACKENDS.get(name)
    if backend is None:
        names = " or ".join(repr(n) for n in _BACKENDS)
        raise ValueError(
            f"backend must be {names} (the device whose graphs are captured), got {name!r}"
        )
    return backend


def backend_for_device(device: Any) -> GraphBackend:
    """The backend that captures tensors on ``device`` (a ``torch.device``); ValueError for a
    device type no backend captures. (It used to fall back to CUDA's: a runner on "mps" ran
    eagerly saying "no CUDA device is available", or on a CUDA machine tried to capture.)"""
    backend = _BACKENDS.get(device.type)
    if backend is None:
        raise ValueError(
            f"no breakable graph backend for device type {device.type!r} (there are: "
            f"{', '.join(sorted(_BACKENDS))}); run the model without bcg on this device"
        )
    return backend


def backend_for_tensors(tensors: Iterable[Any]) -> GraphBackend:
    """The preferred backend among those whose device holds one of ``tensors``; the host
    backend when none does (no tensors, or host tensors only)."""
    types = {t.device.type for t in tensors}
    return next((b for b in _BACKENDS.values() if b.device_type in types), _HOST)


def current_stream(device: Any = None) -> Any:
    """Torch's current stream on the first available backend (outside a capture, the stream a
    replay runs on)."""
    backend = next(b for b in _BACKENDS.values() if b.is_available())
    return backend.current_stream(device)


__all__ = [
    "CaptureInfo",
    "CaptureStatus",
    "DeviceEvent",
    "GraphBackend",
    "Segment",
    "StreamEvents",
    "StreamObserver",
    "backend_for",
    "backend_for_device",
    "backend_for_tensors",
    "backend_named",
    "current_stream",
    "pool_id",
    "record_source_locations",
]
