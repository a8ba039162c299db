"""transformers integration: a breakable attention implementation on top of a registered one.

transformers looks attention up by name on every forward
(``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``) and the mask
function by the same name (``ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]``). A name
registered for attention but not for masks is taken for a backend that builds no mask, so the
attention silently gets ``attention_mask=None`` (StaticCache decode then attends to every empty
slot). :func:`breakable_attention` therefore registers both, under one name.

The break is the attention call alone (for ``sdpa``, the kernel call alone): the Q/K/V
projections, RoPE and the KV-cache update (``StaticCache`` writes in place, in the graph) are
captured; at replay the break runs again on the capture-time query and the cache tensors, which
a static cache keeps at fixed addresses. Sliding-window cache layers, whose position is a Python
int, add breaks of their own (``sliding_window.py``).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._python_dispatch
from torch.overrides import TorchFunctionMode

from bcg_core._capture import opaque
from bcg_core._capture.breaks import breaks_observed, eager_on_graph
from bcg_core._capture.context import is_breakable_capture_active
from bcg_core._capture.flag import is_in_breakable_cuda_graph
from bcg_core._errors import CaptureError
from bcg_core._integrations import dynamic_cache, sliding_window, static_cache

logger = logging.getLogger("bcg_core")

PREFIX = "bcg_"
_PAGED = "paged|"
_EXTRA = 'pip install "bcg-core[transformers]"'

_lock = threading.Lock()
_registered: dict[str, str] = {}  # base implementation -> registered name


def breakable_attention(base: str = "sdpa") -> str:
    """Register a breakable version of a transformers attention implementation; return its name.

    Use the name as ``attn_implementation``::

        name = bcg_core.breakable_attention("sdpa")           # "bcg_sdpa"
        model.set_attn_implementation(name)   # or from_config(..., attn_implementation=name)

    ``base`` is any name registered in transformers' ``AttentionInterface`` (``sdpa``,
    ``flex_attention``, a custom one) or ``eager`` (each model's own ``eager_attention_forward``,
    found from the attention module's class). The new name is ``"bcg_" + base`` (after a
    ``paged|`` prefix), so transformers' substring checks (``"sdpa" in name``) still apply. Its
    mask function is ``base``'s, registered under the new name too; a base without one gets none,
    as before.

    While :func:`is_in_breakable_cuda_graph` is true the attention call is one
    ``@eager_on_graph`` break; otherwise it is ``base``'s function, unchanged. For ``sdpa`` the
    break is the fused attention kernel alone: the rest of the function (``repeat_kv``, the
    output's transpose and copy) and what ``scaled_dot_product_attention`` does before its
    kernel (the boolean mask's conversion) are captured, so a replay runs one kernel op per
    layer (the ``scaled_dot_product_attention`` call where torch picks its math backend).
    Registering is process-wide, idempotent and additive (no existing name changes).

    Sliding-window layers of a ``StaticCache`` are captured for one-token steps: transformers
    keeps their position in a Python int, so their cache update is a break and their position
    (for RoPE and the sliding mask) the output of one more break per forward (see
    ``sliding_window.py``). Capturing a sliding-window layer any other way (another cache, a
    chunked layer, a step of several tokens, a ``torch.compile``d step) raises
    :class:`CaptureError`, and so does capturing the update of a ``DynamicCache`` layer made
    before the capture, in any model (its ``torch.cat`` growth would replay the capture's
    context; see ``dynamic_cache.py``).
    A ``StaticCache`` reordered for beam search (the ``reorder_cache`` of ``StaticLayer``,
    ``StaticIndexedLayer``, the linear-attention layers and a model's own subclasses) is reordered
    in place, so a graph over it reads the reordered cache (see ``static_cache.py``).

    Args:
        base: the implementation to wrap (default ``"sdpa"``), optionally with the ``paged|``
            prefix; a name that already starts with ``bcg_`` is returned as it is once
            registered, and otherwise stands for its base (``"bcg_eager"`` registers
            ``"eager"``'s breakable version).

    Returns:
        The registered name, ``"bcg_" + base`` (after a ``paged|`` prefix).

    Raises:
        ImportError: transformers (>= 5) is missing; the message names the extra to install.
        ValueError: ``base`` is unknown, or is a ``flash_attention_*`` implementation, whose
            functions pick their kernel from the model config's implementation name and cannot
            run under another name.
        TypeError: ``base`` is not a string.
    """
    if not isinstance(base, str):
        # (It failed with the raw "'int' object has no attribute 'startswith'".)
        raise TypeError(
            "breakable_attention takes an attention implementation's name, such as 'sdpa' or "
            f"'paged|sdpa', got {base!r}"
        )
    attention_interface, mask_interface = _interfaces()
    sliding_window.install()
    dynamic_cache.install()
    static_cache.install()
    paged = base.startswith(_PAGED)
    plain = base.removeprefix(_PAGED)
    if plain.startswith(PREFIX):
        if base in attention_interface._global_mapping:
            return base  # already breakable (or the user's own name)
        # A bcg name not registered yet (a fresh process, a config saved with it): register its
        # base; returning the bare name made transformers refuse it as unknown at model load,
        # and a base that does not exist went unnoticed until then.
        plain = plain.removeprefix(PREFIX)
        base = (_PAGED if paged else "") + plain
    if "flash" in plain:
        raise ValueError(
            f"breakable_attention({base!r}): transformers' flash attention functions choose their "
            "kernel from the model's attn_implementation name, so they cannot run under a new "
            'name; use "sdpa" (or register your own flash function and wrap that name)'
        )
    with _lock:
        name = _registered.get(base)
        if name is not None:
            return name
        if plain == "eager" and not paged:
            function = _model_eager
        elif base in attention_interface._global_mapping:
            function = attention_interface._global_mapping[base]
        else:
            known = sorted({"eager", *attention_interface._global_mapping})
            raise ValueError(
                f"breakable_attention: unknown attention implementation {base!r}; transformers "
                f"has {known}"
            )
        name = (_PAGED if paged else "") + PREFIX + plain
        kernel_only = base == "sdpa"
        attention_interface.register(name, _make_breakable(function, name, kernel_only))
        mask = mask_interface._global_mapping.get(base)
        if mask is not None:
            # sdpa's mask is captured (tested on CUDA), but for a sliding layer given an
            # attention mask; any other base's may not be: eager's fill value is
            # torch.tensor(0.0, device=...), a pageable copy a capture refuses.
            mask_interface.register(name, _mask_as_break(mask, name, sdpa=base == "sdpa"))
        _registered[base] = name
        return name


def _interfaces() -> tuple[Any, Any]:
    try:
        import transformers
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError as exc:
        raise ImportError(
            f"bcg_core.breakable_attention needs transformers >= 5: {_EXTRA}"
        ) from exc
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ImportError(
            f"bcg_core.breakable_attention needs transformers >= 5, found "
            f"{transformers.__version__}: {_EXTRA}"
        )
    return AttentionInterface, AttentionMaskInterface


def _model_eager(module: Any, *args: Any, **kwargs: Any) -> Any:
    """The eager attention of the model ``module`` belongs to: transformers keeps no global
    ``eager`` function, each modeling file defines ``eager_attention_forward``."""
    modeling = sys.modules[type(module).__module__]
    function = getattr(modeling, "eager_attention_forward", None)
    if function is None:
        raise TypeError(
            f"{type(module).__module__} defines no eager_attention_forward; use "
            'breakable_attention("sdpa") for this model'
        )
    return function(module, *args, **kwargs)


def _make_breakable(
    function: Callable[..., Any], name: str, kernel_only: bool
) -> Callable[..., Any]:
    label = f"transformers attention ({name})"
    as_break = eager_on_graph(name=label)(function)
    sdpa_break = eager_on_graph(name=label)(_sdpa)
    kernel_break = eager_on_graph(name=label)(_fused_kernel)
    warned: list[bool] = []  # said once per registered name

    def attention(module: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_in_breakable_cuda_graph():
            return function(module, *args, **kwargs)
        capturing = is_breakable_capture_active()
        if capturing:
            sliding_window.refuse_unless_captured(module, kwargs)
        if not kernel_only:
            return as_break(module, *args, **kwargs)
        if not capturing and not breaks_observed():
            return function(module, *args, **kwargs)
        with _KernelAsBreak(kernel_break, sdpa_break) as mode:
            out = function(module, *args, **kwargs)
        if mode.calls == 0 and not warned:
            warned.append(True)
            logger.warning(
                "bcg: %s: %s made no torch.nn.functional.scaled_dot_product_attention call, so "
                "the attention was captured into the graph, with no break (this transformers "
                "version computes sdpa attention another way; please report it)",
                name,
                getattr(function, "__qualname__", function),
            )
        return out

    # Under torch.compile dynamo traces transformers' function (repeat_kv, the transposes, the
    # copies: compiled), and only its scaled_dot_product_attention call is one opaque op, routed
    # there by a torch function mode that dynamo traces too. Nothing traced reads the flag or
    # the capture: at run time the op runs a gated break of the sdpa call (the whole call, mask
    # conversion included: the fused kernel cannot be singled out below a custom op, where
    # Python dispatch modes do not reach). A sliding-window layer's reason, read at trace time
    # from the module, is passed along, and the op refuses a capture with it (compiled, the
    # sliding cache layer's Python int position is traced, not a break).
    sdpa_compiled = eager_on_graph(name=label, gated=True)(_sdpa)

    def run_sdpa(layer: tuple[str, int, str | None], *args: Any, **kwargs: Any) -> Any:
        cls, index, why = layer
        if why is not None and is_in_breakable_cuda_graph() and is_breakable_capture_active():
            raise sliding_window.compiled_error(cls, index, why)
        return sdpa_compiled(*args, **kwargs)

    def fake_sdpa(layer: tuple[str, int, str | None], *args: Any, **kwargs: Any) -> Any:
        return _sdpa(*args, **kwargs)

    sdpa_id = opaque.register(run_sdpa, fake_sdpa, label)
    graph_broken = torch._disable_dynamo(attention, recursive=True)  # type: ignore[attr-defined]

    def breakable(module: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_compiling():
            return attention(module, *args, **kwargs)
        grad = opaque.grad_refusal([*args, *kwargs.values()]) if kernel_only else None
        if grad is not None:
            # The op has no backward (AOTAutograd failed the compile with the raw "Trying to
            # backward through bcg.opaque.default"): in grad mode the attention is a dynamo
            # graph break, as any break taking a tensor that requires grad, and autograd runs
            # through it eagerly.
            import torch._dynamo  # imported already: dynamo is tracing this

            torch._dynamo.graph_break(msg=f"bcg: {name} attention{opaque.UNTRACEABLE}{grad}")
            return graph_broken(module, *args, **kwargs)
        if kernel_only:
            layer = (type(module).__name__, getattr(module, "layer_idx", -1))
            with _SdpaAsOpaqueOp(sdpa_id, (*layer, sliding_window.reason(module, kwargs))):
                return function(module, *args, **kwargs)
        return graph_broken(module, *args, **kwargs)  # other bases read any module attribute

    breakable.__name__ = breakable.__qualname__ = f"{name}_attention_forward"
    breakable.__doc__ = f"{getattr(function, '__name__', function)}, as a bcg break point."
    return breakable


class _SdpaAsOpaqueOp(TorchFunctionMode):
    """While dynamo traces one sdpa attention function: its
    ``scaled_dot_product_attention`` call becomes the opaque op ``function_id`` names, taking
    ``layer`` (constants) before the call's arguments; every other call is traced as usual."""

    def __init__(self, function_id: int, layer: tuple[str, int, str | None]) -> None:
        super().__init__()
        self._id = function_id
        self._layer = layer

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        bound = _sdpa_arguments(*args, **kwargs)
        mask = None if bound is None else bound[3]
        if bound is not None and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            # sdpa's first step, turning a boolean mask into an additive one (0 where True,
            # -inf where False, in the query's dtype: the same values), done here so that
            # inductor compiles it and the break at every replay is the attention alone.
            q, k, v, _, dropout_p, is_causal, scale, enable_gqa = bound
            additive = torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, float("-inf"))
            args, kwargs = (q, k, v), {
                "attn_mask": additive, "dropout_p": dropout_p, "is_causal": is_causal,
                "scale": scale, "enable_gqa": enable_gqa,
            }  # fmt: skip
        return opaque.call(self._id, (self._layer, *args), kwargs)


_is_compiling = torch.compiler.is_compiling


def _mask_as_break(mask: Callable[..., Any], name: str, sdpa: bool = False) -> Callable[..., Any]:
    """``mask`` as one break under the flag: it runs eagerly at every replay, reading the
    cache position tensor at its captured address, and the next segment reads its output.

    ``sdpa``: the mask is captured, except a sliding layer's given a 2D attention mask:
    transformers pads that mask by comparing the layer's key offset on the host
    (``prepare_padding_mask``), and bcg makes that offset a tensor (``sliding_window.py``), so
    captured it raised HostSyncError and the runner served every such step eagerly."""
    as_break = eager_on_graph(name=f"transformers mask ({name})")(mask)

    def mask_function(*args: Any, **kwargs: Any) -> Any:
        if sdpa and (
            kwargs.get("attention_mask") is None
            or not isinstance(kwargs.get("kv_offset"), torch.Tensor)
        ):
            return mask(*args, **kwargs)  # (checked first: no flag read under torch.compile)
        if not is_in_breakable_cuda_graph():
            return mask(*args, **kwargs)
        return as_break(*args, **kwargs)

    functools.update_wrapper(mask_function, mask)  # __wrapped__: base's mask function
    mask_function.__name__ = mask_function.__qualname__ = f"{name}_mask"
    return mask_function


def _sdpa(*args: Any, **kwargs: Any) -> Any:
    """The attention call that ``bcg_sdpa`` makes a break when no fused kernel serves it (a
    Python function, so the break has a name and a replayable callable)."""
    return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)


def _fused_kernel(kernel: Any, *args: Any, **kwargs: Any) -> Any:
    """The fused attention kernel ``scaled_dot_product_attention`` chose, as a break: its
    attention output (the other results, log-sum-exp and RNG state, sdpa discards)."""
    return kernel(*args, **kwargs)[0]


@functools.cache
def _fused_kernels() -> frozenset[Any]:
    """The aten ops in which sdpa's fused backends end (flash, CPU flash, memory-efficient,
    cuDNN, out-of-tree): everything sdpa does before one of them is preparation."""
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    return frozenset(
        getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)
    )


_MATH = 0  # torch's SDPBackend numbering: math, then the fused backends


def _chooses_fused_kernel(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this sdpa call will end in one fused kernel op: torch's own backend choice for
    these arguments, on plain tensors that need no gradient (the kernel's other results would
    be needed for backward)."""
    bound = _sdpa_arguments(*args, **kwargs)
    if bound is None:
        return False
    q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = bound
    tensors = (q, k, v) if mask is None else (q, k, v, mask)
    if any(type(t) is not torch.Tensor or t.is_nested for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    choice = torch._fused_sdp_choice(
        q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return int(choice) != _MATH


def _sdpa_arguments(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **unknown: Any,
) -> tuple[Any, ...] | None:
    """``scaled_dot_product_attention``'s arguments, bound by its signature (None for a call
    this torch's signature does not cover: such a call keeps the whole-sdpa break)."""
    if unknown:
        return None
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class _KernelAsBreak(TorchFunctionMode):
    """While one sdpa attention call is captured, only its attention kernel is the break: the
    rest of transformers' function (``repeat_kv``, mask slicing, the transpose and copy of the
    output) is captured into the graph, and so is what ``scaled_dot_product_attention`` does
    before its fused kernel (the boolean mask's conversion to an additive one, padding,
    layout), so each replay runs one kernel op per layer and nothing else. Where torch picks
    its math backend (no single kernel op), the ``scaled_dot_product_attention`` call is the
    break. A torch function mode is thread-local: nothing outside this call sees it."""

    def __init__(self, kernel_break: Callable[..., Any], sdpa_break: Callable[..., Any]) -> None:
        super().__init__()
        self._kernel_break = kernel_break
        self._sdpa_break = sdpa_break
        self.calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        if not _chooses_fused_kernel(args, kwargs):
            return self._sdpa_break(*args, **kwargs)
        with _FusedKernelAsBreak(self._kernel_break) as kernel_mode:
            out = func(*args, **kwargs)
        if kernel_mode.calls != 1:
            raise CaptureError(
                f"bcg: scaled_dot_product_attention reached {kernel_mode.calls} fused attention "
                "kernels where torch's backend choice promised one, so bcg_sdpa cannot make its "
                "kernel the break on this torch version; use "
                'breakable_attention("eager") (please report the torch version)'
            )
        return out


_SDPA = torch.ops.aten.scaled_dot_product_attention.default


class _FusedKernelAsBreak(torch.utils._python_dispatch.TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Inside one sdpa call under capture: its fused kernel op becomes the break, every other
    op (sdpa's preparation of the mask and inputs, the slicing of the output) is captured as
    usual. Same kernel, same arguments as eager sdpa, so replays equal eager bitwise."""

    def __init__(self, kernel_break: Callable[..., Any]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._break = kernel_break
        self._kernels = _fused_kernels()
        self.calls = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA:
            # Under inference mode sdpa reaches the mode whole (the autograd key, which would
            # have run its decomposition, is skipped): decompose it here, in the mode, so that
            # its fused kernel (the one eager picks) reaches the mode as the break.
            with self:
                return func.decompose(*args, **kwargs)
        if func not in self._kernels:
            return func(*args, **kwargs)
        self.calls += 1
        out = self._break(func, *args, **kwargs)
        # sdpa keeps only the attention output; the other results are never read, and a
        # replay does not return them at all.
        return (out, *(_unused_result(r.type, out) for r in func._schema.returns[1:]))


def _unused_result(kind: Any, like: torch.Tensor) -> Any:
    text = str(kind)
    if text == "Tensor":
        return like.new_empty(0)
    if text.endswith("?"):
        return None
    return 0
