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
``generate`` (test_cpu_review36_cachezoo_holes). A model file's own subclass (MiniMax M3 VL's
sparse layer, its ``idx_keys``) is defined after the patch, when the model is loaded, so
``Cache.reorder_cache`` (which ``generate`` calls) keeps every such layer's tensors in place too.
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
    each of their subclasses in transformers' ``cache_utils`` that overrides it, and
    ``Cache.reorder_cache`` for the subclasses defined elsewhere (once per process;
    idempotent)."""
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
            patches: list[tuple[type, str, Callable[..., Any]]] = [
                (cls, "reorder_cache", _wrap_reorder) for cls in classes
            ]
            wrap_cache = functools.partial(_wrap_cache_reorder, bases)
            patches.append((cache_utils.Cache, "reorder_cache", wrap_cache))
            _handle.append(PatchHandle.patch_all(patches))


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


def _keep_in_place(layer: Any, before: dict[tuple[str, Any], torch.Tensor]) -> None:
    """Copy each tensor the layer was rebound to back into the one it held ``before``."""
    for (name, key), new in _tensors(layer).items():
        old = before.get((name, key))
        if old is None or new is old or new.shape != old.shape or new.dtype != old.dtype:
            continue
        old.copy_(new)  # index_select's output: a new tensor, no overlap with old
        if key is None:
            setattr(layer, name, old)
        else:
            getattr(layer, name)[key] = old


def _wrap_reorder(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def reorder_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = _tensors(self)
        out = original(self, *args, **kwargs)
        _keep_in_place(self, before)
        return out

    return reorder_cache


def _wrap_cache_reorder(
    bases: tuple[type, ...], original: Callable[..., Any]
) -> Callable[..., Any]:
    @functools.wraps(original)
    def reorder_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        layers = [layer for layer in getattr(self, "layers", ()) if isinstance(layer, bases)]
        before = [_tensors(layer) for layer in layers]
        out = original(self, *args, **kwargs)
        for layer, held in zip(layers, before, strict=True):
            _keep_in_place(layer, held)
        return out

    return reorder_cache
