"""One walker for every nested user structure bcg looks into.

Break arguments (aliased), break outputs (bridged), runner arguments (signatures and static
buffers) and runner outputs (cloned), and the CPU recorder's op arguments are all walked here,
so flattening, rebuilding, structure and leaf order are the same everywhere.

What is a node (its children are walked), in this order:

1. ``torch.Tensor``: always a leaf.
2. Any type registered with ``torch.utils._pytree`` (lists, tuples, named tuples, dicts,
   ``OrderedDict``, ``defaultdict``, ``deque``, and what libraries register, such as
   transformers' ``ModelOutput``): flattened and rebuilt by its registered functions.
3. A dataclass instance of an unregistered type: its fields that hold a value, in
   declaration order (what ``pytree.register_dataclass`` would give, without registering user
   types process-wide, which would change how ``torch.export`` and ``torch.compile`` treat
   them), then its instance attributes that are no field, as a plain object's.
4. A plain object (it has a ``__dict__`` or ``__slots__`` and is not a module, class,
   function, method, ``nn.Module``, enum, :class:`Opaque`, nor a subclass of a built-in
   container, number or string, nor a ``functools.partial``, whose state is not in its
   attributes): its instance attributes — the
   ``__dict__`` in insertion order, then the slots that hold a value, in declaration order
   (base classes first). The *one rule* for objects: a slotted object is walked like one with
   a ``__dict__``, so a rebound attribute or a changed number inside it is seen. Rebuilt as
   a shallow copy with the new attribute values; an object whose children all come back
   unchanged is returned as itself (so user objects keep their identity unless a tensor
   inside them was replaced). An object met again lower in its own tree (a cycle) is a leaf.
   Attributes an integration leaves unwalked (:func:`leave_unwalked`) are no children.

Everything else is a leaf. The :class:`TreeSpec` of a structure records each node's type and
its *context*: dict keys, field or attribute names, named-tuple fields, a list's length. Two
structures are the same when their specs are equal; :func:`difference` says where they are not,
and :func:`key_paths` names each leaf (``[0]['h'].lse``) so that dicts can be matched by key,
never by position.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import functools
import math
import numbers
import sys
import types
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import torch

# torch's own pytree registry: what torch.compile, export and libraries register nodes with.
import torch.utils._pytree as pytree  # noqa: PLC2701


class Opaque:
    """Base of our own slotted value types that must stay leaves (signature markers)."""

    __slots__ = ()


_OPAQUE = (
    Opaque,
    torch.nn.Module,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    enum.Enum,
    # Objects whose state lives in a built-in base, not in their __dict__ or slots: subclasses
    # of containers, numbers and strings that pytree does not register, and partials. Walked
    # by their attributes they had none, so any two (L([2]) and L([3]), partial(f, 2) and
    # partial(g, 3)) were one signature; as leaves a number or string is a constant by value,
    # anything else is keyed by identity.
    list,
    tuple,
    dict,
    set,
    frozenset,
    bytearray,
    collections.deque,
    int,
    float,
    complex,
    str,
    bytes,
    functools.partial,
    # Symbolic numbers (a compiled break's fake run returns them): walked, their attributes
    # reach the whole shape environment (a traced call took a minute).
    torch.SymInt,
    torch.SymFloat,
    torch.SymBool,
)


class _Leaf:
    """Spec marker of a leaf: ``TENSOR`` for a tensor, ``VALUE`` for anything else."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


TENSOR = _Leaf("tensor")
VALUE = _Leaf("value")

# A node spec: (type, context, child specs); a leaf spec: TENSOR or VALUE. Plain nested tuples
# compare and hash fast, which signatures (a runner's hot path) rely on.
TreeSpec = Any

_DATACLASS, _OBJECT, _PYTREE = "dataclass", "object", "pytree"

# Hot paths (runner signatures, the CPU recorder) meet these most: decided without lookups.
SCALARS = frozenset({int, float, bool, str, type(None), complex, bytes, torch.dtype, torch.device})


def _kind(obj: Any) -> str | None:
    """How ``obj`` is walked, or None for a leaf."""
    cls = type(obj)
    if cls in pytree.SUPPORTED_NODES or pytree.is_namedtuple_instance(obj):
        return _PYTREE
    if isinstance(obj, _OPAQUE):
        return None
    if dataclasses.is_dataclass(obj):
        return _DATACLASS
    if hasattr(obj, "__dict__") or _slot_names(cls):
        return _OBJECT
    return None


# A cache; a racing duplicate entry is harmless. Bounded as _unwalked_by_type is: classes made
# in a loop (one per request) are not kept alive.
_SLOT_NAMES: dict[type, tuple[str, ...]] = {}


def _slot_names(cls: type) -> tuple[str, ...]:
    """The attribute names of ``cls``'s slots, base classes first (private names mangled)."""
    found = _SLOT_NAMES.get(cls)
    if found is not None:
        return found
    names: list[str] = []
    for klass in reversed(cls.__mro__):
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"
            if name not in names:
                names.append(name)
    if len(_SLOT_NAMES) >= 256:
        _SLOT_NAMES.clear()
    return _SLOT_NAMES.setdefault(cls, tuple(names))


def _attributes(obj: Any) -> dict[str, Any]:
    """An object's instance attributes: its ``__dict__``, then its slots that hold a value."""
    attrs = dict(getattr(obj, "__dict__", {}))
    for name in _slot_names(type(obj)):
        try:
            attrs.setdefault(name, object.__getattribute__(obj, name))
        except AttributeError:  # an empty slot
            continue
    return attrs


# Attributes not walked, by class: state that the class's methods, patched by an
# integration, read live at every replay (a break), so one graph serves every value; keyed, each
# new value was another signature, a miss (see leave_unwalked). _unwalked_by_type: the same for
# each type met, subclasses included, resolved once (the walk's hot path is a dict lookup).
_UNWALKED: dict[type, frozenset[str]] = {}
_unwalked_by_type: dict[type, frozenset[str]] = {}


def leave_unwalked(cls: type, names: Iterable[str]) -> None:
    """Never walk the attributes ``names`` of objects of ``cls`` or a subclass (transformers'
    hybrid sliding layer subclasses the sliding one, and runs its patched methods): they are no
    leaves, so no part of a signature (a rebuilt object keeps them, as a shallow copy). Only
    for state that every replay reads afresh through a break (a sliding cache layer's Python
    int position, ``_integrations/sliding_window.py``)."""
    global _unwalked_by_type
    _UNWALKED[cls] = _UNWALKED.get(cls, frozenset()) | frozenset(names)
    _unwalked_by_type = {}  # a new one: a walk resolving meanwhile fills the old one


def _unwalked(t: type) -> frozenset[str]:
    by_type = _unwalked_by_type
    found = by_type.get(t)
    if found is None:
        found = frozenset().union(*(_UNWALKED.get(k, frozenset()) for k in t.__mro__))
        if len(by_type) >= 256:  # bounded: classes made in a loop are not kept alive
            by_type.clear()
        by_type[t] = found
    return found


def _children(obj: Any, kind: str) -> tuple[list[Any], Any]:
    if kind == _PYTREE:
        node_type = pytree._get_node_type(obj)
        children, context = pytree.SUPPORTED_NODES[node_type].flatten_fn(obj)
        return list(children), context
    if kind == _DATACLASS:
        # The fields' stored values, past any __getattribute__ of the class (as _attributes
        # reads __dict__): transformers' per-layer configs (Gemma 4) refuse a plain read of
        # some fields. A field never set (init=False, no default) is skipped, as an empty slot
        # is (reading it raised out of the runner's call); then the instance attributes that
        # are no field (set in __post_init__ or later), which code reads as it reads fields
        # (left out, two calls differing only there shared a signature).
        attrs = {}
        for f in dataclasses.fields(obj):
            try:
                attrs[f.name] = object.__getattribute__(obj, f.name)
            except AttributeError:
                continue
        for name, value in _attributes(obj).items():
            attrs.setdefault(name, value)
    else:
        attrs = _attributes(obj)
    if _UNWALKED and (unwalked := _unwalked(type(obj))):
        attrs = {name: value for name, value in attrs.items() if name not in unwalked}
    return list(attrs.values()), tuple(attrs)


def _rebuild(obj: Any, kind: str, context: Any, children: list[Any]) -> Any:
    if kind == _PYTREE:
        node_type = pytree._get_node_type(obj)
        return pytree.SUPPORTED_NODES[node_type].unflatten_fn(children, context)
    new = copy.copy(obj)
    for name, value in zip(context, children, strict=True):
        object.__setattr__(new, name, value)  # frozen dataclasses too
    return new


class _Keys(tuple):  # type: ignore[type-arg]
    """The keys of a dict-like node (a context pytree gives as a list) when some key is not a
    ``str``: equal only to keys of the same types, with zeros of the same sign. ``1``,
    ``True`` and ``1.0`` (and ``0.0``, ``-0.0``) are equal keys that hash alike, so plain
    tuples of them gave ``{1: x}`` and ``{True: x}`` one signature, while code reading the keys
    tells them apart."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Keys) and tuple.__eq__(self, other) and _same_keys(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = tuple.__hash__


def _same_keys(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether equal tuples of keys also agree in each key's type and zero signs."""
    for x, y in zip(a, b, strict=True):
        if type(x) is not type(y) or zero_signs(x) != zero_signs(y):
            return False
        if isinstance(x, tuple) and not _same_keys(x, y):
            return False
    return True


class _Identity:
    """A dict key compared by identity: a tensor, whose ``==`` is elementwise (comparing two
    signatures of dicts keyed by tensors raised torch's "Boolean value of Tensor with more than
    one value is ambiguous" from a runner's miss log). It hashes by identity already."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return repr(self.obj)


def _context_key(context: Any) -> Hashable:
    """A hashable, comparable form of a node's context (lists become tuples; dict keys that
    are not all strings a :class:`_Keys`, tensor keys compared by identity)."""
    try:
        hash(context)  # attribute and field names, None: the common cases, as they are
    except TypeError:
        if isinstance(context, (list, tuple)):
            items = tuple(
                _Identity(c) if isinstance(c, torch.Tensor) else _context_key(c) for c in context
            )
            return items if all(type(c) is str for c in items) else _Keys(items)
        return repr(context)
    key: Hashable = context
    return key


def flatten(obj: Any) -> tuple[list[Any], TreeSpec]:
    """All leaves of ``obj`` in walk order, and its spec."""
    leaves: list[Any] = []
    spec = _flatten(obj, leaves, set())
    return leaves, spec


def _flatten(obj: Any, leaves: list[Any], active: set[int]) -> TreeSpec:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return TENSOR
    cls = type(obj)
    if cls in SCALARS:
        leaves.append(obj)
        return VALUE
    if cls is tuple or cls is list:  # what pytree gives them: the items, context None
        if id(obj) in active:
            leaves.append(obj)
            return VALUE
        active.add(id(obj))
        specs = tuple(_flatten(c, leaves, active) for c in obj)
        active.discard(id(obj))
        return (cls, None, specs)
    kind = _kind(obj)
    if kind is None or id(obj) in active:
        leaves.append(obj)
        return VALUE
    children, context = _children(obj, kind)
    active.add(id(obj))
    specs = tuple(_flatten(c, leaves, active) for c in children)
    active.discard(id(obj))
    return (type(obj), _context_key(context), specs)


# The plain values whose change after a capture or a trace is judged (``same_value``): what code
# after a break computes with. Objects and symbolic numbers are not judged.
PLAIN_VALUES = (type(None), bool, int, float, str)
# Leaves judged as plain values too, though not of those exact types: numbers of any kind
# (numpy scalars, complex, int enums), enums, strings and bytes of any kind, sets, slices,
# ranges, and numpy arrays (see same_value). Symbolic numbers are not numbers.Number.
_JUDGED = (
    numbers.Number,
    enum.Enum,
    str,  # a str subclass was not judged: a changed one replayed the capture's silently
    bytes,
    bytearray,
    frozenset,
    set,
    slice,
    range,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


def is_plain_value(x: Any) -> bool:
    """Whether a leaf is a value whose change later code would miss (see ``same_value``):
    one of ``PLAIN_VALUES`` or of the other value types above, or a container the walk leaves
    whole (a ``list``/``tuple``/``dict`` subclass pytree does not register, a ``torch.Size``)
    holding only such values: a break's ``L([n])`` was never judged, and the code after it
    replayed the capture's ``n`` silently."""
    if type(x) in PLAIN_VALUES or isinstance(x, _JUDGED) or _host_array(x):
        return True
    held = hidden_leaves(x)
    return held is not None and all(is_plain_value(h) for h in held)


def _host_array(x: Any) -> bool:
    """Whether ``x`` is a numpy array of values (host metadata: lengths, block ids), not of
    Python objects (which may hold tensors). numpy is looked up, never imported here."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray) and x.dtype.kind != "O"


def same_value(got: Any, want: Any) -> bool:
    """Whether a plain value came back as it was: the same type and equal (NaN equals NaN;
    ``-0.0`` is not ``0.0``: ``x / -0.0`` is not ``x / 0.0``); a numpy array has the same
    dtype, shape and values."""
    if type(got) is not type(want):
        return False
    if _host_array(got):
        np = sys.modules["numpy"]
        if got.dtype != want.dtype or got.shape != want.shape:
            return False
        return bool(np.array_equal(got, want, equal_nan=got.dtype.kind in "fc"))
    if got != got:
        return bool(want != want)
    if got == want:
        return is_negative_zero(got) == is_negative_zero(want)
    return False


def zero_signs(x: Any) -> tuple[bool, ...]:
    """For a float: whether it is ``-0.0``; for a complex: whether each part is; else ``()``.
    Equal values that hash alike, told apart by ``x / y``, ``cmath.phase`` or ``cmath.sqrt``."""
    if isinstance(x, float):
        return (is_negative_zero(float(x)),)
    if isinstance(x, complex):
        return (is_negative_zero(float(x.real)), is_negative_zero(float(x.imag)))
    return ()


def is_negative_zero(x: Any) -> bool:
    """Whether ``x`` is the float ``-0.0`` (equal to ``0.0`` and hashed alike, but ``y / -0.0``
    is not ``y / 0.0``)."""
    return type(x) is float and not x and math.copysign(1.0, x) < 0


def tensor_leaves(obj: Any, *, into_objects: bool = True) -> list[torch.Tensor]:
    """The tensors of ``obj`` in walk order; with ``into_objects=False`` not those inside
    dataclasses and plain objects (only pytree nodes: lists, tuples, dicts and the like)."""
    if into_objects:
        return [x for x in flatten(obj)[0] if isinstance(x, torch.Tensor)]
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    _map(obj, collect, False, set())
    return found


def map_tensors(
    obj: Any,
    fn: Callable[[torch.Tensor], Any],
    *,
    into_objects: bool = True,
    keep: Iterable[int] = (),
) -> Any:
    """``obj`` rebuilt with ``fn`` applied to every tensor, keeping every node's type.

    Nodes whose children all come back unchanged are returned as they are. With
    ``into_objects=False`` dataclasses and plain objects are left untouched (the runner passes
    them by reference); nodes whose ``id`` is in ``keep`` are left untouched too.
    """
    if keep:
        return _map(obj, fn, into_objects, set(keep))
    kind = type(obj)
    if kind is tuple or kind is list:  # the common flat argument list, without the walk
        items = obj
    elif kind is dict:
        items = obj.values()
    else:
        return _map(obj, fn, into_objects, set())
    if not all(isinstance(x, torch.Tensor) or type(x) in SCALARS for x in items):
        return _map(obj, fn, into_objects, set())
    if kind is dict:
        mapped_dict = {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in obj.items()}
        same = all(mapped_dict[k] is v for k, v in obj.items())
        return obj if same else mapped_dict
    mapped = [fn(x) if isinstance(x, torch.Tensor) else x for x in obj]
    if all(m is x for m, x in zip(mapped, obj, strict=True)):
        return obj
    return tuple(mapped) if kind is tuple else mapped


# The walks below are module functions, not closures: a recursive closure holds itself, and the
# cycle kept what it found (a runner's call's objects and their tensors) for the garbage
# collector after the caller let go.


# Leaves that hold items the walk does not see: sets, and subclasses of the built-in
# containers that pytree does not register (see _OPAQUE).
UNWALKED_CONTAINERS = (list, tuple, dict, set, frozenset, collections.deque)


def hidden_leaves(leaf: Any) -> list[Any] | None:
    """What a leaf of the walk holds when it is a container the walk leaves whole (a ``set``,
    a ``frozenset``, an unregistered ``list``/``tuple``/``dict`` subclass): its items (a dict's
    keys and values) in iteration order, at any depth of such containers; a ``bytearray``'s
    bytes; None for any other leaf. A graph reads them as they were at capture."""
    if isinstance(leaf, bytearray):
        return [bytes(leaf)]
    if not isinstance(leaf, UNWALKED_CONTAINERS):
        return None
    found: list[Any] = []
    active: set[int] = set()

    def collect(x: Any) -> None:
        if not isinstance(x, UNWALKED_CONTAINERS) or id(x) in active:
            found.append(x)
            return
        active.add(id(x))
        for item in [*x.keys(), *x.values()] if isinstance(x, dict) else x:
            collect(item)

    collect(leaf)
    return found


def hides_tensors(leaf: Any) -> bool:
    """Whether a leaf's :func:`hidden_leaves` hold a tensor: one ``map_tensors`` cannot reach
    (a runner's clone of its output, or a bridge, left it the static one)."""
    return any(isinstance(x, torch.Tensor) for x in hidden_leaves(leaf) or ())


def hidden_tensor_holder(obj: Any) -> str | None:
    """The type name of the first leaf of ``obj`` that :func:`hides_tensors`, or None."""
    for leaf in flatten(obj)[0]:
        if hides_tensors(leaf):
            return type(leaf).__qualname__
    return None


def object_ids(obj: Any) -> set[int]:
    """The ids of the dataclasses and plain objects in ``obj``, and in them."""
    found: set[int] = set()
    _walk_object_ids(obj, set(), found)
    return found


def _walk_object_ids(node: Any, active: set[int], found: set[int]) -> None:
    kind = _kind(node)
    if kind is None or id(node) in active or id(node) in found:
        return
    if kind != _PYTREE:
        found.add(id(node))
    active.add(id(node))
    for child in _children(node, kind)[0]:
        if not isinstance(child, torch.Tensor) and type(child) not in SCALARS:
            _walk_object_ids(child, active, found)
    active.discard(id(node))


def outer_objects(obj: Any) -> list[Any]:
    """The dataclasses and plain objects in ``obj`` that no other one holds, in walk order."""
    found: list[Any] = []
    _walk_outer_objects(obj, set(), found)
    return found


def _walk_outer_objects(node: Any, active: set[int], found: list[Any]) -> None:
    if isinstance(node, torch.Tensor) or type(node) in SCALARS:
        return
    kind = _kind(node)
    if kind is None or id(node) in active:
        return
    if kind != _PYTREE:
        found.append(node)
        return
    active.add(id(node))
    for child in _children(node, kind)[0]:
        _walk_outer_objects(child, active, found)
    active.discard(id(node))


def _map(obj: Any, fn: Callable[[torch.Tensor], Any], into_objects: bool, active: set[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) in SCALARS:
        return obj
    kind = _kind(obj)
    if kind is None or id(obj) in active or (kind != _PYTREE and not into_objects):
        return obj
    children, context = _children(obj, kind)
    active.add(id(obj))
    mapped = [_map(c, fn, into_objects, active) for c in children]
    active.discard(id(obj))
    if all(m is c for m, c in zip(mapped, children, strict=True)):
        return obj
    return _rebuild(obj, kind, context, mapped)


@functools.lru_cache(maxsize=256)
def in_object(spec: TreeSpec) -> tuple[bool, ...]:
    """For each leaf of ``spec``: whether it lies inside a dataclass or plain object."""
    out: list[bool] = []
    _in_object(spec, False, out)
    return tuple(out)


def _in_object(spec: TreeSpec, inside: bool, out: list[bool]) -> None:
    if not isinstance(spec, tuple):
        out.append(inside)
        return
    node_type = spec[0]
    inside = inside or not (
        node_type in pytree.SUPPORTED_NODES or pytree.is_namedtuple_class(node_type)
    )
    for child in spec[2]:
        _in_object(child, inside, out)


def one_shot_iterator(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, type] | None:
    """The first one-shot iterator (a generator, ``map``, ``zip``, ``iter(list)``) among a
    call's arguments outside dataclasses and plain objects, as its path (``args[1]``,
    ``kwargs['parts']``) and type; None when there is none. A call that runs more than once
    (a runner's warm-ups and capture, a break's replays) would pass it exhausted."""
    leaves, spec = flatten((args, kwargs))
    for i, (leaf, inside) in enumerate(zip(leaves, in_object(spec), strict=True)):
        if isinstance(leaf, Iterator) and not inside:
            # Paths are built only now: every break of a capture asks, and nearly all say no.
            # The walked call is (args, kwargs): "[0][1]" is args[1], "[1]['k']" is kwargs['k'].
            path = key_paths(spec)[i]
            return ("args" if path.startswith("[0]") else "kwargs") + path[3:], type(leaf)
    return None


def key_paths(spec: TreeSpec, root: str = "") -> list[str]:
    """The path of each leaf of ``spec``, in walk order (``[0]``, ``['k']``, ``.field``)."""
    out: list[str] = []
    _paths(spec, root, out)
    return out


def _child_names(spec: TreeSpec) -> list[str]:
    node_type, context, children = spec
    if pytree.is_namedtuple_class(node_type):
        return [f".{f}" for f in node_type._fields]
    is_pytree = node_type in pytree.SUPPORTED_NODES
    keyed = isinstance(context, tuple) and len(context) == len(children)
    if keyed and not is_pytree:
        return [f".{c}" for c in context]  # dataclass fields, object attributes
    if keyed and issubclass(node_type, dict):
        return [f"[{c!r}]" for c in context]
    return [f"[{i}]" for i in range(len(children))]


def _paths(spec: TreeSpec, prefix: str, out: list[str]) -> None:
    if not isinstance(spec, tuple):
        out.append(prefix or "<root>")
        return
    for name, child in zip(_child_names(spec), spec[2], strict=True):
        _paths(child, prefix + name, out)


def describe(spec: TreeSpec) -> str:
    """One node of a spec in words (``a dict with keys ['a', 'b']``, ``a tensor``)."""
    if not isinstance(spec, tuple):
        return "a tensor" if spec is TENSOR else "a non-tensor value"
    node_type, _, children = spec
    name = node_type.__qualname__
    if issubclass(node_type, (list, tuple)) and not pytree.is_namedtuple_class(node_type):
        return f"a {name} of length {len(children)}"
    if issubclass(node_type, dict):
        return f"a {name} with keys [{', '.join(n[1:-1] for n in _child_names(spec))}]"
    return f"a {name} with fields [{', '.join(n.lstrip('.') for n in _child_names(spec))}]"


def difference(got: TreeSpec, want: TreeSpec, root: str = "output") -> str | None:
    """Where ``got`` differs from ``want`` in structure (first difference), or None."""
    if got == want:
        return None
    if not (isinstance(got, tuple) and isinstance(want, tuple)):
        return f"{root} is {describe(got)}, was {describe(want)}"
    if got[0] is not want[0] or got[1] != want[1] or len(got[2]) != len(want[2]):
        return f"{root} is {describe(got)}, was {describe(want)}"
    for name, g, w in zip(_child_names(want), got[2], want[2], strict=True):
        found = difference(g, w, root + name)
        if found is not None:
            return found
    return None


def same_up_to_key_order(got: TreeSpec, want: TreeSpec) -> bool:
    """True when the two specs differ only in the order of dict keys."""
    if got == want:
        return True
    if not (isinstance(got, tuple) and isinstance(want, tuple)):
        return False
    if got[0] is not want[0] or len(got[2]) != len(want[2]):
        return False
    if got[1] == want[1]:
        return all(same_up_to_key_order(g, w) for g, w in zip(got[2], want[2], strict=True))
    if not (issubclass(want[0], dict) and isinstance(got[1], tuple) and isinstance(want[1], tuple)):
        return False
    if sorted(map(repr, got[1])) != sorted(map(repr, want[1])) or len(set(got[1])) != len(got[1]):
        return False
    mine = dict(zip(got[1], got[2], strict=True))
    return all(
        k in mine and same_up_to_key_order(mine[k], w)
        for k, w in zip(want[1], want[2], strict=True)
    )


# A container of a call as a step received it: its path, the container, its context (keys),
# its children and, for a dict, its keys, for ``changed_container``.
Snapshot = list[tuple[str, Any, Hashable, list[Any], tuple[Any, ...]]]


def copy_containers(obj: Any) -> Any:
    """``obj`` with every pytree container (outside dataclasses and plain objects) rebuilt,
    the leaves and objects as they are: a step that changes a container of the copy leaves the
    caller's alone. A tuple with nothing copied inside is kept (it cannot change, and pytree
    would rebuild a ``torch.Size`` as a plain tuple)."""
    return _copy_containers(obj, set())


def _copy_containers(obj: Any, active: set[int]) -> Any:
    if isinstance(obj, torch.Tensor) or type(obj) in SCALARS:
        return obj
    if _kind(obj) != _PYTREE or id(obj) in active:
        return obj
    children, context = _children(obj, _PYTREE)
    active.add(id(obj))
    copied = [_copy_containers(c, active) for c in children]
    active.discard(id(obj))
    if isinstance(obj, tuple) and all(a is b for a, b in zip(copied, children, strict=True)):
        # Nothing in it to copy, and it cannot change: itself (a torch.Size rebuilt by pytree
        # came out a plain tuple, and a step calling size.numel() failed its capture).
        return obj
    return _rebuild(obj, _PYTREE, context, copied)


def container_snapshot(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Snapshot:
    """The containers (outside dataclasses and plain objects) of a call's arguments, with
    their paths (``args[0]``, ``kwargs['state']['k']``), keys and children."""
    out: Snapshot = []
    for i, arg in enumerate(args):
        _snapshot(arg, f"args[{i}]", out, set())
    for name, arg in kwargs.items():
        _snapshot(arg, f"kwargs[{name!r}]", out, set())
    return out


def _snapshot(node: Any, path: str, out: Snapshot, active: set[int]) -> None:
    if isinstance(node, torch.Tensor) or type(node) in SCALARS:
        return
    if _kind(node) != _PYTREE or id(node) in active:
        return
    children, context = _children(node, _PYTREE)
    # A dict's keys apart from its context, which is more than its keys for some (a
    # defaultdict's holds its factory): the message names the keys added or removed.
    keys = tuple(node) if isinstance(node, dict) else ()
    out.append((path, node, _context_key(context), children, keys))
    keyed = isinstance(node, dict) and len(keys) == len(children)
    active.add(id(node))
    for i, child in enumerate(children):
        _snapshot(child, f"{path}[{keys[i]!r}]" if keyed else f"{path}[{i}]", out, active)
    active.discard(id(node))


def changed_container(snapshot: Snapshot) -> str | None:
    """The first container of ``snapshot`` that no longer holds the same keys and the same
    children (by identity) as its path and what changed (``args[0] (a dict): key 'out'
    added``); None when none changed."""
    for path, node, context, children, keys in snapshot:
        now, now_context = _children(node, _PYTREE)
        if _context_key(now_context) == context and len(now) == len(children):
            replaced = [
                i
                for i, (a, b) in enumerate(zip(now, children, strict=True))
                if not _same_leaf(a, b)
            ]
            if not replaced:
                continue
            where = keys[replaced[0]] if len(keys) == len(now) else replaced[0]
            change = f"item [{where!r}] replaced"
        elif isinstance(node, dict):
            added = [k for k in node if k not in keys]
            gone = [k for k in keys if k not in node]
            change = ", ".join(
                [*(f"key {k!r} added" for k in added), *(f"key {k!r} removed" for k in gone)]
            )
        else:
            change = f"length {len(children)} -> {len(now)}"
        return f"{path} (a {type(node).__qualname__}): {change or 'keys reordered'}"
    return None


def _same_leaf(a: Any, b: Any) -> bool:
    # An equal number or string set again is no change (``d["n"] = 1`` where it was 1), nor
    # an equal tuple (``d["size"] = (2, 3)``, ``x.shape``): immutable, only its identity differs.
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) in SCALARS:
        return bool(a == b)
    return (
        isinstance(a, tuple)
        and len(a) == len(b)
        and all(_same_leaf(x, y) for x, y in zip(a, b, strict=True))
    )
