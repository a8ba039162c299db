"""Version bumps that a dispatch mode hides (in inference mode, and of ``_foreach`` writes).

Under a Python dispatch mode in inference mode, a composite view op (``x.reshape(-1)``) reaches
the mode whole and makes its view below the ADInplaceOrView key, so the view shares no version
counter with ``x``: a write through it (``x.reshape(-1)[:1] = v``) left ``x._version`` as it
was, and a runner, which finds the arguments a step writes by their versions, never copied the
write back to the caller. Both of bcg's modes that run user ops (the CPU backend's recorder and
the debug check's tracker) keep an :class:`InferenceViews` and bump the viewed tensor's version.

In any grad mode, an op writing a list of tensors (``torch._foreach_add_([x], ...)``) under such a
mode bumps none of their versions (its kernel writes each tensor below the ADInplaceOrView key,
which bumps them without a mode): :meth:`InferenceViews.bump` bumps them too.
"""

from __future__ import annotations

from typing import Any

import torch


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class InferenceViews:
    """The views an op made under a dispatch mode in inference mode, each to the tensor it
    views: :meth:`note` after a non-mutating op, :meth:`bump` after a mutating one."""

    __slots__ = ("_aliases",)

    def __init__(self) -> None:
        self._aliases: Any = None  # a WeakIdKeyDictionary, made at the first such view

    def note(self, outs: list[torch.Tensor], operands: list[torch.Tensor]) -> None:
        """Remember each of ``outs`` that shares an operand's storage without being a view
        torch knows of (a view made below ADInplaceOrView). Call it in inference mode only."""
        for o in outs:
            # An op may return its operand itself (aten.to of its own dtype): no new view
            # (noted, it made a cycle of one that bump() followed for ever: a hang).
            if o._is_view() or any(o is t for t in operands):
                continue
            ptr = _storage_ptr(o)
            base = next((t for t in operands if _storage_ptr(t) == ptr), None)
            if base is not None:
                if self._aliases is None:
                    self._aliases = torch.utils.weak.WeakIdKeyDictionary()
                self._aliases[o] = base

    def bump(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Bump the version of each tensor of a list ``func`` writes, and of the tensor each
        view written by ``func`` views. Call it after every mutating op, in any grad mode."""
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            arg = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(arg, torch.Tensor):
                written = [arg]  # its version bumped by torch, above the mode
            elif isinstance(arg, (list, tuple)):
                written = [t for t in arg if isinstance(t, torch.Tensor)]
                for t in written:
                    if not t.is_inference():
                        torch.autograd.graph.increment_version(t)
            else:
                continue
            if self._aliases is None:
                continue
            for t in written:
                # A chain ends: each view is noted once, when made, after the tensor it views.
                while (base := self._aliases.get(t)) is not None:
                    t = base
                    if not t.is_inference():
                        torch.autograd.graph.increment_version(t)
