"""The breakable attention adapter: DiT attention modules become eager break points.

While :func:`bcg_core.is_in_breakable_cuda_graph` is true, an adapted ``forward`` runs as one
``@eager_on_graph`` break: at capture it ends the graph segment and runs eagerly, at every replay
it runs again on the capture-time inputs and its output is copied into the capture-time output.
Otherwise it is the original forward (one check of the flag). Under ``torch.compile`` an adapted
attention op is one opaque op that makes this choice at run time; a patched method (whose first
argument is a module) is a dynamo graph break instead. Whatever structure the forward returns (a
tensor, a ``(out, lse)`` tuple, a NamedTuple, a dataclass) reaches the caller with its type: the
bridge is the capture-time output itself, refreshed in place at every replay.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from bcg_core import PatchHandle, eager_on_graph

_ORIGINAL = "__bcg_original_forward__"

# The wrapper keeps the forward's signature and return type (as eager_on_graph's does), so a
# typed caller of the adapted forward needs no cast.
_F = TypeVar("_F", bound=Callable[..., Any])


def make_breakable_attention_forward(forward: _F) -> _F:
    """Wrap an attention ``forward(self, *args, **kwargs)`` as a break point under the flag.

    While the breakable-graph flag is set the wrapper is an :func:`bcg_core.eager_on_graph`
    break; otherwise it is a transparent pass-through.

    The break is named after the forward's ``__qualname__``; the wrapper keeps its name and
    docstring, and for type checkers its signature. Wrapping an already wrapped forward returns it
    unchanged, and wrapping the same forward again returns the same wrapper (a compiled step
    keeps its compiled code across handles).

    Args:
        forward: the attention method (an unbound function taking the module first).

    Returns:
        The wrapped forward, to assign in its class (or pass to :func:`patch_attribute`).
    """
    if not callable(forward):
        raise TypeError(
            "make_breakable_attention_forward takes an attention forward (a function taking the "
            f"module first, e.g. MyAttention.forward), got {forward!r}"
        )
    if getattr(forward, _ORIGINAL, None) is not None:
        return forward  # already adapted
    with _wrappers_lock:
        adapted = _wrappers.get(forward)
        if adapted is None:
            name = f"{getattr(forward, '__qualname__', 'attention')}"
            # gated: the flag is read when the call runs, so under torch.compile the call is one
            # opaque op (nothing dynamo traces reads the flag) that decides at run time.
            adapted = eager_on_graph(name=name, gated=True)(forward)
            setattr(adapted, _ORIGINAL, forward)
            _wrappers[forward] = adapted
    return cast(_F, adapted)


# One wrapper per forward for the process: dynamo guards a compiled step on the wrapper (its
# break's id), so a new wrapper per patch recompiled the step at every new handle, and the 9th
# runner's handle hit torch's recompile_limit (fullgraph=True failed, else eager kernels).
_wrappers_lock = threading.Lock()
_wrappers: dict[Callable[..., Any], Callable[..., Any]] = {}


class AttentionPatch(PatchHandle):
    """Handle returned by :func:`install_breakable_attention`.

    :meth:`remove` undoes the install (so does leaving a ``with`` block); removing twice is
    harmless. A handle acts on the install it was returned for: once that install is gone
    (removed, or uninstalled), a later install of the same class is another one, which this
    handle neither reports nor removes.

    Args:
        classes: the classes the install adapted.
        installs: the install (the reference in the registry) of each class, in order.
    """

    def __init__(self, classes: tuple[type, ...], installs: tuple[PatchHandle, ...]) -> None:
        super().__init__([], tuple(f"{c.__qualname__}.{attention_method(c)}" for c in classes))
        self.classes = classes
        self._installs = installs

    @property
    def active(self) -> bool:
        """Whether the install still holds its patch on any of its classes."""
        with _lock:
            return any(
                _installed.get(c) is h for c, h in zip(self.classes, self._installs, strict=True)
            )

    def remove(self) -> None:
        """Uninstall this install's patch from every class (a later install stays)."""
        with _lock:
            mine = [
                c
                for c, h in zip(self.classes, self._installs, strict=True)
                if _installed.get(c) is h
            ]
        uninstall_breakable_attention(*mine)


def attention_method(cls: type) -> str:
    """The method a class runs attention in: ``forward`` (modules) or ``__call__`` (diffusers
    attention processors). Raises ``TypeError`` for anything else.

    A ``torch.nn.Module`` subclass whose ``forward`` is only ``nn.Module``'s unimplemented
    placeholder and that defines ``__call__`` (diffusers' IP-Adapter and Custom Diffusion
    processors) runs attention in ``__call__``; ``nn.Module``'s own ``__call__`` (the hook
    dispatcher) never counts."""
    if isinstance(cls, type):
        forward = getattr(cls, "forward", None)
        calls = any("__call__" in vars(k) for k in cls.__mro__ if k not in _NOT_ATTENTION_CALLS)
        if callable(forward) and not (forward is _MODULE_FORWARD_PLACEHOLDER and calls):
            return "forward"
        if calls:
            return "__call__"
    # Shared by install/is_installed/DiTRunner(attention_classes=...): name no one caller.
    instance = callable(cls) and not inspect.isroutine(cls)  # a module or processor object
    hint = "; pass its class (type(module)), not an instance" if instance else ""
    raise TypeError(
        "expected attention classes with a forward or __call__ method (attention modules or "
        f"diffusers processor classes), got {cls!r}{hint}"
    )


# nn.Module's `forward` when a subclass defines none (it raises NotImplementedError).
_MODULE_FORWARD_PLACEHOLDER = torch.nn.Module.forward
# Bases whose `__call__` is no attention method: object's, and nn.Module's hook dispatcher.
_NOT_ATTENTION_CALLS = (object, torch.nn.Module)


def patch_attention_classes(*classes: type) -> PatchHandle:
    """Make each class's attention method (see :func:`attention_method`) a break point; one
    reference per class on the shared patch, released by the returned handle."""
    methods = [attention_method(cls) for cls in classes]  # validate all before patching any
    return PatchHandle.patch_all(
        (cls, method, make_breakable_attention_forward)
        for cls, method in zip(classes, methods, strict=True)
    )


_lock = threading.Lock()
# The references taken by install_breakable_attention: at most one per class (installing twice
# changes nothing), dropped by uninstall. Runners hold their own references.
_installed: dict[type, PatchHandle] = {}


def install_breakable_attention(*classes: type) -> AttentionPatch:
    """Make the attention method of each class a break point, in place.

    The attention method is ``forward``, or ``__call__`` for diffusers processor classes
    (also those that are ``nn.Module``s without a ``forward`` of their own, such as the
    IP-Adapter processors).

    Installing twice changes nothing; :func:`uninstall_breakable_attention` (or the handle)
    undoes it. The patch is reference-counted with the ones a :class:`DiTRunner` takes, so
    uninstalling never removes a patch that a live runner relies on. Every class is checked
    before any is patched.

    Args:
        *classes: attention module classes (with a ``forward``) or diffusers attention
            processor classes (with a ``__call__``).

    Returns:
        An :class:`AttentionPatch` whose ``remove()`` (or ``with`` block) uninstalls it.

    Raises:
        TypeError: an argument is not a class with a ``forward`` or ``__call__`` method.
    """
    for cls in classes:
        attention_method(cls)
    with _lock:
        made: dict[type, PatchHandle] = {}
        try:
            for cls in classes:
                if cls not in _installed and cls not in made:
                    made[cls] = patch_attention_classes(cls)
        except BaseException as exc:
            for handle in made.values():  # all or nothing
                handle.remove()
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"bcg: install_breakable_attention installed nothing ({cls!r} failed)")
            raise
        _installed.update(made)
        return AttentionPatch(classes, tuple(_installed[cls] for cls in classes))


def uninstall_breakable_attention(*classes: type) -> None:
    """Drop the patch :func:`install_breakable_attention` made on each class.

    Patches held by runners stay until they close; a class never installed is ignored.

    Args:
        *classes: the classes to uninstall from.
    """
    with _lock:
        handles = [_installed.pop(cls) for cls in classes if cls in _installed]
    for h in handles:
        h.remove()


def is_breakable_attention_installed(cls: type) -> bool:
    """Whether the attention method of ``cls`` is currently adapted (by anyone in bcg).

    Args:
        cls: an attention module or processor class.

    Returns:
        True while :func:`install_breakable_attention` or a :class:`DiTRunner` (its
        ``attention_classes``) holds a patch on the class's attention method.

    Raises:
        TypeError: ``cls`` is not a class with a ``forward`` or ``__call__`` method.
    """
    method = attention_method(cls)
    # The class that defines the method this class runs (a subclass inherits a patched one).
    owner = next((k for k in cls.__mro__ if method in vars(k)), cls)
    return PatchHandle.count(owner, method) > 0
