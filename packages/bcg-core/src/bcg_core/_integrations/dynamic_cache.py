"""A transformers ``DynamicCache`` made before a capture is refused there.

``DynamicLayer.update`` (and ``QuantizedLayer.update``) grows the layer with ``torch.cat`` into
new tensors and rebinds ``layer.keys``/``layer.values`` to them. Captured, the ``cat`` reads the
capture-time tensors at every replay and writes the capture-time output: each replay attends
to the capture's context plus the new token, never to what earlier replays added (measured on
the CPU backend: a 3-layer Llama, logits off by 0.08 from the second replay, no error). So at
capture, outside a break, the update of a layer made before the capture began raises
:class:`CaptureError` (the runner then serves the signature eagerly): one that holds tokens, and
an empty one too (a cache made once and passed to every call: eager's next call would find the
tokens this one added, every replay finds it empty). A layer made inside this capture (a fresh
cache the step makes, as ``model(input_ids)`` does with ``use_cache`` on) is all the graph's
own and stays captured. Outside a capture, under ``torch.compile`` and inside a break, the
methods are transformers' own.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from bcg_core._capture.context import active_capture
from bcg_core._errors import CaptureError
from bcg_core._patching import PatchHandle

if TYPE_CHECKING:
    from bcg_core._capture.capture import CaptureState

_is_compiling = torch.compiler.is_compiling

_lock = threading.Lock()
_handle: list[PatchHandle] = []  # the class patch, made once and kept (registration is permanent)
# The capture each cache and layer was made in (its tensors are that graph's own).
_made_in: weakref.WeakKeyDictionary[Any, weakref.ref[CaptureState]] = weakref.WeakKeyDictionary()


def install() -> None:
    """Patch the ``__init__`` and ``update`` of ``DynamicCache``, ``QuantizedCache`` and
    ``DynamicLayer`` and ``QuantizedLayer.update`` (once per process). Both levels are checked:
    a cache made empty before the capture makes its layers lazily, inside it."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, QuantizedCache, QuantizedLayer

    with _lock:
        if not _handle:
            _handle.append(
                PatchHandle.patch_all(
                    [
                        *((cls, "__init__", _wrap_init) for cls in (DynamicCache, QuantizedCache)),
                        *((cls, "update", _wrap_update) for cls in (DynamicCache, QuantizedCache)),
                        (DynamicLayer, "__init__", _wrap_init),
                        (DynamicLayer, "update", _wrap_update),
                        (QuantizedLayer, "update", _wrap_update),
                    ]
                )
            )


def _capturing() -> CaptureState | None:
    """The capture whose segment is running now (None outside one, in a break, compiling)."""
    if _is_compiling():
        return None
    state = active_capture()
    return None if state is None or state.in_break else state


def _wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        state = _capturing()
        if state is not None:
            _made_in[self] = weakref.ref(state)

    return __init__


def _wrap_update(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _capturing()
        if state is not None:
            made = _made_in.get(self)
            if made is None or made() is not state:
                raise _refusal(self)
        return original(self, *args, **kwargs)

    return update


def _refusal(made: Any) -> CaptureError:
    name = type(made).__name__
    what = name if hasattr(made, "layers") else f"{name} (a DynamicCache layer)"
    return CaptureError(
        f"bcg: a transformers {what} made before the capture cannot be captured: its "
        "update grows the keys and values with torch.cat into new tensors, so every replay "
        "would attend to the capture's context (the tokens earlier replays added are lost: "
        "wrong logits, no error). Decode with a transformers.StaticCache (updated in place; "
        "its sliding-window layers are captured too), or run this step eagerly."
    )
