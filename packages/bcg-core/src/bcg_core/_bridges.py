"""Bridges: the capture-time outputs of a break, and copying fresh outputs into them at replay.

The next graph segment was captured reading the tensors a break returned at capture, so those
tensors (the *bridge*) are held strongly for the graph's lifetime and every replay copies the
break's fresh output into them. Outputs are walked by ``_trees.py`` (tuples, lists, dicts, named
tuples, dataclasses, plain objects, registered pytree types). At replay the fresh output must
have the capture-time structure (types, dict keys, field names, lengths; tensors where tensors
were): dicts are matched by key, never by position, and any other difference raises
:class:`BreakOutputError` naming the break and the difference. Non-tensor values are part of the
capture: later Python code saw the capture-time value.
"""

from __future__ import annotations

from typing import Any

import torch

from bcg_core import _trees
from bcg_core._errors import BreakOutputError


def contains_device_tensor(obj: Any, device_types: frozenset[str]) -> bool:
    return any(t.device.type in device_types for t in _trees.tensor_leaves(obj))


class Bridge:
    """The strongly held capture-time output of one break point."""

    __slots__ = ("_dst", "_name", "_single", "_spec", "output")

    def __init__(self, name: str, output: Any) -> None:
        self._name = name
        self.output = output
        leaves, self._spec = _trees.flatten(output)
        self._dst = [x for x in leaves if isinstance(x, torch.Tensor)]
        # The common case (one output tensor) is checked against metadata read once: the bridge
        # owns its tensors, so their shape, dtype and address never change.
        one = output if isinstance(output, torch.Tensor) else None
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
                self._check(d, fresh, "output")  # raises with the details
            if fresh.data_ptr() != ptr or not _same_memory(d, fresh):
                d.copy_(fresh)
            return
        src = self._match(fresh)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for i, (d, s) in enumerate(zip(self._dst, src, strict=True)):
            if d.shape != s.shape or d.dtype != s.dtype:
                self._check(d, s, self._tensor_paths()[i])
            if not _same_memory(d, s):
                dsts.append(d)
                srcs.append(s)
        if len(dsts) == 1:
            dsts[0].copy_(srcs[0])
        elif dsts:
            torch._foreach_copy_(dsts, srcs)

    def _match(self, fresh: Any) -> list[torch.Tensor]:
        """The fresh output's tensors in the bridge's order, matched by structure (and dicts
        by key); raises :class:`BreakOutputError` when the structure changed."""
        leaves, spec = _trees.flatten(fresh)
        if spec == self._spec:
            return [x for x in leaves if isinstance(x, torch.Tensor)]
        if _trees.same_up_to_key_order(spec, self._spec):
            by_path = dict(zip(_trees.key_paths(spec, "output"), leaves, strict=True))
            return [by_path[p] for p in self._tensor_paths()]
        where = _trees.difference(spec, self._spec)
        count = sum(isinstance(x, torch.Tensor) for x in leaves)
        what = (
            f"{count} tensors at replay but {len(self._dst)} at capture"
            if count != len(self._dst)
            else "another structure at replay than at capture"
        )
        raise BreakOutputError(
            f"break {self._name!r} returned {what}: {where} at capture. A break must return "
            "the same structure every time (same container types, dict keys, fields and "
            "lengths, tensors where tensors were)."
        )

    def _tensor_paths(self) -> list[str]:
        paths = _trees.key_paths(self._spec, "output")
        leaves, _ = _trees.flatten(self.output)
        return [p for p, x in zip(paths, leaves, strict=True) if isinstance(x, torch.Tensor)]

    def _check(self, d: torch.Tensor, s: torch.Tensor, where: str) -> None:
        if d.shape != s.shape or d.dtype != s.dtype:
            raise BreakOutputError(
                f"break {self._name!r}: {where} is {tuple(s.shape)} {s.dtype} at replay "
                f"but was {tuple(d.shape)} {d.dtype} at capture; capture a graph per shape"
            )


def _same_memory(d: torch.Tensor, s: torch.Tensor) -> bool:
    return d.data_ptr() == s.data_ptr() and d.stride() == s.stride() and d.device == s.device
