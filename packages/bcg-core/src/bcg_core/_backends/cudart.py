"""CUDA capture queries that never hand the runtime an array it cannot answer for.

Two questions are asked: "is this stream capturing?" and "how many nodes has the graph it is
capturing into?" (used to skip empty segments). ``cudaStreamGetCaptureInfo`` answers both, but
its cuda-bindings wrapper always asks for the dependency (and, in 13.x, edge-data) arrays and
builds Python lists from them whenever the call succeeds, whatever the status; the runtime
fills those arrays only while the status is ACTIVE ("valid data is returned only if ... the
status is active"), and the array pointer lives only until the next call on the stream. A
process that had just had a capture invalidated died there with SIGSEGV (issue 21). So:

- the status comes from ``cudaStreamIsCapturing`` (status only, no handles);
- the node count comes from ``cudaStreamGetCaptureInfo`` called only after
  ``cudaStreamIsCapturing`` said ACTIVE (then its arrays are filled), and its graph handle goes
  to ``cudaGraphGetNodes`` (no node array) only when that call said ACTIVE too. (Hand-written
  ctypes calls of the driver's ``cuStreamGetCaptureInfo`` with NULL arrays, tried first,
  crashed on the H200 under two capturing threads: signatures the bindings own are safer.)
  When the bindings cannot tell, the count is unknown and no segment is treated as empty.

If cuda-bindings is missing or cannot talk to the driver, the status comes from torch's own
query (one warning, once).
"""

from __future__ import annotations

import threading
import warnings
from types import ModuleType
from typing import Any

import torch

from bcg_core._backends.seam import CaptureInfo, CaptureStatus


class CudaRuntimeError(RuntimeError):
    """A cuda-bindings call returned an error code."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed with {name} ({code})")
        self.code = code


def _as_int(value: Any) -> int:
    return int(getattr(value, "value", value))


def parse_is_capturing(result: tuple[Any, ...]) -> CaptureInfo:
    """Read ``cudaStreamIsCapturing``'s ``(err, status)``. Raises :class:`CudaRuntimeError`
    when the call itself failed."""
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(
            f"unexpected cudaStreamIsCapturing result {result!r}: expected (err, status)"
        )
    code = _as_int(result[0])
    if code != 0:
        raise CudaRuntimeError("cudaStreamIsCapturing", code, getattr(result[0], "name", "?"))
    return CaptureInfo(CaptureStatus(_as_int(result[1])))


_CAPTURE_IMPLICIT = 906  # cudaErrorStreamCaptureImplicit


class _Runtime:
    """Lazily loaded cuda-bindings runtime module; falls back to torch once, with a warning."""

    _MISSING_HELP = (
        "bcg_core needs cuda-bindings or a CUDA build of torch to query stream capture status. "
        "Install the bindings that match your driver, e.g. pip install 'cuda-bindings>=12.8,<14', "
        "or install a CUDA build of torch."
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._loaded = False
        self._warned = False

    def module(self) -> ModuleType | None:
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    try:
                        from cuda.bindings import runtime  # type: ignore[import-untyped]

                        self._module = runtime
                    except ImportError as exc:
                        self._fallback(f"cuda-bindings is not importable ({exc})")
                    self._loaded = True
        return self._module

    def _fallback(self, why: str) -> None:
        self._module = None
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"bcg_core: {why}; falling back to torch's capture query. Empty graph segments "
                "will be launched at replay. Install matching cuda-bindings to fix this.",
                RuntimeWarning,
                stacklevel=4,
            )

    def capture_info(self, stream: torch.cuda.Stream) -> CaptureInfo:
        rt = self.module()
        if rt is not None:
            try:
                handle = rt.cudaStream_t(stream.cuda_stream)
                return parse_is_capturing(rt.cudaStreamIsCapturing(handle))
            except CudaRuntimeError as exc:
                if exc.code == _CAPTURE_IMPLICIT:
                    # The legacy default stream, asked while another stream captures: it never
                    # captures itself (CUDA refuses the question, not the driver).
                    return CaptureInfo(CaptureStatus.NONE)
                with self._lock:
                    self._fallback(f"cuda-bindings cannot query the driver ({exc})")
            except (RuntimeError, TypeError) as exc:
                with self._lock:
                    self._fallback(f"cuda-bindings cannot query the driver ({exc})")
        try:
            with torch.cuda.stream(stream):
                capturing = torch.cuda.is_current_stream_capturing()
        except (RuntimeError, AssertionError, AttributeError) as exc:
            raise ImportError(self._MISSING_HELP) from exc
        return CaptureInfo(CaptureStatus.ACTIVE if capturing else CaptureStatus.NONE)

    def create_stream(self) -> int | None:
        """A new non-blocking stream on the current device, as its handle, or None when the
        bindings are missing or the call fails. The caller owns it."""
        rt = self.module()
        if rt is None:
            return None
        try:
            result = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
        except (RuntimeError, TypeError, AttributeError):
            return None
        if _as_int(result[0]) != 0:
            return None
        return int(result[1])

    def capture_node_count(self, stream: torch.cuda.Stream) -> int | None:
        """Nodes captured so far on ``stream``, or None when it is not capturing (ACTIVE) or the
        bindings cannot tell. ``cudaStreamGetCaptureInfo`` is called only after
        ``cudaStreamIsCapturing`` said ACTIVE on this thread: only then are the arrays its
        wrapper reads filled (see the module docstring)."""
        rt = self.module()
        if rt is None:
            return None
        try:
            handle = rt.cudaStream_t(stream.cuda_stream)
            if parse_is_capturing(rt.cudaStreamIsCapturing(handle)).status is not (
                CaptureStatus.ACTIVE
            ):
                return None
            info = rt.cudaStreamGetCaptureInfo(handle)
            if _as_int(info[0]) != 0 or CaptureStatus(_as_int(info[1])) is not (
                CaptureStatus.ACTIVE
            ):
                return None
            nodes = rt.cudaGraphGetNodes(info[3], 0)  # (err, graph) lead in 12.x and 13.x
        except (CudaRuntimeError, RuntimeError, TypeError, ValueError):
            return None
        if _as_int(nodes[0]) != 0:
            return None
        return _as_int(nodes[-1])


RUNTIME = _Runtime()
