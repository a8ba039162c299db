"""Every attention *op* of a diffusers transformer as a break point, projections captured.

diffusers runs attention in two ways, and both are module-level names looked up at call time:

- models built on the dispatcher (Flux, Wan, QwenImage, HunyuanVideo, LTX, ...) call
  ``dispatch_attention_fn``, imported by name into each model module. Patching it in
  ``diffusers.models.attention_dispatch`` reaches no model, so the name is patched in every
  module that holds it;
- processor-based models (SD3, PixArt, Sana's cross-attention, HunyuanDiT, ...) call
  ``F.scaled_dot_product_attention`` inside their processors, ``F`` being the processor
  module's alias of ``torch.nn.functional``. That alias is replaced, in those modules only, by a
  stand-in for ``torch.nn.functional`` whose ``scaled_dot_product_attention`` is the break. Patching
  ``torch.nn.functional`` itself would reach every library in the process; wrapping the
  processor's ``__call__`` would put the Q/K/V and output projections in the break. The
  stand-in forwards every other name to the live ``torch.nn.functional``, and its break calls
  the ``scaled_dot_product_attention`` found there at call time, so a kernel installed there
  later (SageAttention's recipe) is honoured.

The modules looked at are those defining the classes (and their bases) of the model's
submodules and of their attention processors; torch's own modules are never touched. The
patches are reference-counted (see ``_patching.py``) and pass through unless the breakable-graph
flag is on, so eager calls are unchanged.
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from bcg_core import PatchHandle
from bcg_diffusion._attention import attention_method, make_breakable_attention_forward

_DISPATCH = "dispatch_attention_fn"
_SDPA = "scaled_dot_product_attention"
# Marks a breakable stand-in for torch.nn.functional, so a module patched already is recognised.
_FUNCTIONAL_OF = "__bcg_functional_of__"
_MODULE_METADATA = ("__file__", "__package__", "__loader__", "__spec__")


def breakable_functional(functional: types.ModuleType) -> types.ModuleType:
    """A stand-in for ``torch.nn.functional`` whose ``scaled_dot_product_attention`` is a break
    point (under the flag); every other name is looked up on the live ``functional`` at each
    access (the module ``__getattr__`` of PEP 562), so a name set there later reaches it.

    The break calls ``functional.scaled_dot_product_attention`` as it is when the call runs (one
    attribute lookup), so a kernel a user installs there later (``F.scaled_dot_product_attention
    = sageattn``) runs in plain calls and in every break. One stand-in per ``functional`` for
    the process: a compiled step guards on it, so a new one per handle recompiled the step."""
    with _stand_ins_lock:
        proxy = _stand_ins.get(functional)
        if proxy is None:
            proxy = _stand_ins[functional] = _new_breakable_functional(functional)
    return proxy


_stand_ins_lock = threading.Lock()
_stand_ins: dict[types.ModuleType, types.ModuleType] = {}


def _new_breakable_functional(functional: types.ModuleType) -> types.ModuleType:
    proxy = types.ModuleType(functional.__name__, functional.__doc__)

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        return functional.scaled_dot_product_attention(*args, **kwargs)

    def __getattr__(name: str) -> Any:  # only names missing from the proxy's own dict
        return getattr(functional, name)

    def __dir__() -> list[str]:
        return sorted(set(dir(functional)) | set(vars(proxy)))

    scaled_dot_product_attention.__qualname__ = _SDPA
    scaled_dot_product_attention.__doc__ = getattr(functional, _SDPA).__doc__
    proxy.__dict__.update(
        {
            _SDPA: make_breakable_attention_forward(scaled_dot_product_attention),
            "__getattr__": __getattr__,
            "__dir__": __dir__,
            _FUNCTIONAL_OF: functional,
        }
    )
    for name in _MODULE_METADATA:  # what inspect and pickling read off a module
        if name in vars(functional):
            setattr(proxy, name, vars(functional)[name])
    return proxy


def make_attention_ops_breakable(model: torch.nn.Module) -> PatchHandle:
    """Make every attention op of a diffusers transformer a break point; return the handle.

    The handle undoes it (``remove()`` or a ``with`` block; pass it to :class:`DiTRunner` as
    ``breakable_attention=`` and the runner releases it on ``close()``).

    Covers models calling ``dispatch_attention_fn`` (any backend) and processors calling
    ``F.scaled_dot_product_attention``; see the module docstring for what is patched and why.
    A processor whose ``__call__`` reads tensor values on the host (``nonzero``, ``.item()``,
    ``.tolist()``, ``.cpu()`` ...: Mochi's per-sample prompt mask) cannot be captured around
    its op, so its whole ``__call__`` is the break instead (projections included); so is
    that of a processor that is an ``nn.Module`` (IP-Adapter, Custom Diffusion), whose state
    (the IP-Adapter ``scale``) is then read at every replay.
    Each patched name holds one more reference per call, so several runners can share a model
    class. A :class:`DiTRunner` owning the handle scans the model again at each capture and
    patches processors set since (``set_attn_processor``, an IP-Adapter loaded).
    Not covered: code calling ``torch.nn.functional.scaled_dot_product_attention`` by its
    full path, and attention that is no sdpa (Sana's linear self-attention, which is all matmuls
    and stays in the graph).

    Args:
        model: the diffusers transformer (any ``torch.nn.Module`` whose modules call the
            attention ops above).

    Returns:
        A :class:`PatchHandle` holding one reference on every patched name.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (a pipeline: pass ``pipe.transformer``).
        ValueError: no module of the model calls an attention op it knows (nothing is
            patched); the message names the fallback, :func:`install_breakable_attention`.
    """
    given: object = model  # typed as a module; callers pass pipelines too
    if not isinstance(given, torch.nn.Module):
        # A pipeline has no modules() (was: an AttributeError naming it); its transformer has.
        inner = "its transformer" if hasattr(given, "transformer") else "the transformer"
        raise TypeError(
            "make_attention_ops_breakable takes the diffusers transformer, an nn.Module, got "
            f"a {type(given).__name__}; pass {inner} (e.g. pipe.transformer)"
        )
    patches = _attention_patches(model)
    if not patches:
        raise ValueError(
            f"found no attention op in {type(model).__name__}: none of its modules calls "
            f"{_DISPATCH} or F.{_SDPA}; make its attention class a break with "
            "install_breakable_attention(cls) instead"
        )
    handle = PatchHandle.patch_all(patches)
    with _made_lock:
        _made[handle] = (weakref.ref(model), {(t, n) for t, n, _ in patches})
    return handle


def patch_new_attention(handle: PatchHandle) -> PatchHandle | None:
    """Patch what the model of ``handle`` (a :func:`make_attention_ops_breakable` handle) needs
    now and the handle does not hold: processors set after it was made (``set_attn_processor``,
    an IP-Adapter loaded). Their code was not scanned, so an IP-Adapter ``scale`` was a constant
    of the graph. Returns a handle on the new patches (the caller releases it), or None."""
    with _made_lock:
        made = _made.get(handle)
        model = None if made is None else made[0]()
        if made is None or model is None:
            return None
        missing = [p for p in _attention_patches(model) if (p[0], p[1]) not in made[1]]
        if not missing:
            return None
        extra = PatchHandle.patch_all(missing)
        made[1].update((t, n) for t, n, _ in missing)  # asked again, they are held already
        return extra


# Each handle's model (weakly) and the (target, name) pairs it and patch_new_attention patched.
_made_lock = threading.Lock()
_made: weakref.WeakKeyDictionary[
    PatchHandle, tuple[weakref.ref[torch.nn.Module], set[tuple[Any, str]]]
] = weakref.WeakKeyDictionary()


def _attention_patches(model: torch.nn.Module) -> list[tuple[Any, str, Any]]:
    """The ``(target, name, wrap)`` patches that make every attention op of ``model`` a break."""
    patches: list[tuple[Any, str, Any]] = [
        (cls, "__call__", make_breakable_attention_forward)
        for cls in _host_reading_processors(model)
    ]
    for module in _source_modules(model):
        if callable(vars(module).get(_DISPATCH)):
            patches.append((module, _DISPATCH, make_breakable_attention_forward))
        if not _calls_sdpa(module):
            continue
        for name, value in list(vars(module).items()):
            if value is torch.nn.functional or _is_breakable_functional(value):
                patches.append((module, name, breakable_functional))
    return patches


# Names whose call waits for the device (a value read on the host, or an output shape that
# depends on values): a processor whose __call__ names one cannot have its code captured.
_HOST_READS = frozenset(
    {"nonzero", "item", "tolist", "cpu", "numpy", "masked_select", "unique", "bincount", "argwhere"}
)


# __call__s that run no attention (nn.Module's hook dispatcher).
_NOT_PROCESSOR_CALLS = (torch.nn.Module.__call__,)


def _host_reading_processors(model: torch.nn.Module) -> list[type]:
    """Classes of the model's attention processors whose ``__call__`` reads tensor values on
    the host (Mochi's per-sample ``nonzero`` over the prompt mask), or that are modules with
    state of their own (IP-Adapter): the whole ``__call__`` becomes the break (projections
    included), since its code cannot be captured."""
    found: dict[type, None] = {}
    for sub in model.modules():
        processor = getattr(sub, "processor", None)
        if processor is None or isinstance(processor, type):
            continue
        cls = type(processor)
        if cls in found:
            continue
        if _is_module_processor(cls):
            # IP-Adapter, Custom Diffusion: a processor that is a module holds state its
            # __call__ reads (the scale pipe.set_ip_adapter_scale writes), which a graph
            # captured around its op alone would keep at the capture's value.
            found[cls] = None
            continue
        calls = (vars(k)["__call__"] for k in cls.__mro__ if "__call__" in vars(k))
        call = next((c for c in calls if c not in _NOT_PROCESSOR_CALLS), None)
        if any(_names_any(code, _HOST_READS) for code in _codes_of(call)):
            found[cls] = None
    return list(found)


def _is_module_processor(cls: type) -> bool:
    """Whether ``cls`` is an ``nn.Module`` processor running attention in ``__call__`` (its
    ``forward`` is ``nn.Module``'s placeholder), as install_breakable_attention tells it."""
    try:
        return issubclass(cls, torch.nn.Module) and attention_method(cls) == "__call__"
    except TypeError:
        return False


# Wrapper layers looked through for a function's code (a guard against self-referencing ones).
_MAX_UNWRAP = 32


def _codes_of(func: Any) -> list[types.CodeType]:
    """The code of ``func`` and of every function it wraps: a staticmethod's or classmethod's
    ``__func__``, a decorator's ``__wrapped__`` (bcg's own break included, so a class another
    handle patched already is still recognised by what its original code names)."""
    codes: list[types.CodeType] = []
    for _ in range(_MAX_UNWRAP):
        if func is None:
            break
        func = getattr(func, "__func__", func)
        code = getattr(func, "__code__", None)
        if isinstance(code, types.CodeType):
            codes.append(code)
        inner = getattr(func, "__wrapped__", None)
        func = None if inner is func else inner
    return codes


def _names_any(code: types.CodeType, names: frozenset[str]) -> bool:
    """Whether ``code`` or a function nested in it names one of ``names``."""
    codes = [code]
    while codes:
        c = codes.pop()
        if names.intersection(c.co_names):
            return True
        codes.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return False


def _is_breakable_functional(value: Any) -> bool:
    return getattr(value, _FUNCTIONAL_OF, None) is torch.nn.functional


def _source_modules(model: torch.nn.Module) -> list[types.ModuleType]:
    """Python modules defining the classes of ``model``'s submodules and attention processors
    (bases included), in first-seen order; torch's and builtins' excluded."""
    seen: dict[str, types.ModuleType] = {}
    for obj in _model_objects(model):
        for cls in type(obj).__mro__:
            name = cls.__module__
            if name in seen or name == "builtins" or name.split(".")[0] == "torch":
                continue
            module = sys.modules.get(name)
            if module is not None:
                seen[name] = module
    return list(seen.values())


def _model_objects(model: torch.nn.Module) -> Iterator[object]:
    for sub in model.modules():
        yield sub
        processor = getattr(sub, "processor", None)
        if processor is not None:
            yield processor


def _calls_sdpa(module: types.ModuleType) -> bool:
    """Whether code defined in ``module`` (functions, methods, nested functions) names
    ``scaled_dot_product_attention``."""
    codes: list[types.CodeType] = []
    for value in vars(module).values():
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if isinstance(value, type):
            members: list[Any] = list(vars(value).values())
        else:
            members = [value]
        for member in members:
            codes.extend(_codes_of(member))  # through staticmethods and wrappers (bcg's too)
    return any(_names_any(code, frozenset({_SDPA})) for code in codes)
