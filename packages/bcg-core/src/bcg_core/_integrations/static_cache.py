"""A transformers ``StaticCache`` reordered for beam search keeps its tensors' addresses.

``StaticLayer.reorder_cache`` (transformers 5.17; ``generate(num_beams=...)`` calls it after every
step) rebinds ``layer.keys``/``layer.values`` to ``index_select``'s new tensors. A graph captured
over the cache (the README's recipe: the step closes over it) reads the old tensors at every
replay, so every step after the first reorder attended to a stale cache, silently (measured on the
CPU backend: Llama and Gemma 3 beams and scores differed from plain ``generate``). Patched, the
reorder is transformers' own, then its result is copied back into the old tensors and the layer
rebound to them: the same values at the captured addresses. A cache passed to a runner as an
argument was served eagerly instead (a miss naming the rebound tensor); it now replays.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from bcg_core._patching import PatchHandle

_lock = threading.Lock()
_handle: list[PatchHandle] = []  # the class patch, made once and kept (registration is permanent)


def install() -> None:
    """Patch ``StaticLayer.reorder_cache`` (once per process; idempotent)."""
    from transformers.cache_utils import StaticLayer

    with _lock:
        if not _handle:
            _handle.append(PatchHandle.patch_all([(StaticLayer, "reorder_cache", _wrap_reorder)]))


def _wrap_reorder(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def reorder_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = (self.keys, self.values)
        out = original(self, *args, **kwargs)
        for name, old in zip(("keys", "values"), before, strict=True):
            new = getattr(self, name)
            if old is not None and new is not old and new.shape == old.shape:
                old.copy_(new)  # index_select's output: a new tensor, no overlap with old
                setattr(self, name, old)
        return out

    return reorder_cache
