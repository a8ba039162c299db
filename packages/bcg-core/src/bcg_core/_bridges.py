"""Bridges: the capture-time outputs of a break, and copying fresh outputs into them at replay.

The next graph segment was captured reading the tensors a break returned at capture, so those
tensors (the *bridge*) are held strongly for the graph's lifetime and every replay copies the
break's fresh output into them. Tensors are found inside tuples, lists, dicts, dataclasses and
plain objects (their ``__dict__``), in a fixed traversal order; modules, classes and functions are
opaque. Non-tensor values are part of the capture: later Python code saw the capture-time value.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch

from bcg_core._errors import BreakOutputError

_OPAQUE = (torch.nn.Module, type, types.FunctionType, types.MethodType, types.ModuleType)


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """All tensors reachable from ``obj`` in traversal order (each object visited once)."""
    out: list[torch.Tensor] = []
    _collect(obj, out, set())
    return out


def _collect(obj: Any, out: list[torch.Tensor], seen: set[int]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return
    if obj is None or isinstance(obj, (str, bytes, int, float, complex, bool, _OPAQUE)):
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        for item in obj:
            _collect(item, out, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            _collect(item, out, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            _collect(getattr(obj, field.name), out, seen)
    elif hasattr(obj, "__dict__"):
        for item in vars(obj).values():
            _collect(item, out, seen)


def contains_device_tensor(obj: Any, device_types: frozenset[str]) -> bool:
    return any(t.device.type in device_types for t in tensor_leaves(obj))


class Bridge:
    """The strongly held capture-time output of one break point."""

    __slots__ = ("_dst", "_name", "_single", "output")

    def __init__(self, name: str, output: Any) -> None:
        self._name = name
        self.output = output
        self._dst = tensor_leaves(output)
        # The common case (one output tensor) is checked against metadata read once: the bridge
        # owns its tensors, so their shape, dtype and address never change.
        one = self._dst[0] if len(self._dst) == 1 else None
        self._single = None if one is None else (one, one.shape, one.dtype, one.data_ptr())

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._dst)

    def update(self, fresh: Any) -> None:
        """Copy ``fresh`` (the break's output at replay) into the bridge: one batched copy for
        several tensors; nothing for tensors that already live at the bridge's addresses."""
        if fresh is self.output or not self._dst:
            return
        # Copies into the bridge are data movement, never part of an autograd graph. Entering
        # no_grad costs more than the copy's launch, so only when grad mode is on.
        if torch.is_grad_enabled():
            with torch.no_grad():
                self._update(fresh)
        else:
            self._update(fresh)

    def _update(self, fresh: Any) -> None:
        single = self._single
        if single is not None and isinstance(fresh, torch.Tensor):
            d, shape, dtype, ptr = single
            if fresh.shape != shape or fresh.dtype != dtype:
                self._check(d, fresh, 0)  # raises with the details
            if fresh.data_ptr() != ptr or not _same_memory(d, fresh):
                d.copy_(fresh)
            return
        src = tensor_leaves(fresh)
        if len(src) != len(self._dst):
            raise BreakOutputError(
                f"break {self._name!r} returned {len(src)} tensors at replay but "
                f"{len(self._dst)} at capture; a break must return the same structure every time"
            )
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for i, (d, s) in enumerate(zip(self._dst, src, strict=True)):
            self._check(d, s, i)
            if not _same_memory(d, s):
                dsts.append(d)
                srcs.append(s)
        if len(dsts) == 1:
            dsts[0].copy_(srcs[0])
        elif dsts:
            torch._foreach_copy_(dsts, srcs)

    def _check(self, d: torch.Tensor, s: torch.Tensor, i: int) -> None:
        if d.shape != s.shape or d.dtype != s.dtype:
            raise BreakOutputError(
                f"break {self._name!r}: output tensor {i} is {tuple(s.shape)} {s.dtype} at replay "
                f"but was {tuple(d.shape)} {d.dtype} at capture; capture a graph per shape"
            )


def _same_memory(d: torch.Tensor, s: torch.Tensor) -> bool:
    return d.data_ptr() == s.data_ptr() and d.stride() == s.stride() and d.device == s.device
