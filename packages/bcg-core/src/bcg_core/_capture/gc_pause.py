"""Python's cyclic garbage collector held off while any breakable capture is open.

A collection that runs inside a capture can finalize a dead ``torch.cuda.CUDAGraph`` (an old
runner or graph caught in a reference cycle). Its destructor destroys a CUDA graph, which CUDA
forbids while a stream captures in "global" mode: the capture is invalidated and fails with
``cudaErrorStreamCaptureInvalidated`` for no fault of the captured code. Automatic collections
are therefore paused from the first open capture to the last one closing (captures in several
threads share one count, under a lock) and the collector's previous state is restored then;
the garbage is collected by the next automatic collection after capture. An explicit
``gc.collect()`` in user code still runs.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_open = 0  # captures holding the pause
_was_enabled = False  # the collector's state when the first of them began


@contextmanager
def gc_paused() -> Iterator[None]:
    global _open, _was_enabled
    with _lock:
        if _open == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0 and _was_enabled:
                gc.enable()
