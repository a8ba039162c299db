"""Reference-counted attribute patches: a module's function, a class's method, one instance's,
an entry of a mapping (transformers' attention table). Shared by bcg's integrations (the
continuous-batching one here, the diffusers one in bcg_diffusion, through the public API).

A patch replaces ``target.name`` by ``wrap(original)``. Every call of :func:`patch_attribute`
takes one reference on ``(target, name, wrap)`` and returns a :class:`PatchHandle`; the
attribute goes back to what it was when the last reference on it is released. So two runners
can patch the same target, and closing one leaves the other's patch in place.

Several different ``wrap`` functions on one attribute stack in the order they were first
installed: the attribute is ``wrap_n(...wrap_1(original))``, recomputed from the original
whenever one of them is added or released, so they can be released in any order.

A class (or instance) that inherits the attribute composes its wraps over what it inherits now:
the base class's current value, a bcg patch of the base included. Whenever a class's patch
changes, every patched subclass and instance that inherits the attribute from it is recomposed
(bases first), so patching and releasing a base and a subclass in any order leaves each with its
own wraps over its base's current ones. A class that defines the attribute itself is its own
original and is not touched by its bases' patches.

All state is guarded by one lock. If something else replaced the attribute after bcg patched it,
bcg leaves it alone on release (restoring would clobber the other patch) and logs a warning.

:func:`hook_attribute` is the lighter tool of bcg's own temporary hooks (the backends' stream and
host-read hooks, installed while captures run): no sharing, but the same care on removal.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NoReturn, SupportsIndex, TypeVar

logger = logging.getLogger("bcg_core")

Wrap = Callable[[Any], Any]

_ABSENT = object()


@dataclass
class _Slot:
    """One patched attribute: what it held before bcg, and the wraps installed on it."""

    target: Any
    name: str
    kind: str  # "module", "class", "instance" or "mapping"
    original: Any  # the target's own attribute (its __dict__ entry), or _ABSENT
    base: Any  # what the wraps are applied to (the resolved original, e.g. an inherited method)
    # Where ``base`` came from when the attribute is inherited: the value found in a class of
    # the MRO (before binding, for an instance), re-read whenever a base class's patch changes;
    # _ABSENT when ``base`` is fixed (the target's own attribute, a module's, a mapping's).
    inherited: Any = _ABSENT
    layers: dict[Wrap, int] = field(default_factory=dict)  # wrap -> references, install order
    installed: Any = _ABSENT

    def describe(self) -> str:
        owner = getattr(self.target, "__qualname__", None) or getattr(self.target, "__name__", "")
        if self.kind == "instance":
            owner = f"{type(self.target).__qualname__} instance at {id(self.target):#x}"
        if self.kind == "mapping":
            return f"the mapping entry {self.name!r}"
        return f"{owner}.{self.name}"

    def own(self) -> Any:
        """What the target itself holds under the name now (not inherited), or _ABSENT."""
        if self.kind == "mapping":
            return self.target.get(self.name, _ABSENT)
        if self.kind == "instance":
            return _instance_own(self.target, self.name)
        return vars(self.target).get(self.name, _ABSENT)

    def put(self, value: Any) -> None:
        if self.kind == "mapping":
            self.target[self.name] = value
        else:
            setattr(self.target, self.name, value)

    def drop(self) -> None:
        if self.kind == "mapping":
            del self.target[self.name]
        else:
            delattr(self.target, self.name)


_lock = threading.RLock()
_slots: dict[tuple[int, str], _Slot] = {}


_R = TypeVar("_R", bound="Removable")


class Removable:
    """A handle that :meth:`remove` undoes; leaving a ``with`` block removes it too."""

    def remove(self) -> None:
        raise NotImplementedError

    def __enter__(self: _R) -> _R:
        return self

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # copy.copy, copy.deepcopy and pickle all come here. A shallow copy shared the
        # handle's references, so removing it and the original released one twice (another
        # holder's patch or enablement was undone); a deep copy said "active" and held nothing.
        raise TypeError(
            f"a {type(self).__name__} cannot be copied or pickled: it holds references that "
            "its remove() releases once; ask for another handle the way this one was made "
            "(patch_attribute(), enable_continuous_batching() ...)"
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()


class PatchHandle(Removable):
    """References on one or more patched attributes, returned by :func:`patch_attribute`.

    :meth:`remove` releases them (idempotent); a ``with`` block releases them on exit. Dropping
    a handle without removing it keeps its patches for the life of the process, as an
    unreleased reference should. Made by bcg, never by hand; it cannot be copied or pickled
    (``TypeError``): call :func:`patch_attribute` again for another reference.

    Args:
        refs: the references it holds, one ``(patched attribute, wrap)`` pair each.
        targets: the patched attributes in words (``"Attention.forward"``), for ``repr``.
    """

    def __init__(self, refs: list[tuple[_Slot, Wrap]], targets: tuple[str, ...]) -> None:
        self._refs = refs
        self.targets = targets

    @property
    def active(self) -> bool:
        """Whether this handle still holds its references."""
        return bool(self._refs)

    def remove(self) -> None:
        """Release every reference; an attribute whose last reference goes is restored.

        Removing again does nothing. An attribute that other code replaced after bcg patched
        it is left as it is, with a warning. A wrap that raises while an attribute is
        recomposed does not stop the release of the others: every reference is released, then
        the first such error is raised.
        """
        error: BaseException | None = None
        with _lock:
            refs, self._refs = self._refs, []
            for slot, wrap in reversed(refs):
                # (One raising left the handle's other attributes patched for good: the handle
                # was already empty, so nothing could release them.)
                try:
                    _release(slot, wrap)
                except BaseException as exc:  # raised below, after the others
                    error = error or exc
        if error is not None:
            raise error

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"PatchHandle({', '.join(self.targets)}; {state})"

    @staticmethod
    def count(target: Any, name: str) -> int:
        """References currently held on ``target.name`` by every handle, all wraps together.

        Args:
            target: the patched module, class, dict or instance.
            name: the attribute (or dict key).

        Returns:
            The number of references; 0 when bcg has no patch there.
        """
        with _lock:
            slot = _slots.get((id(target), name))
            return 0 if slot is None else sum(slot.layers.values())

    @classmethod
    def patch_all(cls, patches: Iterable[tuple[Any, str, Wrap]]) -> PatchHandle:
        """Patch several attributes at once, all or none, under one handle.

        Args:
            patches: ``(target, name, wrap)`` triples, each as for :func:`patch_attribute`.

        Returns:
            One handle holding a reference on each; ``remove()`` releases them all.

        Raises:
            AttributeError: a target lacks its attribute (what was patched is released).
            KeyError: a dict target lacks its key (likewise).
            ImportError: a dotted target name cannot be imported (likewise).
            TypeError: a wrap is not callable (likewise).
        """
        handles: list[PatchHandle] = []
        try:
            for target, name, wrap in patches:
                handles.append(patch_attribute(target, name, wrap))
        except BaseException:
            for h in handles:
                h.remove()
            raise
        refs = [ref for h in handles for ref in h._refs]
        return cls(refs, tuple(t for h in handles for t in h.targets))


def patch_attribute(target: Any, name: str, wrap: Wrap) -> PatchHandle:
    """Replace ``target.name`` by ``wrap(original)`` and return a handle holding one reference.

    ``target`` is a module (or its dotted name: a module-level function such as a model module's
    ``dispatch_attention_fn``), a class (a method such as ``forward`` or ``__call__``; inherited
    methods, staticmethods and classmethods keep their kind), a dict (the entry ``name``, such
    as one of transformers' attention functions) or any other object (that one instance only:
    the wrap gets the bound method). ``wrap`` is the reference key: the same ``wrap`` on the
    same attribute shares the patch.

    Args:
        target: a module, a module's dotted name, a class, a dict, or an instance.
        name: the attribute (or dict key) to patch.
        wrap: a callable taking the original and returning its replacement; also the
            reference key.

    Returns:
        A :class:`PatchHandle` holding one reference; ``remove()`` releases it.

    Raises:
        AttributeError: ``target`` has no attribute ``name`` (nothing is patched).
        KeyError: ``target`` is a dict without the key ``name`` (nothing is patched).
        ImportError: ``target`` is a dotted name that cannot be imported.
        TypeError: ``wrap`` is not callable (nothing is patched).
    """
    if not callable(wrap):
        # (It failed with the raw "'int' object is not callable" from inside the patch.)
        raise TypeError(
            f"patch_attribute's wrap must be callable (original -> replacement), got {wrap!r}"
        )
    if isinstance(target, str):
        target = importlib.import_module(target)
    kind = (
        "module"
        if isinstance(target, types.ModuleType)
        else "class"
        if isinstance(target, type)
        else "mapping"
        if isinstance(target, dict)
        else "instance"
    )
    with _lock:
        key = (id(target), name)
        slot = _slots.get(key)
        if slot is None:
            slot = _new_slot(target, name, kind)
        elif not _still_ours(slot):
            # Someone replaced our patch: start over from what is there now.
            _warn_replaced(slot)
            slot = _new_slot(target, name, kind)
        if wrap in slot.layers:
            slot.layers[wrap] += 1  # shares the installed patch: nothing to recompute
        else:
            slot.layers[wrap] = 1
            installed = slot.installed
            try:
                _apply(slot)
            except BaseException:
                del slot.layers[wrap]
                if slot.installed is not installed:  # put, then a subclass's recompose failed
                    _apply(slot)  # back to the previous layers (or the original), below too
                raise
            _slots[key] = slot
        return PatchHandle([(slot, wrap)], (slot.describe(),))


def hook_attribute(target: Any, name: str, make: Wrap) -> Callable[[], None]:
    """Set ``target.name`` (a module's function or a class's plain method: the hook is set as
    a plain function) to ``make(current)`` and return the function that removes it again.

    Removal restores what ``target`` held only while the attribute is still this hook. When
    other code patched it since (wrapping the hook), restoring would drop that patch: the hook
    stays under it instead, turned into a pass-through to what it wrapped, so the other patch
    keeps working, and a later hook simply wraps it. If the other code later undoes its patch,
    putting the pass-through back on top, the next ``hook_attribute`` of the attribute first
    restores what the pass-through wrapped (it would otherwise stay for good). Removing twice
    does nothing more.

    Args:
        target: the module or class.
        name: the attribute.
        make: takes the current value, returns the hook's behaviour.

    Returns:
        The remover (call it once the hook is no longer wanted).
    """
    # Only while a restore takes effect: functools.wraps copies _bcg_unhook onto another
    # library's wrapper of the pass-through, whose restore does nothing (the loop spun).
    while (retired := getattr(vars(target).get(name), "_bcg_unhook", None)) is not None:
        if not retired():
            break
    own = vars(target).get(name, _ABSENT)
    current = getattr(target, name)
    hooked = make(current)
    active = [True]

    def hook(*args: Any, **kwargs: Any) -> Any:
        return (hooked if active[0] else current)(*args, **kwargs)

    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(hook, attr, getattr(hooked, attr))
    setattr(target, name, hook)

    def restore() -> bool:
        if vars(target).get(name, _ABSENT) is not hook:
            return False  # patched over: left in place as a pass-through (see above)
        if own is _ABSENT:
            delattr(target, name)
        else:
            setattr(target, name, own)
        return True

    def remove() -> None:
        if not active[0]:
            return
        active[0] = False
        restore()
        hook._bcg_unhook = restore  # type: ignore[attr-defined]

    return remove


def _new_slot(target: Any, name: str, kind: str) -> _Slot:
    if kind == "mapping":
        return _Slot(target, name, kind, target[name], target[name])
    base = inspect.getattr_static(target, name) if kind == "class" else getattr(target, name)
    if kind == "instance":
        own = _instance_own(target, name)
    else:
        own = vars(target).get(name, _ABSENT) if hasattr(target, "__dict__") else _ABSENT
    inherited = _find_inherited(target, name, kind) if own is _ABSENT else _ABSENT
    if kind == "class" and inherited is not _ABSENT:
        base = inherited
    return _Slot(target, name, kind, own, base, inherited)


def _instance_own(target: Any, name: str) -> Any:
    """What an instance holds under ``name`` itself, _ABSENT when it inherits it (a method).

    Not only its ``__dict__`` entry: a value behind a data descriptor of its class (a
    ``__slots__`` member, a property) or one its class's ``__getattr__`` gives (an nn.Module's
    submodule, parameter or buffer) is the instance's own too, and is what release restores;
    read from ``__dict__`` alone, such a patch looked replaced by other code and stayed."""
    declared = _find_inherited(target, name, "instance")
    if declared is not _ABSENT and hasattr(type(declared), "__set__"):
        return getattr(target, name, _ABSENT)  # a data descriptor wins over __dict__
    own = vars(target).get(name, _ABSENT) if hasattr(target, "__dict__") else _ABSENT
    if own is not _ABSENT or declared is not _ABSENT:
        return own
    return getattr(target, name, _ABSENT)


def _mro_above(target: Any, kind: str) -> tuple[type, ...]:
    """The classes a class or instance slot inherits its attribute from, nearest first."""
    if kind == "class":
        return tuple(target.__mro__[1:])
    if kind == "instance":
        return tuple(type(target).__mro__)
    return ()


def _find_inherited(target: Any, name: str, kind: str) -> Any:
    """The value ``target`` inherits under ``name`` now (the first class of its MRO that
    defines it, bcg's patches included), unbound; _ABSENT when none does (a metaclass's
    attribute, one ``__getattr__`` makes: then the slot's base stays fixed)."""
    for klass in _mro_above(target, kind):
        value = vars(klass).get(name, _ABSENT)
        if value is not _ABSENT:
            return value
    return _ABSENT


def _bind(slot: _Slot, value: Any) -> Any:
    """What ``slot.target.name`` reads when it inherits ``value`` (an instance binds it)."""
    if slot.kind == "instance":
        get = getattr(type(value), "__get__", None)
        if get is not None:
            return get(value, slot.target, type(slot.target))
    return value


def _recompose_below(klass: type) -> None:
    """Recompose every patched subclass and instance that may inherit the attribute from
    ``klass`` and now inherits something else; bases before subclasses, instances last."""
    below = [
        slot
        for slot in _slots.values()
        if slot.inherited is not _ABSENT and klass in _mro_above(slot.target, slot.kind)
    ]
    below.sort(key=lambda s: len(s.target.__mro__) if s.kind == "class" else 1 << 30)
    for slot in below:
        if not slot.layers or not _still_ours(slot):
            continue  # other code replaced it: left alone, warned about on release
        inherited = _find_inherited(slot.target, slot.name, slot.kind)
        if inherited is _ABSENT or inherited is slot.inherited:
            continue
        slot.inherited, slot.base = inherited, _bind(slot, inherited)
        _install(slot)


def _compose(slot: _Slot) -> Any:
    base = slot.base
    descriptor: type[Any] | None = None
    if isinstance(base, (staticmethod, classmethod)):
        descriptor, base = type(base), base.__func__
    for wrap in slot.layers:
        base = wrap(base)
    return base if descriptor is None else descriptor(base)


def _install(slot: _Slot) -> None:
    value = _compose(slot)
    slot.put(value)
    slot.installed = value


def _apply(slot: _Slot) -> None:
    """Put the composition of ``slot``'s layers, or its original when none is left (and forget
    the slot); then recompose the patched subclasses and instances below a class."""
    if slot.layers:
        _install(slot)
    else:
        if slot.original is _ABSENT:
            slot.drop()
        else:
            slot.put(slot.original)
        slot.installed = _ABSENT
        _slots.pop((id(slot.target), slot.name), None)
    if slot.kind == "class":
        _recompose_below(slot.target)


def _still_ours(slot: _Slot) -> bool:
    return slot.own() is slot.installed


def _warn_replaced(slot: _Slot) -> None:
    logger.warning(
        "bcg: %s was replaced by other code after bcg patched it; bcg leaves it as it is",
        slot.describe(),
    )


def _release(slot: _Slot, wrap: Wrap) -> None:
    key = (id(slot.target), slot.name)
    if _slots.get(key) is not slot:
        return  # dropped earlier because other code replaced the attribute
    if not _still_ours(slot):
        _warn_replaced(slot)
        del _slots[key]
        return
    slot.layers[wrap] -= 1
    if slot.layers[wrap] == 0:
        del slot.layers[wrap]
        _apply(slot)
