"""The thread-local modes a break ran under at capture, which its replays run under again.

A graph segment bakes the kernels the capture's modes chose (autocast's bf16 matmul, inference
tensors); a break re-runs Python at every replay and would choose again under the caller's
modes: a graph captured under ``torch.autocast`` and replayed outside it recomputed its breaks
in float32 (a silent difference, or another dtype than the bridge holds), and one captured in
inference mode wrote inference bridges outside it (torch's raw error). So each break step keeps
its capture-time :data:`Modes`, and a replay under other modes runs that break under its own.
Reading the modes costs two C calls, once per replay of a graph with breaks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Device types whose autocast state is kept (the ones torch's autocast serves on our backends).
_DEVICE_TYPES = ("cuda", "cpu")

# (inference mode, autocast state or None when autocast is off everywhere). The autocast state
# is, per device type, (enabled, dtype), then whether autocast caches casts.
Modes = tuple[bool, tuple[Any, ...] | None]


def autocast_state() -> tuple[Any, ...] | None:
    """The calling thread's autocast state; None (one C call) when autocast is off."""
    if not torch._C._is_any_autocast_enabled():
        return None
    amp = tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _DEVICE_TYPES)
    return (*amp, torch.is_autocast_cache_enabled())


def current_modes() -> Modes:
    """The calling thread's inference mode and autocast state."""
    return (torch.is_inference_mode_enabled(), autocast_state())


@contextlib.contextmanager
def entered(modes: Modes) -> Iterator[None]:
    """Run the block under ``modes`` (grad mode stays the caller's: leaving inference mode
    would turn it on)."""
    inference, amp = modes
    grad = torch.is_grad_enabled()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(inference))
        stack.enter_context(torch.set_grad_enabled(grad))
        for i, device in enumerate(_DEVICE_TYPES):
            enabled, dtype = (False, None) if amp is None else amp[i]
            if enabled or torch.is_autocast_enabled(device):
                cache = True if amp is None else bool(amp[-1])
                stack.enter_context(
                    torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache)
                )
        yield


def run_in(modes: Modes, run: Callable[[], Any]) -> Callable[[], None]:
    """``run`` called under ``modes``."""

    def call() -> None:
        with entered(modes):
            run()

    return call
