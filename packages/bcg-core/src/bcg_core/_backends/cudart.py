"""CUDA capture queries that never hand the runtime an array it cannot answer for.

Two questions are asked: "is this stream capturing?" and "how many nodes has the graph it is
capturing into?" (used to skip empty segments). ``cudaStreamGetCaptureInfo`` answers both, but
its cuda-bindings wrapper always asks for the dependency (and, in 13.x, edge-data) arrays and
builds Python lists from them whenever the call succeeds, whatever the status; the runtime
fills those arrays only while the status is ACTIVE ("valid data is returned only if ... the
status is active"), and the array pointer lives only until the next call on the stream. A
process that had just had a capture invalidated died there with SIGSEGV (issue 21). So:

- the status comes from ``cudaStreamIsCapturing`` (status only, no handles);
- the node count comes from the driver's ``cuStreamGetCaptureInfo`` through ctypes, with NULL
  for every array (``_v3``, else ``_v2``: the same leading parameters), and the graph handle is
  read, and handed to ``cuGraphGetNodes`` with a NULL node array, only when that same call said
  ACTIVE. Without a loadable driver library the count is unknown and no segment is empty.

If cuda-bindings is missing or cannot talk to the driver, the status comes from torch's own
query (one warning, once).
"""

from __future__ import annotations

import ctypes
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


class _Driver:
    """``cuStreamGetCaptureInfo`` and ``cuGraphGetNodes`` from the driver library, called
    with NULL for every output array (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded = False
        self._info: Any = None
        self._info_arrays = 0  # NULL array parameters after graph_out: 3 for _v3, 2 for _v2
        self._nodes: Any = None

    def _load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError:
                return
            symbols = (("cuStreamGetCaptureInfo_v3", 3), ("cuStreamGetCaptureInfo_v2", 2))
            for symbol, arrays in symbols:
                info = getattr(lib, symbol, None)
                if info is not None:
                    # (stream, status*, id*, graph*, then the arrays and the count) -> CUresult
                    info.argtypes = [ctypes.c_void_p] * (4 + arrays)
                    info.restype = ctypes.c_int
                    self._info, self._info_arrays = info, arrays
                    break
            nodes = getattr(lib, "cuGraphGetNodes", None)
            if nodes is not None:
                nodes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
                nodes.restype = ctypes.c_int
                self._nodes = nodes

    def capture_node_count(self, stream_handle: int) -> int | None:
        """Nodes in the graph ``stream_handle`` is capturing into; None when the stream is not
        capturing (ACTIVE) or the driver cannot be asked."""
        if not self._loaded:
            self._load()
        if self._info is None or self._nodes is None:
            return None
        status = ctypes.c_int(-1)
        graph = ctypes.c_void_p()
        nulls = (None,) * self._info_arrays
        code = self._info(
            ctypes.c_void_p(stream_handle), ctypes.byref(status), None, ctypes.byref(graph), *nulls
        )
        if code != 0 or status.value != CaptureStatus.ACTIVE or not graph.value:
            return None
        count = ctypes.c_size_t(0)
        if self._nodes(graph, None, ctypes.byref(count)) != 0:
            return None
        return int(count.value)


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
        """Nodes captured so far on ``stream``, or None when the driver cannot tell."""
        return _DRIVER.capture_node_count(stream.cuda_stream)


_DRIVER = _Driver()
RUNTIME = _Runtime()
