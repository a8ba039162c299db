"""CUDA runtime queries through cuda-bindings (the cuda-python project), with a torch fallback.

Only two questions are asked of the runtime: "is this stream capturing, and into which graph?"
(``cudaStreamGetCaptureInfo``) and "how many nodes does that graph hold?" (``cudaGraphGetNodes``,
used to skip empty segments). The result tuple of ``cudaStreamGetCaptureInfo`` is
``(err, status, id, graph, deps, numDeps)`` in cuda-bindings 12.x and gained ``edgeData`` before
``numDeps`` in 13.x; :func:`parse_capture_info` reads only the leading fields both share.

If cuda-bindings is missing or cannot talk to the driver, the status comes from torch's own query
(one warning, once) and node counts are unknown, so no segment is treated as empty.
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


def parse_capture_info(result: tuple[Any, ...]) -> CaptureInfo:
    """Read ``cudaStreamGetCaptureInfo``'s result tuple from cuda-bindings 12.x (6 fields) or
    13.x (7 fields). Raises :class:`CudaRuntimeError` when the call itself failed."""
    if not isinstance(result, tuple) or len(result) not in (6, 7):
        raise TypeError(
            f"unexpected cudaStreamGetCaptureInfo result {result!r}: expected the 6-tuple of "
            "cuda-bindings 12.x or the 7-tuple of 13.x"
        )
    code = _as_int(result[0])
    if code != 0:
        raise CudaRuntimeError("cudaStreamGetCaptureInfo", code, getattr(result[0], "name", "?"))
    status = CaptureStatus(_as_int(result[1]))
    if status is not CaptureStatus.ACTIVE:
        return CaptureInfo(status)
    return CaptureInfo(status, _as_int(result[2]), result[3])


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
                return parse_capture_info(rt.cudaStreamGetCaptureInfo(handle))
            except (CudaRuntimeError, RuntimeError, TypeError) as exc:
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

    def graph_node_count(self, graph: Any) -> int | None:
        """Nodes in a graph being captured, or None when the bindings cannot tell."""
        rt = self.module()
        if rt is None or graph is None:
            return None
        result = rt.cudaGraphGetNodes(graph, 0)
        if _as_int(result[0]) != 0:
            return None
        return _as_int(result[-1])


RUNTIME = _Runtime()
