"""Python's automatic garbage collection held off while any breakable capture is open.

A collection that runs inside a capture can finalize a dead ``torch.cuda.CUDAGraph`` (an old
runner or graph caught in a reference cycle). Its destructor destroys a CUDA graph, which CUDA
forbids while a stream captures in "global" mode: the capture is invalidated and fails with
``cudaErrorStreamCaptureInvalidated`` for no fault of the captured code. Automatic collections
are therefore paused from the first open capture to the last one closing (captures in several
threads share one count, under a lock); the garbage is collected by the next automatic
collection after capture. An explicit ``gc.collect()`` in user code still runs.

While paused, ``gc.disable`` and ``gc.enable`` are replaced (installed with the first open
capture, always removed with the last, by ``hook_attribute``: a patch of them made after bcg's
import is theirs again afterwards) by functions that only note what the user asked for:
at the end the collector is left exactly as the user last set it, so a ``gc.disable()`` made
inside a capture stays, and a ``gc.enable()`` made there takes effect once no capture is open.
``gc.isenabled`` answers with that noted switch: code saving and restoring it around a
``gc.disable()`` (``timeit``) read the pause's False and left the collector off for good.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bcg_core._patching import hook_attribute

_lock = threading.Lock()
_open = 0  # captures holding the pause
_wanted = True  # the collector's state as the user last set it
_enable, _disable = gc.enable, gc.disable  # the collector's own switches
_removers: list[Callable[[], None]] = []  # the hooks of gc.enable/gc.disable while paused


def _user_enable() -> None:
    global _wanted
    with _lock:
        _wanted = True


def _user_disable() -> None:
    global _wanted
    with _lock:
        _wanted = False


def _user_isenabled() -> bool:
    return _wanted


@contextmanager
def gc_paused() -> Iterator[None]:
    global _open, _wanted
    with _lock:
        if _open == 0:
            _wanted = gc.isenabled()
            _disable()
            # Hooked, not assigned: restoring the import-time functions at the end dropped a
            # patch of them made since (another library's, a test's monkeypatch).
            _removers.append(hook_attribute(gc, "enable", lambda _: _user_enable))
            _removers.append(hook_attribute(gc, "disable", lambda _: _user_disable))
            _removers.append(hook_attribute(gc, "isenabled", lambda _: _user_isenabled))
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0:
                while _removers:
                    _removers.pop()()
                if _wanted:
                    _enable()
