"""A transformers ``StaticCache`` reordered for beam search keeps its tensors' addresses.

``StaticLayer.reorder_cache`` (transformers 5.17; ``generate(num_beams=...)`` calls it after every
step) rebinds ``layer.keys``/``layer.values`` to ``index_select``'s new tensors. A graph captured
over the cache (the README's recipe: the step closes over it) reads the old tensors at every
replay, so every step after the first reorder attended to a stale cache, silently (measured on the
CPU backend: Llama and Gemma 3 beams and scores differed from plain ``generate``). Patched, the
reorder is transformers' own, then its result is copied back into the old tensors and the layer
rebound to them: the same values at the captured addresses. A cache passed to a runner as an
argument was served eagerly instead (a miss naming the rebound tensor); it now replays.

The subclasses that override ``reorder_cache`` are patched too, and every tensor the layer holds
(an attribute, or an item of a dict attribute) is kept in place, not only ``keys``/``values``:
``StaticIndexedLayer`` (DeepSeek V3.2, GLM DSA) rebinds ``indexer_keys`` after calling
``StaticLayer``'s, the hybrid linear-attention layers their ``conv_states``/``recurrent_states``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from bcg_core._patching import PatchHandle

_lock = threading.Lock()
_handle: list[PatchHandle] = []  # the class patch, made once and kept (registration is permanent)


def install() -> None:
    """Patch ``reorder_cache`` of ``StaticLayer`` and of its subclasses that override it (once
    per process; idempotent)."""
    from transformers import cache_utils

    with _lock:
        if not _handle:
            classes = [
                c
                for c in vars(cache_utils).values()
                if isinstance(c, type)
                and issubclass(c, cache_utils.StaticLayer)
                and "reorder_cache" in vars(c)
            ]
            if cache_utils.StaticLayer not in classes:  # it inherits the mixin's
                classes.append(cache_utils.StaticLayer)
            _handle.append(
                PatchHandle.patch_all([(c, "reorder_cache", _wrap_reorder) for c in classes])
            )


def _held(layer: Any) -> dict[tuple[str, Any], torch.Tensor]:
    """The tensors ``layer`` holds: its tensor attributes and the tensor items of its dicts."""
    held = {}
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            held[name, None] = value
        elif isinstance(value, dict):
            held.update(((name, k), v) for k, v in value.items() if isinstance(v, torch.Tensor))
    return held


def _wrap_reorder(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def reorder_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = _held(self)
        out = original(self, *args, **kwargs)
        for (name, key), new in _held(self).items():
            old = before.get((name, key))
            if old is not None and new is not old and new.shape == old.shape:
                old.copy_(new)  # index_select's output: a new tensor, no overlap with old
                if key is None:
                    setattr(self, name, old)
                else:
                    getattr(self, name)[key] = old
        return out

    return reorder_cache
