"""A transformers ``StaticCache`` reordered for beam search keeps its tensors' addresses.

``StaticLayer.reorder_cache`` (transformers 5.17; ``generate(num_beams=...)`` calls it after every
step) rebinds ``layer.keys``/``layer.values`` to ``index_select``'s new tensors. A graph captured
over the cache (the README's recipe: the step closes over it) reads the old tensors at every
replay, so every step after the first reorder attended to a stale cache, silently (measured on the
CPU backend: Llama and Gemma 3 beams and scores differed from plain ``generate``). Patched, the
reorder is transformers' own, then its result is copied back into the old tensors and the layer
rebound to them: the same values at the captured addresses. A cache passed to a runner as an
argument was served eagerly instead (a miss naming the rebound tensor); it now replays.

The other static layers' reorders rebind more tensors the same way, so every subclass that
overrides the reorder is patched too: ``StaticIndexedLayer`` (its ``indexer_keys``; DeepSeek
V3.2, GLM DSA) and the linear-attention layers
(``LinearAttentionCacheLayerMixin``: the ``conv_states``/``recurrent_states`` entries of
LFM2, Qwen3-Next, ZAYA and the hybrid ``LinearAttentionAndStatic*`` layers, whose reorders call
this mixin's and ``StaticLayer``'s). Unpatched, LFM2 and ZAYA beam scores differed from plain
``generate`` (test_cpu_review36_cachezoo_holes).
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
    """Patch the ``reorder_cache`` of ``StaticLayer``, ``LinearAttentionCacheLayerMixin`` and
    each of their subclasses in transformers' ``cache_utils`` that overrides it (once per
    process; idempotent)."""
    from transformers import cache_utils

    bases = (cache_utils.StaticLayer, cache_utils.LinearAttentionCacheLayerMixin)
    with _lock:
        if not _handle:
            classes = [
                c
                for c in vars(cache_utils).values()
                if isinstance(c, type) and issubclass(c, bases) and "reorder_cache" in vars(c)
            ]
            classes += [c for c in bases if c not in classes]  # StaticLayer inherits its own
            _handle.append(
                PatchHandle.patch_all((cls, "reorder_cache", _wrap_reorder) for cls in classes)
            )


def _tensors(layer: Any) -> dict[tuple[str, Any], torch.Tensor]:
    """The layer's tensors, by attribute (and key, for a list or dict of states)."""
    found: dict[tuple[str, Any], torch.Tensor] = {}
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            found[name, None] = value
        elif isinstance(value, (list, dict)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            found.update(((name, k), t) for k, t in items if isinstance(t, torch.Tensor))
    return found


def _wrap_reorder(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def reorder_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = _tensors(self)
        out = original(self, *args, **kwargs)
        for (name, key), new in _tensors(self).items():
            old = before.get((name, key))
            if old is None or new is old or new.shape != old.shape or new.dtype != old.dtype:
                continue
            old.copy_(new)  # index_select's output: a new tensor, no overlap with old
            if key is None:
                setattr(self, name, old)
            else:
                getattr(self, name)[key] = old
        return out

    return reorder_cache
