"""Non-owning aliases of a break's tensor arguments.

A break point is replayed on the tensors it saw at capture: same addresses, so the graph segment
before it writes what it reads. Holding those tensors strongly would pin every intermediate a
break ever saw, so the replay step keeps *aliases*: tensors over a storage built from the same
device pointer that does not own (or free) the memory. The memory stays valid because it belongs
to the graph's private pool, which lives as long as the graph, or to a caller-owned static buffer
(which, as with any CUDA graph, the caller must keep alive).

Structures are walked by ``_trees.py``. Only tensors on the aliased device types are aliased;
CPU tensors and non-tensors pass through unchanged. Dataclasses and plain objects are passed as
themselves (held strongly, tensors included): a break re-reads their current attributes at every
replay, which is how engines hand host-side metadata to eager attention.
"""

from __future__ import annotations

from typing import Any

import torch

from bcg_core import _trees
from bcg_core._errors import CaptureError


def alias_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor with ``t``'s device, dtype, storage offset, sizes, strides and lazy conjugate
    and negative bits (the values a view reads depend on them) that does not keep ``t``'s
    storage alive."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    weak = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(weak, t.storage_offset(), t.size(), t.stride())
    if t.is_neg():
        out = torch._neg_view(out)
    if t.is_conj():
        out = out.conj()
    return out


def has_memory_layout(t: torch.Tensor) -> bool:
    """Whether ``t`` is a strided tensor with one storage (not sparse, nested or another
    layout): only those have the address, strides and storage that aliases, layouts and bridges
    read (torch raises a raw internal error for the others)."""
    return t.layout is torch.strided and not t.is_nested


def alias_tree(obj: Any, device_types: frozenset[str], device_type: str) -> Any:
    """``obj`` with every tensor on ``device_types`` replaced by :func:`alias_tensor`; a sparse
    or nested tensor has no single storage to alias and is held as it is.

    Containers (lists, dicts, tuples) holding a tensor of the graph's ``device_type`` are
    therefore rebuilt, so a host value in them is the capture's at every replay (an engine
    changing ``meta[1]`` in place is not seen; an object's attributes are). A backend that
    aliases nothing (CPU) rebuilds them all the same, around detached views of the same memory
    (also of a tensor that requires grad: an alias has no autograd history), so that it replays
    what CUDA replays."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        if not has_memory_layout(t):
            return t
        if t.device.type in device_types:
            return alias_tensor(t)
        if t.device.type == device_type and not device_types:
            # Another object on the same memory, as an alias is, and like one without autograd
            # history: a tensor that required grad made a replay in grad mode differ from CUDA's
            # (an out= op raised "don't support automatic differentiation").
            return t.detach()
        return t

    return _trees.map_tensors(obj, leaf, into_objects=False)


# A tensor argument's layout as a break received it: sizes, strides, offset, storage address.
_ArgumentLayout = tuple[torch.Size, tuple[int, ...], Any, int]  # offset: an int, or a SymInt


def argument_layouts(arguments: Any) -> list[_ArgumentLayout]:
    """The layout of each strided tensor in a break's arguments (not inside objects), in walk
    order. Sparse and nested tensors have none (reading it raised torch's internal error)."""
    return [
        (t.shape, t.stride(), t.storage_offset(), t.untyped_storage().data_ptr())
        for t in _trees.tensor_leaves(arguments, into_objects=False)
        if has_memory_layout(t)
    ]


def refuse_iterators(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise :class:`CaptureError` when a break is given a one-shot iterator (a generator,
    ``map``, ``zip``, ``iter(list)``) outside objects: the capture's call consumes it, and every
    replay would pass it exhausted (a break summing its items replayed a sum of none)."""
    found = _trees.one_shot_iterator(args, kwargs)
    if found is not None:
        where, kind = found
        raise CaptureError(
            f"break {name!r} was given {where}, a {kind.__name__} (a one-shot iterator): the "
            "capture's call consumes it and every replay would pass it exhausted. Pass a list "
            "or tuple instead (list(...))."
        )


def refuse_changed_arguments(name: str, before: list[_ArgumentLayout], arguments: Any) -> None:
    """Raise :class:`CaptureError` when a break changed a tensor argument's layout in place
    (``t_()``, ``unsqueeze_()``, ``resize_()``, ``set_()``): every replay passes the arguments
    as they were after this call, so the change would be made again on a changed tensor (a
    replay of ``h.t_()`` computes with ``h`` untransposed). Filling an empty tensor (an
    ``out=`` buffer resized once) repeats harmlessly and is allowed. A container argument that
    changed (items added or removed) is not judged: a replay passes it as it is now."""
    tensors = [
        t for t in _trees.tensor_leaves(arguments, into_objects=False) if has_memory_layout(t)
    ]
    if len(tensors) != len(before):
        return
    for t, (shape, stride, offset, storage) in zip(tensors, before, strict=True):
        now = (t.shape, t.stride(), t.storage_offset(), t.untyped_storage().data_ptr())
        if now != (shape, stride, offset, storage) and shape.numel() != 0:
            raise CaptureError(
                f"break {name!r} changed the layout of a tensor argument in place (sizes "
                f"{tuple(shape)} strides {stride} became {tuple(t.shape)} {t.stride()}: t_(), "
                "unsqueeze_(), resize_() or set_()); every replay would change it again, so "
                "it would not compute what eager computes. Return a new view instead (h.t(), "
                "h.unsqueeze(0)), or change the tensor before passing it to the break."
            )
