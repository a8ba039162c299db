"""Python functions that ``torch.compile`` sees as one opaque op and runs eagerly at run time.

A break inside compiled code must stay a break: dynamo may not trace it (it reads bcg's context
variables, and its body may sync or launch uncapturable work), and inductor must not move work
across it. Each call site becomes one call of the custom op ``bcg::opaque``: dynamo traces the
call as a ``nonstrict_trace`` function (dynamo flattens the arguments, then runs the function
itself, unchanged, on fake tensors at trace time and once more under AOTAutograd), and that
function calls the op with the call's tensors, its symbolic ints and a key. The key names a
*layout*, made at trace time from the call's argument structure and other non-tensor values
(which dynamo guards on; a changing int stays an argument of the op, not recompiled), so the
op's real implementation, run by the compiled code, rebuilds the call and runs the registered
Python function on the real tensors. The fake implementation runs the registered fake function
(a break's ``capture_stub``, else the function itself) on fake tensors. Tensors the function
writes into are found by a dry run on fake copies when the layout is made, and are passed as
the op's mutated arguments, so the compiler orders reads and writes of them around the op (a
capture_stub must make the writes the function makes: inside an op's implementation torch
bumps no version counter, so a write the stub hides cannot be seen at run time). Every trace
makes its own layout (its output structure and values may depend on shapes, and symbolic ones
belong to that trace). The ops are marked side-effectful: a break that returns nothing is never
dead code.

An op's outputs are fresh tensors, at run time and at trace time: inductor reuses an op's output
buffer for its own results, so the real implementation clones every output that another
reference outside the result could reach (a table, a cached mask, an engine's buffer), read from
reference counts (``owned.py``), and the fake one hands the tracer fake tensors only. Each traced
call also gets a *site* key, a constant in dynamo's graph: a backend that runs that graph as it
is (``backend="eager"``) calls the traced function on real tensors, and checks the output
against the layout the site's trace made, as the op's real implementation does.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# torch's pytree, not _trees.py: dynamo traces this flattening, and nonstrict_trace uses it.
import torch.utils._pytree as pytree  # noqa: PLC2701

from bcg_core import _trees
from bcg_core._capture import owned
from bcg_core._capture.modes import autocast_state, entered
from bcg_core._errors import BreakOutputError
from bcg_core._once import first_time
from bcg_core._trees import PLAIN_VALUES, same_value

# Leaf types an opaque call may take besides tensors (what dynamo can put in a graph as a
# constant); anything else (modules, plain objects) keeps a dynamo graph break. Symbolic numbers
# (dynamic=True) pass for these types in traced code: _apply passes ints to the op, the rest
# concrete.
CONSTANT_TYPES = (int, float, bool, str, complex, torch.dtype, torch.device, torch.layout)

logger = logging.getLogger("bcg_core")
_lock = threading.Lock()
_functions: dict[int, _Registered] = {}
_function_ids = itertools.count()
_layouts: dict[str, _Layout] = {}
_layout_ids = itertools.count()
# Keys carry a per-process nonce: a compiled graph loaded from another process's cache names
# layouts this process never made, and fails with a clear error instead of calling another one.
_NONCE = uuid.uuid4().hex[:8]
_op: Any = None


@dataclass
class _Layout:
    function: int
    spec: pytree.TreeSpec
    # The non-tensor leaves; tensor positions hold _TENSOR, symbolic ints _SYMINT (the op takes
    # those as arguments, so a changing int does not recompile).
    leaves: list[Any]
    mutated: tuple[int, ...]  # indices among the call's tensors that the function writes into
    amp: tuple[Any, ...] | None  # the autocast state the call was traced under (modes.py)
    out_spec: pytree.TreeSpec | None = None
    out_leaves: list[Any] = field(default_factory=list)
    # Per tensor output, the strides compiled code after the op assumes (None: none known).
    out_strides: list[_Strides | None] = field(default_factory=list)
    # Per tensor output, the traced dtype, device and shape (a sympy expression for a symbolic
    # size).
    out_meta: list[_Meta] = field(default_factory=list)
    # The symbols of the traced call's inputs, each at (leaf index, dimension; None for an int
    # leaf): a run-time call gives their values, to check symbolic outputs against.
    symbols: dict[Any, tuple[int, int | None]] = field(default_factory=dict)


_TENSOR = object()
_SYMINT = object()
_Meta = tuple[torch.dtype, torch.device, tuple[Any, ...]]


def _meta(t: torch.Tensor) -> _Meta:
    sizes: list[Any] = list(t.shape)
    return t.dtype, t.device, tuple(d if type(d) is int else d.node.expr for d in sizes)


def _symbols(flat: list[Any]) -> dict[Any, tuple[int, int | None]]:
    """Where each symbol of a traced call's inputs (a symbolic int, a tensor's symbolic size)
    sits among its leaves."""
    found: dict[Any, tuple[int, int | None]] = {}
    for k, x in enumerate(flat):
        sizes: list[tuple[int | None, Any]] = [(None, x)]
        if isinstance(x, torch.Tensor):
            sizes = list(enumerate(x.shape))
        for d, n in sizes:
            if isinstance(n, torch.SymInt) and n.node.expr.is_Symbol:
                found.setdefault(n.node.expr, (k, d))
    return found


def _evaluate(expr: Any, layout: _Layout, flat: list[Any]) -> int | None:
    """A traced symbolic value (``expr``) for a run-time call's leaves ``flat``; None where
    it names a symbol the call's inputs do not give."""
    where = layout.symbols

    def value(sym: Any) -> int:
        k, d = where[sym]
        return int(flat[k] if d is None else flat[k].shape[d])

    if expr.is_Symbol:  # the common case (a dynamic size itself): no sympy substitution
        return value(expr) if expr in where else None
    if not expr.free_symbols <= where.keys():
        return None
    import sympy  # type: ignore[import-untyped]

    values = {sym: sympy.Integer(value(sym)) for sym in expr.free_symbols}
    try:
        return int(expr.xreplace(values))
    except (TypeError, ValueError):  # not a number after all: no check
        return None


class _Registered:
    """A registered function and its fake, held strongly, or weakly for ``weak=True`` (a
    decorated break: the registration lives as long as the wrapper, which owns both)."""

    __slots__ = ("_fake", "_function", "name")

    def __init__(
        self, function: Callable[..., Any], fake: Callable[..., Any], name: str, weak: bool
    ) -> None:
        self.name = name
        self._function: Any = weakref.ref(function) if weak else function
        self._fake: Any = weakref.ref(fake) if weak else fake

    def functions(self) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
        """The function and its fake; None once a weakly held one died."""
        function, fake = self._function, self._fake
        if isinstance(function, weakref.ref):
            function, fake = function(), fake()
            if function is None or fake is None:
                return None
        return function, fake


def register(
    function: Callable[..., Any],
    fake: Callable[..., Any] | None = None,
    name: str = "",
    *,
    weak: bool = False,
) -> int:
    """Register ``function`` (and the function run on fake tensors, default itself) for
    :func:`call`; returns the id that compiled code passes to :func:`call`. With ``weak``, the
    registry holds both weakly and forgets them, with their layouts, when ``function`` dies
    (breaks decorated in a loop or a closure do not pile up); ``fake`` must then be kept alive
    by ``function``."""
    weak = weak and _weakable(function) and _weakable(fake or function)
    with _lock:
        fid = next(_function_ids)
        _functions[fid] = _Registered(function, fake or function, name or repr(function), weak)
    if weak:
        weakref.finalize(function, _dead.append, fid)
    with _lock:
        while _dead:
            _forget(_dead.pop())
    return fid


def _weakable(obj: object) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


# Ids of breaks whose wrapper died, forgotten at the next register() under the lock (a
# finalizer runs inside any allocation, maybe while this thread holds the lock).
_dead: list[int] = []


def _forget(fid: int) -> None:
    _functions.pop(fid, None)
    _broken.pop(fid, None)
    for key in [k for k, layout in _layouts.items() if layout.function == fid]:
        del _layouts[key]
    for site in [s for s, key in _sites.items() if key not in _layouts]:
        del _sites[site]


def _registered(fid: int) -> tuple[Callable[..., Any], Callable[..., Any], str]:
    entry = _functions.get(fid)
    functions = None if entry is None else entry.functions()
    if entry is None or functions is None:
        name = "" if entry is None else f" {entry.name!r}"
        raise RuntimeError(
            f"bcg: compiled code calls a break{name} whose decorated function no longer "
            "exists; decorate breaks once (at module level or in __init__), not inside the "
            "function that calls them"
        )
    return (*functions, entry.name)


def untraceable(function_id: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why an opaque call of registered ``function_id`` cannot take these arguments, or None
    when it can (read by dynamo at trace time; each reason is a constant string). Not when an
    argument is no tensor or constant (a module, a plain object). Not when grad mode is on and
    a tensor argument requires grad: the op has no autograd formula (AOTAutograd failed the
    compile with "Trying to backward through bcg.opaque.default"), so that call is a dynamo
    graph break, and autograd runs through the eager break. Nor, once a traced call of the
    function changed a container argument or failed on fake tensors with one (see
    :data:`_broken`), for calls that take a list or dict (those without lose nothing: they stay
    one op, fullgraph=True included)."""
    if function_id in _broken and _takes_containers(args, kwargs):
        return (
            "it takes a list or dict, and an earlier traced call of it changed one or failed on "
            "fake tensors (bcg's warning then said why and what to do)"
        )
    leaves = pytree.tree_leaves((args, kwargs))
    kinds = (torch.Tensor, *CONSTANT_TYPES)
    if not all(leaf is None or isinstance(leaf, kinds) for leaf in leaves):
        return (
            "an argument is neither a tensor nor a constant (a module, such as the self of a "
            "decorated forward, a class, such as a classmethod's cls, or another object): "
            "decorate a function (or staticmethod) that takes only tensors, numbers, strings, "
            "dtypes and devices (in lists, tuples and dicts)"
        )
    return grad_refusal(leaves)


def grad_refusal(leaves: list[Any]) -> str | None:
    """Why a call with these leaves cannot be one opaque op in grad mode, or None: grad mode
    is on and a tensor among them requires grad, and the op has no backward."""
    if torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in leaves
    ):
        return (
            "a tensor argument requires grad and the op has no backward: call it under "
            "torch.no_grad() (autograd then runs through the eager break)"
        )
    return None


# What a dynamo graph break's message says between the break's name and the reason.
UNTRACEABLE = (
    " is a dynamo graph break here, not one opaque op, so fullgraph=True refuses it (without "
    "fullgraph=True it stays a break, and the code around it compiles as separate graphs): "
)


# Stands for ``None`` across the nonstrict call, whose inputs and outputs must be graph types
# (tensors and numbers; dynamo refuses strings as outputs): ``None`` is a pytree leaf of no
# graph type. A number no code returns on purpose.
_NONE = -0x6BC9_0BC9_0BC9


def _box(tree: Any) -> Any:
    return pytree.tree_map(lambda x: _NONE if x is None else x, tree)


def _unbox(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    return pytree.tree_map(
        lambda x: None if type(x) is int and x == _NONE else x, tree, is_leaf=is_leaf
    )


class _Named:
    """A named tuple of an op's output, across the nonstrict call: dynamo traces the output's
    unflattening, and fails on pytree's named-tuple node (torch 2.13: a KeyError on pytree's
    node registry, so fullgraph=True failed); this node rebuilds it by calling its class."""

    __slots__ = ("cls", "values")

    def __init__(self, cls: type, values: list[Any]) -> None:
        self.cls, self.values = cls, values


class _Constant:
    """A plain value of an op's output that dynamo refuses as the nonstrict call's output (a
    string, a dtype, a device: fullgraph=True failed with "Unsupported output type"): a node
    without children that keeps the value in its context, a constant of the traced output's
    spec, and rebuilds it as the value."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


# The output leaves dynamo takes as they are (None is boxed, see _NONE).
_OUTPUT_TYPES = (torch.Tensor, int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


def _output_nodes(tree: Any) -> Any:
    """``tree`` with every named tuple in it made a :class:`_Named`, and every leaf of another
    type than :data:`_OUTPUT_TYPES` a :class:`_Constant` (real Python, not traced)."""

    def node(x: Any) -> Any:
        if pytree.is_namedtuple_instance(x):
            return _Named(type(x), [_output_nodes(v) for v in x])
        return x if isinstance(x, _OUTPUT_TYPES) else _Constant(x)

    return pytree.tree_map(node, tree, is_leaf=pytree.is_namedtuple_instance)


def _unbox_output(tree: Any) -> Any:
    """:func:`_unbox` for an output, traced by dynamo: a named tuple in it, rebuilt bottom-up
    by its :class:`_Named` node, is unboxed already and never walked (pytree's named-tuple node
    is what dynamo fails on)."""
    return _unbox(tree, is_leaf=pytree.is_namedtuple_instance)


def _named_unflatten(values: Any, cls: Any) -> Any:
    return cls(*_unbox_output(list(values)))


pytree.register_pytree_node(
    _Named,
    lambda node: (node.values, node.cls),
    _named_unflatten,
    serialized_type_name="bcg_core._capture.opaque._Named",
)
pytree.register_pytree_node(
    _Constant,
    lambda node: ([], node.value),
    lambda _, value: value,
    serialized_type_name="bcg_core._capture.opaque._Constant",
)


def call(function_id: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What compiled code calls: ``function(*args, **kwargs)`` as one opaque op. Only for code
    dynamo traces (a plain call would work, but pays for the op's dispatch)."""
    import torch._dynamo  # imported already: dynamo is tracing this

    boxed_args, boxed_kwargs = _box((args, kwargs))
    site = _new_site() + ""  # a value without the source dynamo gives a call's result
    # Compiled code runs without autocast's state (its casts are in the graph), so the break
    # gets the traced one (constant here; dynamo guards on the state around the frame).
    amp = _box(autocast_state())
    # The second element keeps the traced output non-empty (dynamo refuses an empty one).
    out = torch._dynamo.nonstrict_trace(_apply)(function_id, site, amp, boxed_args, boxed_kwargs)
    out = out[0]
    return _unbox_output(out)


# Sites (traced calls) and the layout each one's latest trace made: a backend that runs
# dynamo's graph as it is calls _apply on real tensors, and checks the output against it.
_sites: dict[str, str] = {}
_site_ids = itertools.count()


def _new_site() -> str:
    """A new site key. Dynamo calls this once per traced call and puts the result in the graph
    as a constant, unguarded (``torch._dynamo.assume_constant_result``, set by hand: importing
    dynamo for it would cost every process ~1 s)."""
    with _lock:
        return f"{_NONCE}:s{next(_site_ids)}"


_new_site._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _apply(
    function_id: int, site: str, amp: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, int]:
    """Run at trace time (dynamo's fake pass, then AOTAutograd's): the op call, traced."""
    if torch.compiler.is_dynamo_compiling():  # True only in code dynamo traces symbolically
        # Dynamo traces this body only when running it on fake tensors failed (a break that
        # reads values, with no capture_stub; torch 2.11 then inlines it, and the half-traced
        # call could not work): the call becomes a dynamo graph break, an ordinary break call.
        call = _unbox((args, kwargs))
        if function_id in _broken and _takes_containers(*call):
            # The call below would get dynamo's rebuilt copies of the containers (a change to
            # one was lost): raising makes dynamo run the frame again, where untraceable() sends
            # the call to the graph break with the caller's.
            raise RuntimeError(_broken[function_id])
        out = call_uncompiled(_registered(function_id)[0], *call)
        return _box(out), 0
    # A break passed into the compiled frame (an argument, a closure) has its id read from
    # there, which dynamic=True makes a SymInt: guarded to its value, as any number is here.
    function_id = _concrete(function_id)
    amp = _unbox(amp)
    flat, spec = pytree.tree_flatten(_unbox((args, kwargs)))
    flat = [x if isinstance(x, torch.SymInt) else _concrete(x) for x in flat]
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    # Symbolic ints (a position, a batch size, x.shape[0]) stay symbolic: the op takes them as
    # arguments (guarding each one to its value recompiled the frame at every new value, and
    # fullgraph=True failed at the recompile limit).
    ints = [x for x in flat if isinstance(x, torch.SymInt)]
    if torch._guards.detect_fake_mode(tensors) is None:
        return _output_nodes(_box(_run_as_traced(function_id, site, amp, flat, spec))), 0
    try:
        key = _layout_for(function_id, flat, spec, tensors, amp)
    except _SymbolicRefused as exc:
        # A function that cannot run on them (checks type(n) is int, calls int.bit_length)
        # gets each int's value, guarded on, as before: each new value recompiles.
        _warn_specialized(exc.name, exc.__cause__)
        flat, ints = [_concrete(x) for x in flat], []
        key = _layout_for(function_id, flat, spec, tensors, amp)
    layout = _layouts[key]
    functional, mutating, take = _ops()
    if layout.mutated:
        mutated = [tensors[i] for i in layout.mutated]
        rest = [t for i, t in enumerate(tensors) if i not in layout.mutated]
        mutating(mutated, rest, ints, key)
        # Its tensor outputs come from a second op that reads the written tensors, so it runs
        # after the write (torch cannot functionalize an op that writes and returns tensors).
        outs = take(mutated, key)
    else:
        outs = functional([], tensors, ints, key)
    assert layout.out_spec is not None  # set by the fake implementation the call just ran
    with _lock:
        _sites[site] = key
    return _output_nodes(_box(_rebuild(layout.out_leaves, outs, layout.out_spec))), 0


def _run_as_traced(
    function_id: int, site: str, amp: tuple[Any, ...] | None, flat: list[Any], spec: pytree.TreeSpec
) -> Any:
    """Not a trace: a backend that runs dynamo's graph as it is (backend="eager") calls _apply
    on the real tensors at every call. The call is just the call, its output checked against
    the traced one (the graph after it uses the traced non-tensor values)."""
    function, _, name = _registered(function_id)
    args, kwargs = pytree.tree_unflatten(flat, spec)
    with _autocast(amp):
        out = function(*args, **kwargs)
    got, got_spec = pytree.tree_flatten(out)
    _check_output(name, got, got_spec, _layout(_sites.get(site, site)), flat)
    return out


def _autocast(amp: tuple[Any, ...] | None) -> contextlib.AbstractContextManager[None]:
    """The traced call's autocast state (``modes.autocast_state``), entered where it is not
    the current one: compiled code runs without it, and a break run in float32 under a
    bfloat16 autocast returned another dtype and other values than eager's."""
    if amp == autocast_state():
        return contextlib.nullcontext()
    return entered((torch.is_inference_mode_enabled(), amp))


class _SymbolicRefused(Exception):
    """The dry run failed on a call with symbolic ints: it is retried with their values."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _warn_specialized(name: str, cause: BaseException | None) -> None:
    if first_time(("specialized", name)):
        logger.warning(
            "bcg: break %s failed on a symbolic int under torch.compile (%s: %s), so it gets "
            "each int argument's value instead, and every new value recompiles the frame "
            "(fullgraph=True fails at the recompile limit). To keep changing ints dynamic, make "
            "the break (or its capture_stub) accept a torch.SymInt where it takes an int.",
            name,
            type(cause).__name__,
            cause,
        )


def _concrete(x: Any) -> Any:
    """A symbolic number as the value it has now, guarded on: under ``dynamic=True`` dynamo
    passes a float such as an attention scale as a SymFloat, and an op's layout is made of
    constants (a later call with another value recompiles). Not for symbolic ints, which the
    op takes as arguments."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        from torch.fx.experimental.symbolic_shapes import guard_scalar

        return guard_scalar(x)
    return x


def _call(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return function(*args, **kwargs)


# ``function(*args, **kwargs)``, never traced: where dynamo meets it, a graph break (the runner
# uses it too). torch's lazy form: ``torch._dynamo.disable`` at import would import dynamo
# (1.4 s) for every user.
call_uncompiled = torch._disable_dynamo(_call)  # type: ignore[attr-defined]


def _refusal(
    name: str, message: str, kind: type[Exception], broken: int | None = None
) -> Exception:
    """An error raised where dynamo runs a call on fake tensors, logged once per break and
    kind: dynamo reports its own error (with this one as the cause) or graph-breaks. Given
    ``broken`` (a function id), that function's calls taking a list or dict are graph breaks
    from now on."""
    if first_time((kind, name)):
        logger.warning(message)
    if broken is not None:
        with _lock:
            _broken[broken] = message
    return kind(message)


def _unfakeable(name: str, exc: Exception, broken: int | None = None) -> Exception:
    """The error for a function that cannot run on fake tensors (``broken``: see
    :func:`_refusal`)."""
    message = (
        f"bcg: break {name} cannot run on fake tensors, which torch.compile needs to know its "
        f"outputs ({type(exc).__name__}: {exc}), so under torch.compile it is a dynamo graph "
        "break: the code around it compiles as separate graphs, and fullgraph=True fails "
        "(dynamo: 'Unsupported output type for nonstrict_trace-ed function'). To make it one "
        "opaque op in one graph, give the break a capture_stub that computes outputs of the "
        "same structure, shapes and dtypes without reading values."
    )
    return _refusal(name, message, TypeError, broken)


def _layout_for(
    function_id: int,
    flat: list[Any],
    spec: pytree.TreeSpec,
    tensors: list[torch.Tensor],
    amp: tuple[Any, ...] | None,
) -> str:
    """A new layout for this traced call (one per trace: its output may depend on the traced
    shapes, and its symbolic values belong to that trace's shape environment)."""
    leaves = [
        _TENSOR if isinstance(x, torch.Tensor) else _SYMINT if isinstance(x, torch.SymInt) else x
        for x in flat
    ]
    mutated = _written_tensors(function_id, flat, spec, tensors, amp)
    _refuse_overlaps(function_id, tensors, mutated)
    with _lock:
        key = f"{_NONCE}:{next(_layout_ids)}"
        _layouts[key] = _Layout(function_id, spec, leaves, mutated, amp)
    return key


def _refuse_overlaps(fid: int, tensors: list[torch.Tensor], mutated: tuple[int, ...]) -> None:
    """A written tensor may share memory with no other argument: functionalization copies the
    written one, and the other would read the copy's stale source (silently wrong)."""
    for i in mutated:
        storage = tensors[i].untyped_storage()._cdata
        for j, other in enumerate(tensors):
            if j != i and other.untyped_storage()._cdata == storage:
                name = _registered(fid)[2]
                raise _refusal(
                    name,
                    f"bcg: break {name!r} writes its tensor argument {i} and also takes "
                    f"argument {j}, which shares its memory (a view of it, or the same "
                    "tensor); compiled, the written tensor would be replaced by a copy and the "
                    "other would read stale values, so under torch.compile this call is a "
                    "dynamo graph break (fullgraph=True fails). Pass the tensor once and take "
                    "the view inside the break.",
                    ValueError,
                )


# Ids of the functions whose calls taking a list or dict are dynamo graph breaks with the
# caller's arguments, and why: a traced call changed a list or dict argument, or failed on fake
# tensors with one (its fallback in _apply got copies of the containers; a change to them was
# lost, silently). Their calls without containers stay opaque ops.
_broken: dict[int, str] = {}


def _refuse_changed_containers(
    fid: int, name: str, call: Any, leaves: list[Any], spec: pytree.TreeSpec
) -> None:
    """A compiled break gets copies of its list and dict arguments (the op rebuilds the call
    from a layout), so a change it makes to one (an append, a key set) never reached the
    caller's, and the code after it read the traced, unchanged one: refused where the call is
    traced, seen in the dry run (a capture_stub must make such changes too)."""
    after, after_spec = pytree.tree_flatten(call)
    if after_spec == spec and all(a is b for a, b in zip(after, leaves, strict=True)):
        return
    raise _refusal(
        name,
        f"bcg: break {name!r} changes a list or dict it takes as an argument (an append, an "
        "item set); under torch.compile a break is an op that gets copies of its containers, "
        "so the change would not reach the caller's, and the compiled code after it would read "
        "the traced, unchanged one. So under torch.compile its calls are dynamo graph breaks "
        "(fullgraph=True fails), which pass the caller's containers. To make it one opaque "
        "op, return the new values from the break instead.",
        ValueError,
        fid,
    )


def _takes_containers(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call takes a list or a dict (one a break could change)."""

    def holds(x: Any) -> bool:
        if isinstance(x, (list, dict)):
            return True
        return isinstance(x, tuple) and any(holds(v) for v in x)

    return holds(args) or any(holds(v) for v in kwargs.values())


def _written_tensors(
    function_id: int,
    flat: list[Any],
    spec: pytree.TreeSpec,
    tensors: list[torch.Tensor],
    amp: tuple[Any, ...] | None,
) -> tuple[int, ...]:
    """Which of the call's tensors the fake function writes into: a dry run on fake copies
    (made in the tracing fake mode), comparing version counters."""
    _, fake, name = _registered(function_id)
    # Normal tensors even in inference mode: an inference tensor has no version counter
    # (a call traced under torch.inference_mode() failed with torch's raw error).
    with torch.inference_mode(False):
        copies = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            for t in tensors
        ]
    versions = [c._version for c in copies]
    it = iter(copies)
    leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in flat]
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    try:
        with _autocast(amp):
            out = fake(*args, **kwargs)
    except Exception as exc:
        if any(isinstance(x, torch.SymInt) for x in flat):
            raise _SymbolicRefused(name) from exc
        # Its graph break gets copies of list and dict arguments: one with those is a graph
        # break with the caller's arguments (a change the break makes to them was lost).
        broken = function_id if _takes_containers(args, kwargs) else None
        raise _unfakeable(name, exc, broken) from exc
    _refuse_changed_containers(function_id, name, (args, kwargs), leaves, spec)
    if torch.is_grad_enabled() and any(t.requires_grad for t in _trees.tensor_leaves(out)):
        # The op has no backward: its output would require no grad, and the parameter the
        # break uses got no gradient, silently (or backward() failed).
        raise _refusal(
            name,
            f"bcg: break {name!r} returns a tensor that requires grad (it uses a parameter, or "
            "another tensor that requires grad, that it does not take as an argument); a "
            "compiled break is an op without a backward, so in grad mode this call is a dynamo "
            "graph break and autograd runs through the eager break (fullgraph=True fails). "
            "Under torch.no_grad() it is one opaque op.",
            TypeError,
        )
    return tuple(
        i for i, (c, v) in enumerate(zip(copies, versions, strict=True)) if c._version != v
    )


def _call_args(
    layout: _Layout, mutated: list[Any], rest: list[Any], ints: list[Any]
) -> tuple[Any, Any, list[Any]]:
    """The call's args and kwargs, and its leaves."""
    m, r = iter(mutated), iter(rest)
    count = len(mutated) + len(rest)
    tensors = [next(m) if i in layout.mutated else next(r) for i in range(count)]
    it, numbers = iter(tensors), iter(ints)
    flat = [
        next(it) if x is _TENSOR else next(numbers) if x is _SYMINT else x for x in layout.leaves
    ]
    args, kwargs = pytree.tree_unflatten(flat, layout.spec)
    return args, kwargs, flat


def _rebuild(out_leaves: list[Any], outs: list[Any], out_spec: pytree.TreeSpec) -> Any:
    it = iter(outs)
    return pytree.tree_unflatten([next(it) if x is _TENSOR else x for x in out_leaves], out_spec)


def _fresh_outputs(
    result: Any,
    inputs: list[torch.Tensor],
    name: str = "",
    made: Callable[[torch.Tensor], bool] | None = None,
) -> tuple[list[Any], Any]:
    """The result's leaves and spec, with every tensor that shares storage with an input or an
    earlier output cloned, and given ``made`` (a test for "the call made this tensor and
    nothing else holds it"), every tensor that fails it: an op's outputs may alias nothing, and
    compiled code reuses an op's output buffer for its own results. Given the break's ``name``,
    an output that aliases an input or an earlier output is warned about once (compiled code
    sees a copy of it)."""
    flat, spec = pytree.tree_flatten(result)
    inputs_at = {t.untyped_storage()._cdata for t in inputs}
    seen = set(inputs_at)
    out: list[Any] = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            at = x.untyped_storage()._cdata
            if at in seen:
                if name and at in inputs_at:
                    _warn_alias(name)
                elif name:
                    _warn_twin(name)
                x = x.clone()
            elif made is not None and not made(x):
                x = x.clone()
            seen.add(x.untyped_storage()._cdata)
        out.append(x)
    return out, spec


def _made_by_call(box: list[Any]) -> Callable[[torch.Tensor], bool]:
    """A test for "nothing but the output in ``box`` holds this tensor's storage" (the call
    made it and kept no reference: a table, a cached mask or an engine's buffer returned as it
    is fails), read from reference counts (``owned.py``); the caller must hold the output
    nowhere but in ``box``. Where counts cannot tell, every tensor fails (is cloned)."""
    devices = {t.device for t in _trees.tensor_leaves(box[0])}
    tests = [owned.sole_owned(box, device) for device in devices]
    known = [test for test in tests if test is not None]
    if len(known) < len(tests):
        return lambda t: False
    return lambda t: any(test(t) for test in known)


def _warn_alias(name: str) -> None:
    if first_time(("alias", name)):
        warnings.warn(
            f"bcg: break {name!r} returned a tensor that shares memory with one of its "
            "arguments; under torch.compile a break is an op, whose outputs may alias nothing, "
            "so the code after it gets a copy: writes through the output do not reach the "
            "argument, and later writes into the argument do not show in the output. Return "
            "a new tensor, or write into the argument and return nothing.",
            stacklevel=2,
        )


def _warn_twin(name: str) -> None:
    # Eager code after the break sees one memory for both (a write through one shows in the
    # other); compiled code got separate copies silently before.
    if first_time(("twin", name)):
        warnings.warn(
            f"bcg: break {name!r} returned tensors that share memory (one tensor twice, or "
            "views of one tensor); under torch.compile a break is an op, whose outputs may "
            "alias nothing, so the code after it gets separate copies: a write through one "
            "does not show in the other. Return separate tensors, or one tensor and take the "
            "views after the break.",
            stacklevel=2,
        )


def _layout(key: str) -> _Layout:
    layout = _layouts.get(key)
    if layout is None:
        raise RuntimeError(
            f"bcg: compiled code calls opaque layout {key!r}, which this process never traced "
            "(a graph from another process's compile cache?); disable torch.compile's caches "
            "for code with bcg breaks (torch._inductor.config.fx_graph_cache = False)"
        )
    return layout


def _real(
    mutated: list[torch.Tensor], rest: list[torch.Tensor], ints: list[int], key: str
) -> list[torch.Tensor]:
    layout = _layout(key)
    function, _, name = _registered(layout.function)
    args, kwargs, leaves = _call_args(layout, mutated, rest, ints)
    with _autocast(layout.amp):
        box = [function(*args, **kwargs)]  # held nowhere else: _made_by_call counts references
    made = _made_by_call(box)
    flat, spec = _fresh_outputs(box.pop(), [*mutated, *rest], name, made)
    _check_output(name, flat, spec, layout, leaves)
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    for i, want in enumerate(layout.out_strides):
        t = tensors[i]
        stride = None if want is None else want.stride_for(tuple(t.shape))
        if stride is not None and t.stride() != stride:
            # The compiled code after the op was built for the traced strides (a capture_stub
            # that returns another layout than the kernel): give it those.
            like = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
            tensors[i] = like.copy_(t)
    return tensors


def _check_output(
    name: str, flat: list[Any], spec: pytree.TreeSpec, layout: _Layout, inputs: list[Any]
) -> None:
    """Raise BreakOutputError where a run-time output (leaves and spec) differs from the traced
    one in structure or in a plain value (the compiled code after the op uses traced ones); a
    symbolic one is checked against its value for the call's leaves ``inputs``."""
    if spec != layout.out_spec:
        raise BreakOutputError(
            f"break {name!r} returned {spec} at run time, but {layout.out_spec} when "
            "torch.compile traced it: a compiled break must return one structure"
        )
    metas = iter(layout.out_meta)
    for i, (got, want) in enumerate(zip(flat, layout.out_leaves, strict=True)):
        if want is _TENSOR:
            _check_tensor(name, i, got, next(metas), layout, inputs)
        elif isinstance(want, torch.SymInt):
            value = _evaluate(want.node.expr, layout, inputs)
            if value is not None and not same_value(got, value):
                raise BreakOutputError(
                    f"break {name!r} returned {got!r} at run time as output leaf {i}, but "
                    f"{want.node.expr} = {value} for this call when torch.compile traced it "
                    "(its capture_stub's output, or the function's on fake tensors), and the "
                    "compiled code after it uses the traced value. Make the capture_stub return "
                    "the values the function returns."
                )
        elif type(want) in PLAIN_VALUES and not same_value(got, want):
            raise BreakOutputError(
                f"break {name!r} returned {got!r} at run time as output leaf {i}, but {want!r} "
                "when torch.compile traced it, and the compiled code after it uses the traced "
                "value. Return the value as a tensor, or make it a value the call's arguments "
                "decide (dynamo guards on those and recompiles)."
            )


def _check_tensor(
    name: str, i: int, got: Any, want: _Meta, layout: _Layout, inputs: list[Any]
) -> None:
    """Raise BreakOutputError where a run-time tensor output differs from the traced one in
    dtype, device or a size (a symbolic one evaluated for the call's leaves ``inputs``: a size
    an int argument decides): the compiled code after the op is built for the traced ones
    (inductor read a float64 output's memory as float32, silently)."""
    dtype, device, traced = want
    shape = [w if type(w) is int else _evaluate(w, layout, inputs) for w in traced]
    if isinstance(got, torch.Tensor):
        if (got.dtype, got.device, got.dim()) == (dtype, device, len(shape)) and all(
            w in (None, g) for g, w in zip(got.shape, shape, strict=True)
        ):
            return
        what = f"a {got.dtype} tensor of shape {tuple(got.shape)} on {got.device}"
    else:
        what = repr(got)
    sizes = tuple("*" if d is None else d for d in shape)
    raise BreakOutputError(
        f"break {name!r} returned {what} at run time as output leaf {i}, but a {dtype} "
        f"tensor of shape {sizes} on {device} when torch.compile traced it (its capture_stub's "
        "output, or the function's on fake tensors), and the compiled code after it is built "
        "for the traced one. Make the capture_stub return the dtypes and shapes the function "
        "returns."
    )


def _fake(
    mutated: list[torch.Tensor], rest: list[torch.Tensor], ints: list[Any], key: str
) -> list[torch.Tensor]:
    layout = _layout(key)
    _, fake, _ = _registered(layout.function)
    args, kwargs, inputs = _call_args(layout, mutated, rest, ints)
    with _autocast(layout.amp), _real_tensors_allowed():
        result = fake(*args, **kwargs)
    flat, spec = _fresh_outputs(result, [*mutated, *rest])
    leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in flat]
    tensors = [_as_fake(x) for x in flat if isinstance(x, torch.Tensor)]
    with _lock:
        if layout.out_spec is None:
            layout.out_spec, layout.out_leaves = spec, leaves
            layout.out_strides = [_Strides.of(t) for t in tensors]
            layout.out_meta = [_meta(t) for t in tensors]
            layout.symbols = _symbols(inputs)
    return tensors


@contextlib.contextmanager
def _real_tensors_allowed() -> Iterator[None]:
    """The active fake mode takes real tensors (made fake constants) while the function runs
    on fakes: a break may read a tensor it does not take (a module-level table, a default
    argument, a closure's buffer). Dynamo's mode allows them; inductor's re-run of the graph on
    fakes did not ("Please convert all Tensors to FakeTensors first"), so such a break failed
    to compile under inductor."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is None or mode.allow_non_fake_inputs:
        yield
        return
    mode.allow_non_fake_inputs = True
    try:
        yield
    finally:
        mode.allow_non_fake_inputs = False


def _as_fake(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where it is a real tensor (a function run on fake tensors returns a table or a
    buffer it keeps) a new one like it in the active fake mode: the tracer takes only fakes."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if getattr(t, "fake_mode", None) is mode:
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


@dataclass(frozen=True)
class _Strides:
    """The strides the compiled code after the op expects of one tensor output: ``fixed``
    (shape and strides) where the traced ones are concrete, else ``order`` (its dimensions from
    outermost to innermost) where the traced tensor is dense in that order, shapes symbolic."""

    fixed: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    order: tuple[int, ...] | None = None

    @staticmethod
    def of(t: torch.Tensor) -> _Strides | None:
        """What a traced output fixes; None where its strides are symbolic and not dense."""
        if all(type(d) is int for d in (*t.shape, *t.stride())):
            return _Strides(fixed=(tuple(t.shape), tuple(t.stride())))
        from torch.fx.experimental.symbolic_shapes import guard_or_false

        stride = t.stride()

        def outer_first(a: int, b: int) -> int:  # sort reads only "less"; undecided: checked below
            return -1 if guard_or_false(stride[a] > stride[b]) else 0

        order = tuple(sorted(range(t.dim()), key=functools.cmp_to_key(outer_first)))
        dense = _dense_strides(t.shape, order)
        # Without guards: the layout must not add any (a check that needs one fails: None).
        if all(guard_or_false(a == b) for a, b in zip(stride, dense, strict=True)):
            return _Strides(order=order)
        return None

    def stride_for(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The strides expected of an output of this run-time ``shape``; None: no demand."""
        if self.fixed is not None:
            return self.fixed[1] if shape == self.fixed[0] else None
        assert self.order is not None
        return tuple(_dense_strides(shape, self.order))


def _dense_strides(shape: Any, order: tuple[int, ...]) -> list[Any]:
    """The strides of a dense tensor of ``shape`` whose dimensions, outermost to innermost,
    are ``order`` (as ``torch.empty`` makes them: an empty dimension counts as one)."""
    strides: list[Any] = [1] * len(shape)
    step: Any = 1
    for d in reversed(order):
        strides[d] = step
        size = shape[d]  # symbolic sizes are at least 2 (dynamo specializes 0 and 1)
        step = step * (1 if type(size) is int and size == 0 else size)
    return strides


# The outputs of the last writing op per layout, on this thread, until its take op reads them.
_taken = threading.local()


def _stash(key: str, outs: list[torch.Tensor]) -> None:
    stash = getattr(_taken, "outs", None)
    if stash is None:
        stash = _taken.outs = {}
    stash[key] = outs


def _take(key: str, written: list[torch.Tensor]) -> list[torch.Tensor]:
    outs: list[torch.Tensor] = _taken.outs.pop(key)
    # An op's outputs may alias none of its inputs (the written tensors, here).
    return _fresh_outputs(outs, written)[0]


def _real_mut(
    mutated: list[torch.Tensor], rest: list[torch.Tensor], ints: list[int], key: str
) -> None:
    _stash(key, _real(mutated, rest, ints, key))


def _fake_mut(
    mutated: list[torch.Tensor], rest: list[torch.Tensor], ints: list[Any], key: str
) -> None:
    _stash(key, _fake(mutated, rest, ints, key))


def _real_take(written: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return _take(key, written)


def _fake_take(written: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return _take(key, written)


def _ops() -> tuple[Any, Any, Any]:
    """``torch.ops.bcg.opaque`` (returns fresh tensors, writes nothing),
    ``torch.ops.bcg.opaque_mut`` (writes into ``mutated``, returns nothing) and
    ``torch.ops.bcg.opaque_take`` (the tensors the last ``opaque_mut`` of a layout returned, on
    this thread), defined on first use (a compile is running then)."""
    global _op
    with _lock:
        if _op is None:
            functional = torch.library.custom_op(
                "bcg::opaque",
                _real,
                mutates_args=(),
                schema="(Tensor[] mutated, Tensor[] rest, SymInt[] ints, str key) -> Tensor[]",
            )
            functional.register_fake(_fake)
            mutating = torch.library.custom_op(
                "bcg::opaque_mut",
                _real_mut,
                mutates_args=("mutated",),
                schema="(Tensor(a!)[] mutated, Tensor[] rest, SymInt[] ints, str key) -> ()",
            )
            mutating.register_fake(_fake_mut)
            take = torch.library.custom_op(
                "bcg::opaque_take",
                _real_take,
                mutates_args=(),
                schema="(Tensor[] written, str key) -> Tensor[]",
            )
            take.register_fake(_fake_take)
            ops = torch.ops.bcg
            _op = (ops.opaque.default, ops.opaque_mut.default, ops.opaque_take.default)
            # A break may act only on the host (log, hand a tensor to an engine) and return
            # nothing anyone reads: without this, AOTAutograd's and inductor's dead-code
            # elimination drop the call and the break never runs.
            for op in _op:
                torch.fx.node.has_side_effect(op)
    return _op  # type: ignore[no-any-return]
