"""Non-owning aliases of a break's tensor arguments.

A break point is replayed on the tensors it saw at capture: same addresses, so the graph segment
before it writes what it reads. Holding those tensors strongly would pin every intermediate a
break ever saw, so the replay step keeps *aliases*: tensors over a storage built from the same
device pointer that does not own (or free) the memory. The memory stays valid because it belongs
to the graph's private pool, which lives as long as the graph, or to a caller-owned static buffer
(which, as with any CUDA graph, the caller must keep alive).

Only tensors on the aliased device types are aliased; CPU tensors and non-tensors pass through
unchanged, as do objects that are not lists, tuples or dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def alias_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor with ``t``'s device, dtype, storage offset, sizes and strides that does not keep
    ``t``'s storage alive."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    weak = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(weak, t.storage_offset(), t.size(), t.stride())
    return out


def map_tree(obj: Any, leaf: Callable[[torch.Tensor], Any]) -> Any:
    """Rebuild lists, tuples (named tuples too) and dicts with ``leaf`` applied to each tensor."""
    if isinstance(obj, torch.Tensor):
        return leaf(obj)
    if isinstance(obj, list):
        return [map_tree(x, leaf) for x in obj]
    if isinstance(obj, tuple):
        items = [map_tree(x, leaf) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        mapped = {k: map_tree(v, leaf) for k, v in obj.items()}
        return mapped if type(obj) is dict else type(obj)(mapped)
    return obj


def alias_tree(obj: Any, device_types: frozenset[str] = frozenset({"cuda"})) -> Any:
    """``obj`` with every tensor on ``device_types`` replaced by :func:`alias_tensor`."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return alias_tensor(t) if t.device.type in device_types else t

    return map_tree(obj, leaf)
