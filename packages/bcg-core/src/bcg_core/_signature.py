"""Signatures: the key under which a runner stores one captured graph.

A signature describes a call completely enough that a graph captured for one call replays
correctly for another with the same signature. The call ``(args, kwargs sorted by name)`` is
walked by ``_trees.py`` (the one walker), and the signature is its structure (the tree spec:
container types, dict keys, field and attribute names, lengths) plus one key per leaf:

- a tensor in containers (lists, tuples, dicts, named tuples...): shape, dtype, device and the
  order of its dimensions by stride when not row-major (:func:`layout_key`); the runner
  copies it into a static buffer at every call. Only a dense strided tensor of torch's
  own type (or a parameter) is copied (:func:`is_plain_tensor`): a sparse, nested, mkldnn
  or quantized tensor, or a tensor subclass, is an object of the signature, keyed by
  identity and passed as itself (a static buffer would be a plain dense tensor, and replaying
  a graph captured on one would not run what eager runs);
- a tensor inside a dataclass or plain object: shape, dtype, device **and storage address**.
  Objects (metadata, caches) are passed to the model as themselves, so the graph reads those
  tensors where they were at capture; a tensor rebound to another address gives another
  signature (a miss that names the attribute), never a stale replay;
- a :class:`ScalarInput` (a Python number the runner copies into a device scalar, see
  ``_scalars.py``): its type only, never its value;
- constants (None, bool, int, float, complex, str, bytes, enums, dtypes, devices, sizes) by
  value (every NaN of one sign is one value); every other leaf by identity (the runner
  keeps such objects alive with their entry, so an id cannot be recycled under it); a set,
  bytearray or container subclass (a leaf of the walk) by its contents too (constants by
  value, tensors by address, other items by identity).

A call of plain tensors, plain values and lifted scalars only (the serving hot path, positional
or keyword) skips the walk: its signature is built directly, equal to the one the walk gives.
A runner repeating such a call skips even that: a :class:`FlatGuard` of its last hit compares
the call's leaves with the hit's.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Iterable
from typing import Any

import torch

from bcg_core import _trees

Signature = tuple[Any, ...]

_STRIDED = torch.strided


def layout_key(t: torch.Tensor) -> tuple[int, ...] | None:
    """The layout part of a tensor's key: None when its static buffer is row-major, else the
    order of the buffer's dimensions by stride, outermost first. The buffer is ``clone``'s (or
    ``empty_like``'s) layout, read from a meta tensor: the strides of a dense tensor, row-major
    (or channels-last) for one with gaps or overlaps (a slice, an ``expand``ed tensor, whose
    stride-0 dimension is not innermost in the buffer). So a graph captured on a transposed
    tensor reads a transposed buffer and is not replayed for a row-major one (kernels walk them
    in other orders: a sum differs in its last bits), and two inputs share a key only when
    their buffers share a layout."""
    if t.is_contiguous():
        return None
    strides = torch.empty_like(t, device="meta").stride()
    dims = [d for d, n in enumerate(t.shape) if n != 1]
    order = sorted(dims, key=lambda d: -strides[d])  # stable: equal strides keep their order
    return None if order == dims else tuple(order)


def is_plain_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` can stand in a static buffer: a dense strided ``torch.Tensor`` or
    parameter (not sparse, nested, mkldnn or quantized, not a subclass). A quantized tensor's
    scale and zero point are no part of its key, and a graph reads its buffer with the
    capture's: one of another scale replayed with the capture's scale, silently wrong."""
    cls = type(t)
    return (
        (cls is torch.Tensor or cls is torch.nn.Parameter)
        and t.layout is _STRIDED
        and not t.is_nested
        and not t.is_quantized
    )


class ScalarInput(_trees.Opaque):
    """Stands for a Python number that the runner copies into a 0-dim device tensor at every
    call: the signature keeps its type (``bool``, ``int``, ``float``), not its value. (An
    :class:`~bcg_core._trees.Opaque`: the tree walker takes it as a leaf.)"""

    __slots__ = ("kind",)

    def __init__(self, kind: type) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"ScalarInput({self.kind.__name__})"


_CONSTANTS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.Size,
)


def _call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    return (args, dict(sorted(kwargs.items())))


def signature_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Signature:
    """The hashable signature of a call, the key a :class:`BreakableGraphRunner` captures by.

    It holds the call's container structure and constants, each tensor's shape, dtype and
    device, the addresses of tensors inside object arguments, and every other object by
    identity. Equal signatures can share one graph. (A runner with ``as_tensor`` keys the
    numbers it lifts by their type alone, so for such a call this signature, which holds their
    values, is not the runner's key.)

    Args:
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.

    Returns:
        A hashable ``Signature``, as found in :attr:`EntryStats.signature`.
    """
    return signature_and_tensors(args, kwargs)[0]


@functools.lru_cache(maxsize=256)
def _flat_spec(n_args: int, names: tuple[str, ...], tensors: tuple[bool, ...]) -> Any:
    """The walk's spec of a call of ``n_args`` positional and ``names`` keyword leaves, each a
    tensor or not as ``tensors`` says (every non-tensor leaf has the same spec)."""
    leaves = [torch.empty(0, device="cpu") if t else 0 for t in tensors]
    kwargs = dict(zip(names, leaves[n_args:], strict=True))
    return _trees.flatten(_call(tuple(leaves[:n_args]), kwargs))[1]


def _const_kind(leaf: Any) -> str:
    """A constant's type name (an enum's class); ``-0.0`` is its own kind (it equals ``0.0``
    and hashes alike, but ``x / -0.0`` is not ``x / 0.0``), and so is a complex with a
    ``-0.0`` part (``cmath.phase(complex(-1, -0.0))`` is ``-pi``, not ``pi``)."""
    if _trees.is_negative_zero(leaf):
        return "negative-zero float"
    if type(leaf) is complex and True in (signs := _trees.zero_signs(leaf)):
        return f"complex with negative zeros (real, imaginary): {signs}"
    if isinstance(leaf, enum.Enum):
        # Members of two int enums of one name are equal (1 == 1) and were one key: the class
        # tells them apart (the member in the key keeps its class, and so its id, alive).
        return f"{type(leaf).__qualname__} #{id(type(leaf)):x}"
    return type(leaf).__name__


# One NaN object per sign: a NaN is unequal to itself and hashed by identity, so two calls
# given NaN had two keys and a runner captured for one never replayed for the other.
_NAN, _NEGATIVE_NAN = math.nan, -math.nan


def _const_value(leaf: Any) -> Any:
    """A constant as the signature keys it: a NaN (a complex's NaN parts too) as the shared NaN
    of its sign, every other value as itself."""
    if isinstance(leaf, float) and leaf != leaf:
        return _NEGATIVE_NAN if math.copysign(1.0, leaf) < 0 else _NAN
    if isinstance(leaf, complex) and leaf != leaf:
        return (_const_value(leaf.real), _const_value(leaf.imag))
    return leaf


def _flat_signature(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Signature, list[torch.Tensor]] | None:
    """The signature of a call whose arguments are all plain tensors, plain values and lifted
    scalars (the serving hot path, positional or keyword), built without the walk and equal to
    what it gives; None for any other call."""
    names = tuple(sorted(kwargs)) if kwargs else ()
    keys: list[Any] = []
    live: list[torch.Tensor] = []
    kinds: list[bool] = []
    for leaf in (*args, *(kwargs[n] for n in names)) if names else args:
        cls = type(leaf)
        if cls is torch.Tensor:
            if leaf.layout is not _STRIDED or leaf.is_nested or leaf.is_quantized:
                return None  # an object of the signature (see is_plain_tensor)
            keys.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, layout_key(leaf)))
            live.append(leaf)
        elif cls is ScalarInput:
            keys.append(("scalar", leaf.kind.__name__))
        elif cls in _trees.SCALARS:
            keys.append(("const", _const_kind(leaf), _const_value(leaf)))
        else:
            return None
        kinds.append(cls is torch.Tensor)
    return (_flat_spec(len(args), names, tuple(kinds)), tuple(keys)), live


class FlatGuard:
    """A test that a call has the signature of one earlier flat call (plain tensors, plain
    values and lifted scalars, positional or keyword: the calls :func:`signature_and_tensors`
    builds without the walk), cheaper than building and hashing the signature: a runner keeps
    one for its last hit, so a decode loop repeating one shape skips the signature.

    :meth:`match` never passes a call whose signature differs (the same positions and keyword
    names, the same tensor or not at each, equal shapes, dtypes, devices and constants); it
    may refuse one whose signature is equal (a lifted scalar is matched by identity, a NaN
    never), and the caller then asks the signature itself.
    """

    __slots__ = ("_n_args", "_names", "_others", "_tensors")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raises ``TypeError`` for a call that is not flat (see :meth:`of`)."""
        self._n_args = len(args)
        self._names = tuple(sorted(kwargs))
        tensors: list[tuple[int, torch.Size, torch.dtype, torch.device, Any]] = []
        others: list[tuple[int, type, Any]] = []
        for i, leaf in enumerate((*args, *(kwargs[n] for n in self._names))):
            cls = type(leaf)
            if cls is torch.Tensor and is_plain_tensor(leaf):
                tensors.append((i, leaf.shape, leaf.dtype, leaf.device, layout_key(leaf)))
            elif cls is ScalarInput or cls in _trees.SCALARS:
                others.append((i, cls, leaf))
            else:
                raise TypeError(f"not a flat call: a leaf is a {cls.__qualname__}")
        self._tensors = tuple(tensors)
        self._others = tuple(others)

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> FlatGuard | None:
        """The guard of a flat call; None for any other call."""
        try:
            return cls(args, kwargs)
        except TypeError:
            return None

    def match(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor] | None:
        """The call's tensors in signature walk order when it has the guarded signature, else
        None."""
        names = self._names
        if len(args) != self._n_args or len(kwargs) != len(names):
            return None
        if names:
            try:
                leaves = (*args, *(kwargs[n] for n in names))
            except KeyError:  # another name (the count was equal)
                return None
        else:
            leaves = args
        for i, cls, value in self._others:
            leaf = leaves[i]
            if type(leaf) is not cls or not (leaf is value or leaf == value):
                return None
            zero = cls is complex or (cls is float and not value)
            if zero and _const_kind(leaf) != _const_kind(value):
                return None  # 0.0 and -0.0, or a complex's parts
        live: list[torch.Tensor] = []
        for i, shape, dtype, device, order in self._tensors:
            t = leaves[i]
            if type(t) is not torch.Tensor or t.layout is not _STRIDED or t.is_nested:
                return None
            if t.shape != shape or t.dtype != dtype or t.device != device:
                return None
            if not (order is None and t.is_contiguous()) and layout_key(t) != order:
                return None
            live.append(t)
        return live


def signature_and_tensors(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Signature, list[torch.Tensor]]:
    """The signature and, in one walk (a replay's hot path), the call's tensors that live in
    containers, in the order :func:`static_call` makes their static buffers."""
    flat = _flat_signature(args, kwargs)
    return flat if flat is not None else walked_signature(args, kwargs)


def walked_signature(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Signature, list[torch.Tensor]]:
    """:func:`signature_and_tensors` by the walk, for any call."""
    leaves, spec = _trees.flatten(_call(args, kwargs))
    keys: list[Any] = []
    live: list[torch.Tensor] = []
    for leaf, inside in zip(leaves, _trees.in_object(spec), strict=True):
        if isinstance(leaf, torch.Tensor) and is_plain_tensor(leaf):
            if inside:
                keys.append(("tensor@", tuple(leaf.shape), leaf.dtype, leaf.device, _addr(leaf)))
            else:
                keys.append(
                    ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, layout_key(leaf))
                )
                live.append(leaf)
        elif isinstance(leaf, ScalarInput):
            keys.append(("scalar", leaf.kind.__name__))
        elif isinstance(leaf, _CONSTANTS):
            kind = _const_kind(leaf)
            if type(leaf) not in _trees.SCALARS and True in (signs := _trees.zero_signs(leaf)):
                # a float or complex subclass (numpy's float64, complex128): its -0.0 as well
                kind = f"{kind} with negative zeros {signs}"
            keys.append(("const", kind, _const_value(leaf)))
        elif (held := _trees.hidden_leaves(leaf)) is not None:
            # A set, bytearray or container subclass is a leaf passed as itself, and the graph
            # computed with its contents at capture: keyed by identity alone, the same one
            # changed in place (s.add(2), l[0] = t) replayed the capture's values, or a tensor's
            # freed memory. Its contents are keyed too: constants by value, tensors by address
            # (as inside objects), anything else by identity.
            keys.append(("object", _object_kind(leaf), id(leaf), tuple(map(_held_key, held))))
        else:
            keys.append(("object", _object_kind(leaf), id(leaf)))
    return (spec, tuple(keys)), live


def _held_key(x: Any) -> Any:
    """The key of an item of a set or container subclass (see :func:`walked_signature`)."""
    if isinstance(x, torch.Tensor):
        return ("tensor@", tuple(x.shape), x.dtype, x.device, _addr(x))
    if isinstance(x, _CONSTANTS):
        return ("const", _const_kind(x), _const_value(x))
    return ("object", id(x))


def _object_kind(leaf: Any) -> str:
    """An identity leaf's type name; a tensor that is not plain says why it is one."""
    name = type(leaf).__qualname__
    if not isinstance(leaf, torch.Tensor):
        return name
    if leaf.is_nested:
        return f"{name} (nested)"
    if leaf.layout is not _STRIDED:
        return f"{name} ({str(leaf.layout).removeprefix('torch.')})"
    if leaf.is_quantized:
        return f"{name} (quantized)"
    return f"{name} (a tensor subclass)"


def _addr(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return (t.data_ptr(), t.stride())


def static_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], make_static: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with every plain tensor (:func:`is_plain_tensor`) in containers
    replaced by ``make_static(t)``; other tensors, dataclasses and plain objects are passed as
    themselves. The buffers are made in signature walk order (keywords sorted by name), but
    the keywords keep the call's order: a step's ``**kwargs`` sees them in that order (a
    capture of ``f(x, b=b, a=a)`` computed in ``a, b`` order, unlike eager)."""

    def static(t: torch.Tensor) -> Any:
        return make_static(t) if is_plain_tensor(t) else t

    call = _trees.map_tensors(_call(args, kwargs), static, into_objects=False)
    return call[0], {name: call[1][name] for name in kwargs}


def static_buffer(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A static input buffer on ``device`` holding ``t``'s values: detached (a buffer rewritten
    at every call must not extend, or keep alive, any caller's autograd graph) and a normal
    tensor even in inference mode (so an in-place write bumps its version counter, which is how
    the runner learns that the graph writes an argument)."""
    with torch.inference_mode(False):
        if t.device == device:
            return t.detach().clone()
        buf = torch.empty_like(t, device=device)
        buf.copy_(t.detach())
        return buf


def copy_unless_same(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """:func:`copy_all` of the pairs that do not already share their memory."""
    pairs = [(d, s) for d, s in zip(dst, src, strict=True) if d.data_ptr() != s.data_ptr()]
    if pairs:
        copy_all([d for d, _ in pairs], [s for _, s in pairs])


# Up to this many pairs are copied one ``copy_`` each: on the H200 a synchronised 8B-dims decode
# step with two int64 inputs reached its result 12-29 us later when they were loaded by one
# ``_foreach_copy_`` (its launch is slower to reach the device than two small copies), and the
# inputs of a step are loaded right before its first launch. Beyond it, one batched launch saves
# the host more than that.
FEW_COPIES = 4


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every pair (one ``copy_`` each for a few pairs, one batched
    ``_foreach_copy_`` for more), never recorded by autograd (no_grad is entered only when grad
    mode is on: entering it costs more than a copy's launch)."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            _copy_pairs(dst, src)
    else:
        _copy_pairs(dst, src)


def _copy_pairs(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if len(dst) > FEW_COPIES:
        torch._foreach_copy_(dst, src)
        return
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


def identity_objects(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The leaves a signature refers to by identity (to be kept alive with their entry)."""
    leaves, _ = _trees.flatten(_call(args, kwargs))
    return [
        x
        for x in leaves
        if not isinstance(x, (ScalarInput, *_CONSTANTS))
        and not (isinstance(x, torch.Tensor) and is_plain_tensor(x))
    ]


def flatten_signature(sig: Signature) -> dict[str, Any]:
    """Signature as ``{path: leaf key}`` (``args[0]``, ``kwargs['t']``, ``args[1].seq_lens``)."""
    spec, keys = sig
    paths = _trees.key_paths(spec)
    out: dict[str, Any] = {}
    for path, key in zip(paths, keys, strict=True):
        # The walked call is (args, kwargs): "[0][1]" is args[1], "[1]['t']" is kwargs['t'].
        root = "args" if path.startswith("[0]") else "kwargs"
        out[root + path[3:]] = key
    return out


def tensor_paths(sig: Signature, kind: str = "tensor") -> list[str]:
    """The paths of a signature's tensors in containers (``args[0]``, ``kwargs['x']``), in the
    order of the call's static buffers; with ``kind="tensor@"`` those of its tensors inside
    objects (``args[1].seq_lens``), in the order of :func:`object_tensors`."""
    return [path for path, key in flatten_signature(sig).items() if key[0] == kind]


def call_objects(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The dataclasses and plain objects of a call that no other one holds, in walk order
    (a runner passes them to its graph as themselves)."""
    return tuple(_trees.outer_objects(_call(args, kwargs)))


def object_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The plain tensors inside a call's dataclasses and objects (used in place, keyed by
    address), in walk order."""
    leaves, spec = _trees.flatten(_call(args, kwargs))
    return [
        x
        for x, inside in zip(leaves, _trees.in_object(spec), strict=True)
        if inside and isinstance(x, torch.Tensor) and is_plain_tensor(x)
    ]


def _describe(leaf: Any) -> str:
    if leaf is None:
        return "absent"
    kind = leaf[0]
    if kind == "tensor":
        order = "" if leaf[4] is None else f" with dimensions ordered {list(leaf[4])} by stride"
        return f"tensor{list(leaf[1])} {leaf[2]} on {leaf[3]}{order}"
    if kind == "tensor@":
        return f"tensor{list(leaf[1])} {leaf[2]} on {leaf[3]} at address {leaf[4][0]:#x}"
    if kind == "const":
        return repr(leaf[2])
    if kind == "scalar":
        return f"a Python {leaf[1]} copied into a device scalar"
    if len(leaf) > 3:  # a set or container subclass, keyed by its contents too
        return f"{leaf[1]} object #{leaf[2]:x} holding {len(leaf[3])} items (keyed by value)"
    return f"{leaf[1]} object #{leaf[2]:x}"


def describe_signature(sig: Signature) -> str:
    """A signature in words: each argument's path and what it is (``args[0]: tensor[2, 8]
    torch.float32 on cpu, kwargs['t']: 3``); ``no arguments`` for an empty call."""
    fields = [f"{path}: {_describe(key)}" for path, key in flatten_signature(sig).items()]
    return _joined(fields, ", ") if fields else "no arguments"


_FIELDS_SHOWN = 8


def _joined(fields: list[str], sep: str) -> str:
    """The first fields joined by ``sep``, and how many more: a call of hundreds of tensors
    made a log line (and a runner error) of tens of thousands of characters."""
    more = len(fields) - _FIELDS_SHOWN
    shown = fields[:_FIELDS_SHOWN] if more > 0 else fields
    return sep.join([*shown, f"... and {more} more"] if more > 0 else shown)


def describe_difference(sig: Signature, others: list[Signature]) -> str:
    """Which fields of ``sig`` differ from the closest of ``others``, in words.

    This is the text a runner logs for a missed call.

    Args:
        sig: the signature to explain, from :func:`signature_of`.
        others: the signatures to compare with (a runner's captured ones).

    Returns:
        The differing fields of the closest signature (fewest differences), joined by
        ``"; "``, each with its value and the captured one (the first 8, then ``"... and N
        more"``); ``"no signature has been captured yet"`` when ``others`` is empty, and ``"no
        field differs: a captured signature is this one"`` when ``sig`` is among them.

    Raises:
        TypeError: ``sig`` or an item of ``others`` is not a signature (one signature passed
            for ``others`` says to wrap it in a list).
    """
    # One signature passed for the list (its tree spec taken for a signature) failed with a raw
    # "too many values to unpack" deep in the tree code.
    hint = " (pass [other], a list, to compare with one)" if _is_signature(others) else ""
    if not isinstance(others, Iterable):  # list() raised "'int' object is not iterable"
        raise TypeError(
            "describe_difference takes a list of signatures for others, got "
            f"{type(others).__name__}"
        )
    others = list(others)
    for what, value in (("sig", sig), *(("an item of others", o) for o in others)):
        if not _is_signature(value):
            raise TypeError(
                f"describe_difference takes signatures from signature_of; {what} is "
                f"{type(value).__name__}{hint}"
            )
    if not others:
        return "no signature has been captured yet"
    best: list[str] | None = None
    for other in others:
        structure = _trees.difference(sig[0], other[0], root="call")
        if structure is not None:
            diffs = [f"structure: {structure} at capture"]
        else:
            mine, theirs = flatten_signature(sig), flatten_signature(other)
            diffs = [
                f"{path}: {_describe(mine.get(path))} (captured: {_describe(theirs.get(path))})"
                + _hint(mine.get(path), theirs.get(path))
                for path in mine
                if mine.get(path) != theirs.get(path)
            ]
        if best is None or len(diffs) < len(best):
            best = diffs
    assert best is not None
    if not best:  # it was "", which reads as a missing explanation
        return "no field differs: a captured signature is this one"
    return _joined(best, "; ")


def _is_signature(value: Any) -> bool:
    """Whether ``value`` has the form :func:`signature_of` returns: (tree spec, leaves)."""
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], tuple)
        and len(value[0]) == 3
        and isinstance(value[1], tuple)
    )


def _hint(mine: Any, theirs: Any) -> str:
    if mine and theirs and mine[0] == theirs[0] == "tensor@" and mine[1:4] == theirs[1:4]:
        return (
            " — a tensor inside an object argument is used in place, so the graph reads the "
            "address it had at capture; copy new values into it (t.copy_(new)) instead of "
            "rebinding the attribute, or pass the tensor as a top-level argument"
        )
    return ""
