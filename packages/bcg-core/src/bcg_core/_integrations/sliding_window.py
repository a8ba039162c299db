"""Sliding-window layers of a transformers ``StaticCache`` under a breakable capture.

transformers (5.17) keeps a sliding cache layer's position in a Python int
(``StaticSlidingWindowLayer.cumulative_length_int``) and branches on it: its ``update`` writes
the new token at the position until the window is full, then rolls the window by one and
writes at its end; ``get_seq_length()`` (the model's positions, the mask's query offset) returns
the int, and ``get_mask_sizes()`` returns the mask's key offset computed from it. A graph would
freeze all three. While :func:`is_in_breakable_cuda_graph` is true, for one-token steps:

- the layer's ``update`` is one break (transformers' own ``update``, run eagerly at every
  replay: it advances the int and writes the cache buffers in place), after which the graph
  reads the buffers, at their fixed addresses;
- ``get_seq_length()`` and the key offset of ``get_mask_sizes()`` are 0-d tensors, views of one
  break's output (``[query offset, key offset]``, read from transformers' own methods at every
  replay), so the positions (RoPE) and the sliding mask are computed in the graph from them.
  The mask's key length, a shape, stays an int: for one query token transformers gives the
  window whatever the position. That break is made once per forward: later calls in the same
  capture, until the layer's next update, reuse its output.

So a decode step gets one extra break per sliding layer and one per forward; full-attention
layers are untouched. Outside the flag, under ``torch.compile`` (which traces transformers'
code: the compiled path keeps refusing sliding layers) and for steps of several tokens (their
key length and the update's result change shape when the window fills: refused at capture) the
methods are transformers' own.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch

from bcg_core import _trees
from bcg_core._capture.breaks import eager_on_graph
from bcg_core._capture.context import active_capture
from bcg_core._capture.flag import is_in_breakable_cuda_graph
from bcg_core._errors import CaptureError
from bcg_core._patching import PatchHandle

if TYPE_CHECKING:
    from bcg_core._capture.capture import CaptureState

_is_compiling = torch.compiler.is_compiling

_lock = threading.Lock()
_handle: list[PatchHandle] = []  # the class patch, made once and kept (registration is permanent)
_originals: dict[str, Callable[..., Any]] = {}  # transformers' methods, under the patch

# The offsets break's output for each layer since its last update: per capture (by the layer's
# id), and outside captures (warm-ups, the divergence check's eager runs) with the position it
# was read at, so that eager makes the break calls a replay makes (one per forward).
_offsets_made: weakref.WeakKeyDictionary[CaptureState, dict[int, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
_offsets_read: weakref.WeakKeyDictionary[Any, tuple[Any, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
# The capture whose last cache update was a sliding layer's break (set by the update, read and
# cleared by the attention after it).
_UPDATED: ContextVar[weakref.ref[CaptureState] | None] = ContextVar(
    "bcg_sliding_update", default=None
)


def install() -> None:
    """Patch ``StaticSlidingWindowLayer`` (once per process; idempotent)."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    with _lock:
        if not _handle:
            _handle.append(
                PatchHandle.patch_all(
                    [
                        (StaticSlidingWindowLayer, "update", _wrap_update),
                        (StaticSlidingWindowLayer, "get_seq_length", _wrap_seq_length),
                        (StaticSlidingWindowLayer, "get_mask_sizes", _wrap_mask_sizes),
                    ]
                )
            )
            # A cache passed to a runner (generate() hands model.forward its cache): the int
            # moves every step and the breaks read it at every replay, so it is no part of the
            # signature (keyed, every decode step after the capture was a miss, run eagerly).
            # Its subclasses too (leave_unwalked is by exact class): ZAYA's
            # LinearAttentionAndStaticSlidingWindowAttentionLayer missed at every step.
            pending = [StaticSlidingWindowLayer]
            while pending:
                cls = pending.pop()
                _trees.leave_unwalked(cls, ("cumulative_length_int",))
                pending.extend(cls.__subclasses__())


def took_last_update() -> bool:
    """Whether the last cache update in this capture was a sliding layer's update break (the
    attention that follows it may then be captured); clears it."""
    updated = _UPDATED.get()
    _UPDATED.set(None)
    state = active_capture()
    return state is not None and updated is not None and updated() is state


def _active() -> bool:
    return not _is_compiling() and is_in_breakable_cuda_graph()


def _refuse(layer: Any, tokens: int | None = None) -> CaptureError:
    """Why a sliding layer's step cannot be captured: a step of ``tokens`` tokens, or (None)
    a cache not yet prefilled."""
    if tokens is None:
        why = (
            "before the cache is prefilled (its buffers do not exist yet): run the prefill, "
            "or call the cache's early_initialization(), before capturing"
        )
    else:
        why = (
            f"for a step of {tokens} tokens: transformers keeps its position in a Python int, "
            "and only one-token steps have the same shapes at every position (with more, the "
            "mask length and the update's result change once the window fills); capture "
            "one-token decode steps and run this one eagerly"
        )
    return CaptureError(
        f"bcg: a sliding-window cache layer ({type(layer).__name__}) cannot be captured {why}"
    )


def _wrap_update(original: Callable[..., Any]) -> Callable[..., Any]:
    _originals["update"] = original
    as_break = eager_on_graph(name="transformers sliding-window cache update")(_run_update)

    @functools.wraps(original)
    def update(
        self: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        if _offsets_read:
            # The position moves on, whatever the step (several tokens, outside the flag): an
            # entry left at this position would skip the next forward's break there after a
            # reset and a prefill of the same length (the divergence check's eager run).
            _offsets_read.pop(self, None)
        if not _active():
            return original(self, key_states, value_states, *args, **kwargs)
        state = active_capture()
        if key_states.shape[-2] != 1:
            if state is not None:
                raise _refuse(self, key_states.shape[-2])
            return original(self, key_states, value_states, *args, **kwargs)
        if state is not None:
            if not self.is_initialized:
                raise _refuse(self)
            _offsets_made.get(state, {}).pop(id(self), None)  # the position moves on
            _UPDATED.set(weakref.ref(state))
        as_break(original, self, key_states, value_states, args, kwargs)
        return self.keys, self.values

    return update


def _run_update(
    original: Callable[..., Any],
    layer: Any,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """transformers' update of one sliding layer: for one token it writes the layer's buffers
    in place and returns them (checked), whichever branch the position takes."""
    keys, values = original(layer, key_states, value_states, *args, **kwargs)
    if keys is not layer.keys or values is not layer.values:
        raise RuntimeError(
            "bcg: transformers' sliding-window cache update returned new tensors for a "
            "one-token step (this transformers version differs from 5.17; please report it)"
        )


def _wrap_seq_length(original: Callable[..., Any]) -> Callable[..., Any]:
    _originals["get_seq_length"] = original

    @functools.wraps(original)
    def get_seq_length(self: Any) -> Any:
        if not _active():
            return original(self)
        if not self.is_initialized:
            if active_capture() is not None:
                raise _refuse(self)
            return original(self)
        return _offsets(self)[0]

    return get_seq_length


def _wrap_mask_sizes(original: Callable[..., Any]) -> Callable[..., Any]:
    _originals["get_mask_sizes"] = original

    @functools.wraps(original)
    def get_mask_sizes(self: Any, query_length: int) -> Any:
        if not _active() or not self.is_initialized:
            return original(self, query_length)
        if query_length != 1:
            if active_capture() is not None:
                raise _refuse(self, query_length)
            return original(self, query_length)
        kv_length, _ = original(self, query_length)
        return kv_length, _offsets(self)[1]

    return get_mask_sizes


def _offsets(layer: Any) -> torch.Tensor:
    """``[query offset, key offset]`` of ``layer`` for a one-token step, as a tensor: at
    capture the output of one break per forward (reused until the layer's update)."""
    state = active_capture()
    if state is None:
        position = _originals["get_seq_length"](layer)
        read = _offsets_read.get(layer)
        if read is None or read[0] != position:
            read = _offsets_read[layer] = (position, _offsets_break(layer, _key_length(layer)))
        return read[1]
    made = _offsets_made.setdefault(state, {})
    out = made.get(id(layer))
    if out is None:
        out = made[id(layer)] = _offsets_break(layer, _key_length(layer))
    return out


def _key_length(layer: Any) -> int:
    length: int = _originals["get_mask_sizes"](layer, 1)[0]
    return length


def _read_offsets(layer: Any, key_length: int) -> torch.Tensor:
    """The offsets transformers gives ``layer`` now, from its Python int (at every replay); the
    key length must be the capture's (for one token transformers keeps it at the window)."""
    length, kv_offset = _originals["get_mask_sizes"](layer, 1)
    if length != key_length:
        raise RuntimeError(
            f"bcg: transformers' sliding-window mask length changed from {key_length} to "
            f"{length} for a one-token step (this transformers version differs from 5.17; "
            "please report it)"
        )
    out = torch.empty(2, dtype=torch.long, device=layer.device)
    out[0].fill_(_originals["get_seq_length"](layer))  # fills, not a host-to-device copy
    out[1].fill_(kv_offset)
    return out


_offsets_break = eager_on_graph(name="transformers sliding-window position")(_read_offsets)


# -- which attention layers are windowed, and the refusals ---------------------------------------

_WINDOWED_LAYERS = ("sliding_attention", "chunked_attention")


def reason(module: Any, kwargs: dict[str, Any]) -> str | None:
    """Why this attention layer attends through a window (in words), or None for full
    attention. Read from what the model says, not from the call alone: the call's
    ``sliding_window=`` (Mistral, Phi-3, Gemma), the module's ``sliding_window`` (Qwen2-MoE sets
    it on sliding layers and passes it through the mask only), the config's ``layer_types``
    entry for this layer (Gemma 2/3, Qwen2, Qwen2-MoE, Cohere 2, Llama 4's chunked layers...),
    else the config's ``sliding_window`` unless ``use_sliding_window`` is off. Qwen2-style
    configs write 0 or None for "no window"."""
    window = kwargs.get("sliding_window")
    if window:
        return f"sliding_window={window} in the attention call"
    window = getattr(module, "sliding_window", None)
    if window and getattr(module, "is_sliding", True) is not False:  # Exaone 4: set on all
        return f"{type(module).__name__}.sliding_window={window}"
    config = getattr(module, "config", None)
    if config is None:
        return None
    kind = _layer_type(module)
    if kind is not None:
        layer = module.layer_idx
        return f"config.layer_types[{layer}]={kind!r}" if kind in _WINDOWED_LAYERS else None
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return f"config.sliding_window={window}"
    return None


def _layer_type(module: Any) -> str | None:
    layer_types = getattr(getattr(module, "config", None), "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    if layer_types and isinstance(layer, int) and 0 <= layer < len(layer_types):
        kind: str = layer_types[layer]
        return kind
    return None


def refuse_unless_captured(module: Any, kwargs: dict[str, Any]) -> None:
    """At capture, before a layer's attention: a windowed layer is captured only when its cache
    update just now was a sliding layer's break (a ``StaticCache``; not for chunked attention,
    whose mask differs). Otherwise (a ``DynamicCache``, another cache class) transformers keeps
    the position in a Python int that a graph would freeze: every replay at another position
    would attend with the capture's mask, wrong logits and no error."""
    updated = took_last_update()
    why = reason(module, kwargs)
    if why is None or (updated and _layer_type(module) != "chunked_attention"):
        return
    raise CaptureError(
        f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) uses "
        f"sliding-window attention ({why}) and its cache layer is not a StaticCache sliding "
        "layer (or the layer attends in chunks): transformers keeps that position in a Python "
        "int, which a graph would freeze, so every replay at another position would use the "
        "capture's mask and positions. Decode with a transformers.StaticCache (its sliding "
        "layers are captured, one-token steps), or run this model eagerly."
    )


def compiled_error(cls: str, layer: object, why: str) -> CaptureError:
    """The refusal of a compiled sliding-window layer's capture (its sdpa op raises it)."""
    return CaptureError(
        f"{cls} (layer {layer}) uses sliding-window attention ({why}) in a torch.compile'd "
        "step: the compiler traces transformers' sliding-window cache code and specializes on "
        "its Python int position, so a graph of it would replay the capture's mask and "
        "positions. Capture this model uncompiled (bcg makes the sliding layers' cache update "
        "a break), or build it with full attention when the context fits the window "
        "(config.sliding_window = None for Mistral and Phi-3, use_sliding_window = False for "
        'Qwen2 and Qwen2-MoE, every layer_types entry "full_attention"); otherwise run this '
        "step without a capture."
    )
