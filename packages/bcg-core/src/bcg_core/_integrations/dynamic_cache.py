"""A transformers ``DynamicCache`` that holds tokens is refused at capture.

``DynamicLayer.update`` (and ``QuantizedLayer.update``) grows the layer with ``torch.cat`` into
new tensors and rebinds ``layer.keys``/``layer.values`` to them. Captured, the ``cat`` reads the
capture-time tensors at every replay and writes the capture-time output: each replay attends
to the capture's context plus the new token, never to what earlier replays added (measured on
the CPU backend: a 3-layer Llama, logits off by 0.08 from the second replay, no error). So at
capture, outside a break, the update of a layer that already held tokens when the capture
began raises :class:`CaptureError` (the runner then serves the signature eagerly). A layer
first filled inside this capture (a fresh cache the step makes, as ``model(input_ids)`` does
with ``use_cache`` on) is all the graph's own and stays captured. Outside a capture, under
``torch.compile`` and inside a break, the methods are transformers' own.
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
# The capture each layer was first filled in (its tensors are that graph's own).
_filled_in: weakref.WeakKeyDictionary[Any, weakref.ref[CaptureState]] = weakref.WeakKeyDictionary()


def install() -> None:
    """Patch ``DynamicLayer.update`` and ``QuantizedLayer.update`` (once per process)."""
    from transformers.cache_utils import DynamicLayer, QuantizedLayer

    with _lock:
        if not _handle:
            _handle.append(
                PatchHandle.patch_all(
                    [
                        (DynamicLayer, "update", _wrap_update),
                        (QuantizedLayer, "update", _wrap_update),
                    ]
                )
            )


def _wrap_update(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return original(self, *args, **kwargs)
        state = active_capture()
        if state is None or state.in_break:
            return original(self, *args, **kwargs)
        if not self.is_initialized:
            _filled_in[self] = weakref.ref(state)
        else:
            filled = _filled_in.get(self)
            if filled is None or filled() is not state:
                raise _refusal(self)
        return original(self, *args, **kwargs)

    return update


def _refusal(layer: Any) -> CaptureError:
    return CaptureError(
        f"bcg: a transformers DynamicCache layer ({type(layer).__name__}) that already holds "
        "tokens cannot be captured: its update grows the keys and values with torch.cat into "
        "new tensors, so every replay would attend to the capture's context (the tokens "
        "earlier replays added are lost: wrong logits, no error). Decode with a "
        "transformers.StaticCache (updated in place; its sliding-window layers are captured "
        "too), or run this step eagerly."
    )
