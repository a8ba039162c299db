"""Who is capturing or replaying right now, and on which stream.

Capture and replay state live in context variables, so threads and asyncio tasks never see each
other's captures. One exception needs a lock: autograd runs backward on its own worker thread,
which does not inherit the caller's context but does run on the stream the forward used. A small
registry maps capturing streams to their capture so that a break point called from backward
during capture still finds it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

import torch

from bcg_core._backends import GraphBackend, backend_for, current_stream
from bcg_core._context_reset import reset_var
from bcg_core._errors import CaptureError

if TYPE_CHECKING:
    from bcg_core._capture.capture import CaptureState

_CAPTURE: ContextVar[CaptureState | None] = ContextVar("bcg_core_capture", default=None)

_registry_lock = threading.Lock()
_by_stream: dict[int, CaptureState] = {}


def active_capture() -> CaptureState | None:
    """The capture running in this context, or on this thread's current stream, or None."""
    state = _CAPTURE.get()
    if state is not None and not state.closed:
        return state
    if not _by_stream:
        return None
    with _registry_lock:
        backends = {state.backend.name: state.backend for state in _by_stream.values()}
    for backend in backends.values():
        try:
            handle = backend.current_stream().cuda_stream
        except (RuntimeError, AssertionError):
            continue
        with _registry_lock:
            found = _by_stream.get(handle)
        if found is not None:
            return found
    return None


def enter_capture(state: CaptureState, stream_handle: int) -> Token[CaptureState | None]:
    with _registry_lock:
        _by_stream[stream_handle] = state
    return _CAPTURE.set(state)


def exit_capture(
    state: CaptureState, token: Token[CaptureState | None], stream_handle: int
) -> None:
    state.closed = True
    with _registry_lock:
        _by_stream.pop(stream_handle, None)
    reset_var(token)


def captures_on_other_threads(thread: int) -> list[CaptureState]:
    """The captures open right now on threads other than ``thread``."""
    with _registry_lock:
        return [s for s in _by_stream.values() if s.thread != thread]


def is_breakable_capture_active() -> bool:
    """Whether a breakable capture is running right now in this context.

    Unlike :func:`is_in_breakable_cuda_graph` (a routing flag for the whole block), this asks
    about the capture itself; a break called from autograd's backward thread during a capture
    still sees it, through the capturing stream.

    Returns:
        True inside graph segments and inside the eager breaks executed at capture; False
        during replay and outside any capture.
    """
    return active_capture() is not None


def get_current_stream(device: torch.device | str | int | None = None) -> Any:
    """The stream work should go to right now.

    Args:
        device: the device whose current stream is wanted when no capture is running (a
            ``torch.device``, a string such as ``"cuda:1"`` or ``"cpu"``, a CUDA index, or
            None, the default, for the current device). Checked always; otherwise ignored
            during a capture.

    Returns:
        The capturing stream during a breakable capture; during a replay, the replay stream
        (replay runs on the caller's current stream); else torch's current stream for
        ``device`` (for ``"cpu"``, the CPU graph backend's current stream).

    Raises:
        ValueError: ``device`` names no device (``"bogus"``, a negative index) or a device
            type without a graph backend (``"mps"``).
        TypeError: ``device`` is not a ``torch.device``, a string, an int or None.
        RuntimeError: ``device`` is a CUDA device (or an index) and CUDA is not available.
    """
    state = active_capture()
    if device is None:
        # Replay runs on the caller's current stream and never switches: the replay stream.
        return current_stream() if state is None else state.stream
    try:
        backend = _checked_devices.get(device)
    except TypeError:  # unhashable: _backend_of says what is wrong with it
        backend = None
    if backend is None:
        backend = _backend_of(device)  # also during a capture: its replays would refuse it
    return backend.current_stream(device) if state is None else state.stream


# Device arguments of get_current_stream already checked, with the backend whose stream they
# ask for, so a break that asks for its device's stream at every replay parses it once. A
# backend, once available, stays so.
_checked_devices: dict[Any, GraphBackend] = {}
_checked_lock = threading.Lock()  # writers only: a lookup is one dict read
_CHECKED_KEPT = 64


def _backend_of(device: Any) -> GraphBackend:
    """The graph backend whose stream ``device`` asks for (an index: the accelerator's); raises
    as :func:`get_current_stream` documents."""
    if isinstance(device, int):
        if device < 0:
            raise ValueError(
                f"get_current_stream: a device index must not be negative, got {device}"
            )
        backend = backend_for()  # an index names an accelerator (CUDA) device
    elif isinstance(device, str | torch.device):
        try:
            device_type = torch.device(device).type
        except RuntimeError as exc:
            raise ValueError(f"get_current_stream: {device!r} is not a device ({exc})") from None
        try:
            backend = backend_for(device_type)
        except CaptureError as exc:
            raise ValueError(
                f"get_current_stream: {device!r} has no graph streams: {exc}"
            ) from None
    else:
        raise TypeError(
            "get_current_stream: device must be a torch.device, a string such as 'cuda:1', a "
            f"CUDA index or None, got {device!r}"
        )
    if not backend.is_available():
        raise RuntimeError(
            f"get_current_stream: {device!r} is a {backend.device_type!r} device, but none is "
            f"available here (torch {torch.__version__}); ask for None, the current device"
        )
    with _checked_lock:
        if len(_checked_devices) < _CHECKED_KEPT:
            _checked_devices[device] = backend
    return backend


# -- warm-ups routed to a pool (BreakableCUDAGraph.warmup) --------------------------------------
# A break called in one runs outside the pool: its temporaries are not graph memory (a replay
# allocates them outside the pool), and a pool never gives memory back.
OutsidePool = Callable[[], AbstractContextManager[None]]
_OUTSIDE_POOL: ContextVar[OutsidePool | None] = ContextVar("bcg_core_outside_pool", default=None)
_warmup_lock = threading.Lock()
_routed_warmups = 0  # blocks open in any context; the eager break path reads only this


@contextlib.contextmanager
def routed_warmup(outside: OutsidePool) -> Iterator[None]:
    """Mark this context as warming up with its allocations routed to a pool; ``outside()``
    suspends that routing (the backend's ``allocate_outside_pool``)."""
    global _routed_warmups
    with _warmup_lock:
        _routed_warmups += 1
    token = _OUTSIDE_POOL.set(outside)
    try:
        yield
    finally:
        # reset_var: a warm-up held across a yield can be left in another context, where a
        # raw reset raised before the count was released (every break then looked for a pool).
        reset_var(token)
        with _warmup_lock:
            _routed_warmups -= 1


def warmup_outside_pool() -> OutsidePool | None:
    """In a routed warm-up of this context, the way out of its pool for a break; else None."""
    return _OUTSIDE_POOL.get() if _routed_warmups else None


@contextlib.contextmanager
def outside_pool(outside: OutsidePool) -> Iterator[None]:
    """Run a warm-up's break outside its pool (breaks nested in it are already outside)."""
    token = _OUTSIDE_POOL.set(None)
    try:
        with outside():
            yield
    finally:
        reset_var(token)
