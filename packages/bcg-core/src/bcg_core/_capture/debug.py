"""Capture debug mode: which level is on, and the check for tensors a break leaks to later segments.

A break runs eagerly at capture and again at every replay. A device tensor it creates and leaves
reachable without returning it (stored on a metadata object, or in a cache that a later segment
reads) is read by that segment at its capture-time address, while every replay makes a new one:
replay silently reads stale memory. With debug on, each break runs under a
:class:`FreshTensorTracker` (``fresh.py``: a dispatch mode holding weak references to the tensors
whose storage was created by the break's ops) and :func:`report_leaks` names the ones still alive
afterwards.
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

import torch

from bcg_core._capture.fresh import TRACKER, FreshTensorTracker, storage_key
from bcg_core._env import FALSE_WORDS, TRUE_WORDS, env_word, warn_unknown
from bcg_core._errors import CaptureError
from bcg_core._trees import tensor_leaves


class DebugLevel(enum.IntEnum):
    """Capture debug levels: off, warn (report and go on), strict (report as an error)."""

    OFF = 0
    WARN = 1
    STRICT = 2


_ON = TRUE_WORDS | {"warn"}


def debug_level(option: bool | str | None = None) -> DebugLevel:
    """The debug level for ``option`` (None: the ``BCG_DEBUG`` environment variable).

    ``True``/"1"/"on"/"warn" give WARN, "strict" gives STRICT, ``False``/""/"0"/"off" give OFF;
    anything else given as ``option`` raises ``ValueError`` naming the accepted values. Another
    word in ``BCG_DEBUG`` counts as off, warned once per value, as for ``BCG_DISABLE``: raising
    there failed every capture (a runner blocked every signature, ``check_capture`` raised).
    """
    if isinstance(option, bool):
        return DebugLevel.WARN if option else DebugLevel.OFF
    if option is not None and not isinstance(option, str):  # 1, 0.0 ...: not .strip()-able
        raise ValueError(f"debug must be a bool, 'warn' or 'strict' (or None), got {option!r}")
    value = option.strip().lower() if option is not None else env_word("BCG_DEBUG")
    if value == "strict":
        return DebugLevel.STRICT
    if value in _ON:
        return DebugLevel.WARN
    if value in FALSE_WORDS:
        return DebugLevel.OFF
    if option is None:
        warn_unknown("BCG_DEBUG", value, on="1 (or warn) to warn, strict to raise")
        return DebugLevel.OFF
    raise ValueError(f"debug must be a bool, 'warn' or 'strict' (or 1/0), got {value!r}")


def keep_alive_ok(tensor: torch.Tensor) -> torch.Tensor:
    """Declare that ``tensor``, created inside a break, may stay alive after it on purpose.

    Use it inline, as it returns the tensor: ``self.table = keep_alive_ok(torch.empty(...))``.

    The debug check (``BCG_DEBUG`` or ``BreakableCUDAGraphCapture(debug=...)``) then does not
    report them. Use it for memory a break allocates once at capture and reuses at every replay
    (a lazily built constant table, say); never for a value that changes per call, which later
    segments would read stale. Outside a debug-checked break it does nothing.

    Args:
        tensor: a tensor the break created and keeps (in an attribute, a cache).

    Returns:
        ``tensor`` itself, unchanged.

    Raises:
        TypeError: ``tensor`` is not a tensor (mark each tensor of a container), also outside
            a debug-checked break, so that code does not fail only under ``BCG_DEBUG``.
    """
    if not isinstance(tensor, torch.Tensor):
        # (Under the debug check it raised the raw "'list' object has no attribute
        # 'untyped_storage'"; without it, it passed.)
        raise TypeError(
            f"keep_alive_ok takes a tensor, got a {type(tensor).__name__}; mark each tensor "
            "the break keeps (keep_alive_ok(t) for t in ...)"
        )
    tracker = TRACKER.get()
    if tracker is not None:
        tracker.allow(tensor)
    return tensor


def argument_tensors(arguments: Any) -> list[torch.Tensor]:
    """The tensors among a break's ``arguments`` (lists, tuples and dicts are walked, other
    objects are not), read *before* the break runs: one it stores into a list argument is new."""
    return tensor_leaves(arguments, into_objects=False)


def report_leaks(
    name: str,
    tracker: FreshTensorTracker,
    output: Any,
    arguments: list[torch.Tensor],
    *,
    strict: bool,
) -> None:
    """Report the fresh tensors of break ``name`` still alive that share storage with neither its
    ``output`` nor the ``arguments`` it was called with (:func:`argument_tensors`, read before it
    ran: a tensor it stored on an argument object, or appended to an argument list, is the
    leak) nor were marked with :func:`keep_alive_ok`: a warning, or :class:`CaptureError` when
    ``strict``."""
    # Returned tensors are bridged (found as bridges find them); argument tensors are caller- or
    # pool-owned.
    reached = (*tensor_leaves(output), *arguments)
    kept = {storage_key(t) for t in reached} | tracker.allowed()
    leaked = {ptr: size for ptr, size in tracker.alive().items() if ptr not in kept}
    if not leaked:
        return
    sizes = ", ".join(f"{size} bytes" for size in leaked.values())
    message = (
        f"break {name!r} created {len(leaked)} {tracker.device_type} tensor(s) still alive after "
        f"it that it neither returned nor wrote into its arguments ({sizes}). A later segment "
        "that reads one was captured at its capture-time address, while every replay makes a new "
        "one: replay would read stale memory. Return the tensor (it is then bridged), write it "
        "into a buffer passed as an argument, or mark it with bcg_core.keep_alive_ok(tensor) if "
        "it is meant to be allocated once and reused."
    )
    if strict:
        raise CaptureError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)
