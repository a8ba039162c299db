"""No torch.compile compiling inside a capture: dynamo's ``fail_on_recompile`` stance while any
capture on a backend that refuses compiles is open, ``force_eager`` while a capture on one that
does not (the CPU backend) is (refcounted; the stance is process-wide, so while captures of both
kinds are open the first one's holds; a stance set while one is open is left as set)."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

from bcg_core._errors import CaptureError

_lock = threading.Lock()
_open = 0
_stance: Any = None  # the context manager that restores the stance before the first capture

# The start of the RuntimeError dynamo raises under that stance (torch >= 2.6).
_RECOMPILE = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


@contextlib.contextmanager
def compiles_refused(refuse: bool) -> Iterator[None]:
    """While open, a call of a torch.compile'd function that would compile raises instead
    (``refuse``), or runs eagerly (not ``refuse``: under the CPU recorder's dispatch mode dynamo
    skips the frame and marks its code skipped for good, so after one capture the function ran
    uncompiled at every later call, and ``fullgraph=True`` failed at the capture and after it).
    Before dynamo is imported nothing has been compiled, so nothing is set."""
    global _open, _stance
    if "torch._dynamo" not in sys.modules:
        yield
        return
    import torch

    with _lock:
        if _open == 0:
            _stance = torch.compiler.set_stance("fail_on_recompile" if refuse else "force_eager")
            _stance.__enter__()
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0:
                stance, _stance = _stance, None
                # Only while the stance is still ours: one set meanwhile (another thread's
                # torch.compiler.set_stance, the captured code's) is the user's, and stays.
                # (torch's private current stance; where a version lacks it, restore as before.)
                current = getattr(torch._dynamo.eval_frame, "_stance", stance.stance)
                if current is stance.stance:
                    stance.__exit__(None, None, None)


def as_capture_error(exc: BaseException) -> CaptureError | None:
    """The CaptureError for dynamo's refusal to compile inside a capture, or None."""
    if not (isinstance(exc, RuntimeError) and str(exc).startswith(_RECOMPILE)):
        return None
    detail = str(exc).removeprefix(_RECOMPILE).lstrip(". ")
    return CaptureError(
        "bcg: torch.compile would compile inside the capture, which CUDA cannot do (a compile "
        f"allocates and synchronises on the capturing stream): {detail}\n"
        "Warm up the compiled function before capturing with the same arguments (shapes, "
        "dtypes, devices), grad mode and flags as the capture (BreakableGraphRunner's warm-ups "
        "do), and change nothing its guards read between the warm-ups and the capture."
    )
