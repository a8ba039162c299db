"""Python functions that ``torch.compile`` sees as one opaque op and runs eagerly at run time.

A break inside compiled code must stay a break: dynamo may not trace it (it reads bcg's context
variables, and its body may sync or launch uncapturable work), and inductor must not move work
across it. Each call site becomes one call of the custom op ``bcg::opaque``: dynamo traces the
call as a ``nonstrict_trace`` function (dynamo flattens the arguments, then runs the function
itself, unchanged, on fake tensors at trace time and once more under AOTAutograd), and that
function calls the op with the call's tensors and a key. The key names a *layout*, made at trace
time from the call's argument structure and non-tensor values (which dynamo guards on), so the
op's real implementation, run by the compiled code, rebuilds the call and runs the registered
Python function on the real tensors. The fake implementation runs the registered fake function
(a break's ``capture_stub``, else the function itself) on fake tensors. Tensors the function
writes into are found by a dry run on fake copies when the layout is made, and are passed as
the op's mutated arguments, so the compiler orders reads and writes of them around the op.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# torch's pytree, not _trees.py: dynamo traces this flattening, and nonstrict_trace uses it.
import torch.utils._pytree as pytree  # noqa: PLC2701

from bcg_core._errors import BreakOutputError
from bcg_core._trees import PLAIN_VALUES, same_value

# Leaf types an opaque call may take besides tensors (what dynamo can put in a graph as a
# constant); anything else (modules, plain objects) keeps a dynamo graph break. Symbolic numbers
# (dynamic=True) pass for these types in traced code and are made concrete in _apply.
CONSTANT_TYPES = (int, float, bool, str, complex, torch.dtype, torch.device, torch.layout)

logger = logging.getLogger("bcg_core")
_lock = threading.Lock()
_functions: dict[int, tuple[Callable[..., Any], Callable[..., Any], str]] = {}
_function_ids = itertools.count()
_layouts: dict[str, _Layout] = {}
_layout_keys: dict[tuple[Any, ...], str] = {}
# Keys carry a per-process nonce: a compiled graph loaded from another process's cache names
# layouts this process never made, and fails with a clear error instead of calling another one.
_NONCE = uuid.uuid4().hex[:8]
_op: Any = None


@dataclass
class _Layout:
    function: int
    spec: pytree.TreeSpec
    leaves: list[Any]  # the non-tensor leaves; tensor positions hold _TENSOR
    mutated: tuple[int, ...]  # indices among the call's tensors that the function writes into
    out_spec: pytree.TreeSpec | None = None
    out_leaves: list[Any] = field(default_factory=list)


_TENSOR = object()


def register(
    function: Callable[..., Any], fake: Callable[..., Any] | None = None, name: str = ""
) -> int:
    """Register ``function`` (and the function run on fake tensors, default itself) for
    :func:`call`; returns the id that compiled code passes to :func:`call`."""
    with _lock:
        fid = next(_function_ids)
        _functions[fid] = (function, fake or function, name or repr(function))
    return fid


def traceable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an opaque call can take these arguments (read by dynamo at trace time)."""
    return all(
        leaf is None or isinstance(leaf, (torch.Tensor, *CONSTANT_TYPES))
        for leaf in pytree.tree_leaves((args, kwargs))
    )


# Stands for ``None`` across the nonstrict call, whose inputs and outputs must be graph types
# (tensors and numbers; dynamo refuses strings as outputs): ``None`` is a pytree leaf of no
# graph type. A number no code returns on purpose.
_NONE = -0x6BC9_0BC9_0BC9


def _box(tree: Any) -> Any:
    return pytree.tree_map(lambda x: _NONE if x is None else x, tree)


def _unbox(tree: Any) -> Any:
    return pytree.tree_map(lambda x: None if type(x) is int and x == _NONE else x, tree)


def call(function_id: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What compiled code calls: ``function(*args, **kwargs)`` as one opaque op. Only for code
    dynamo traces (a plain call would work, but pays for the op's dispatch)."""
    import torch._dynamo  # imported already: dynamo is tracing this

    boxed_args, boxed_kwargs = _box((args, kwargs))
    # The second element keeps the traced output non-empty (dynamo refuses an empty one).
    out = torch._dynamo.nonstrict_trace(_apply)(function_id, boxed_args, boxed_kwargs)[0]
    return _unbox(out)


def _apply(function_id: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
    """Run at trace time (dynamo's fake pass, then AOTAutograd's): the op call, traced."""
    if torch.compiler.is_dynamo_compiling():  # True only in code dynamo traces symbolically
        # Dynamo traces this body only when running it on fake tensors failed (a break that
        # reads values, with no capture_stub; torch 2.11 then inlines it, and the half-traced
        # call could not work): the call becomes a dynamo graph break, an ordinary break call.
        out = _eager(_functions[function_id][0], *_unbox((args, kwargs)))
        return _box(out), 0
    flat, spec = pytree.tree_flatten(_unbox((args, kwargs)))
    flat = [_concrete(x) for x in flat]
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    key = _layout_for(function_id, flat, spec, tensors)
    layout = _layouts[key]
    functional, mutating, take = _ops()
    if layout.mutated:
        mutated = [tensors[i] for i in layout.mutated]
        rest = [t for i, t in enumerate(tensors) if i not in layout.mutated]
        mutating(mutated, rest, key)
        # Its tensor outputs come from a second op that reads the written tensors, so it runs
        # after the write (torch cannot functionalize an op that writes and returns tensors).
        outs = take(mutated, key)
    else:
        outs = functional([], tensors, key)
    assert layout.out_spec is not None  # set by the fake implementation the call just ran
    return _box(_rebuild(layout.out_leaves, outs, layout.out_spec)), 0


def _concrete(x: Any) -> Any:
    """A symbolic number as the value it has now, guarded on: under ``dynamic=True`` dynamo
    passes a float such as an attention scale as a SymFloat, and an op's layout is made of
    constants (a later call with another value recompiles)."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        from torch.fx.experimental.symbolic_shapes import guard_scalar

        return guard_scalar(x)
    return x


def _call(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return function(*args, **kwargs)


# ``function(*args, **kwargs)``, never traced: where dynamo meets it, a graph break. torch's
# lazy form: ``torch._dynamo.disable`` at import would import dynamo (1.4 s) for every user.
_eager = torch._disable_dynamo(_call)  # type: ignore[attr-defined]


_warned: set[str] = set()


def _unfakeable(name: str, exc: Exception) -> TypeError:
    """The error for a function that cannot run on fake tensors (logged once per function:
    dynamo reports its own error, with this one as the cause, or graph-breaks)."""
    message = (
        f"bcg: break {name} cannot run on fake tensors, which torch.compile needs to know its "
        f"outputs ({type(exc).__name__}: {exc}), so under torch.compile it is a dynamo graph "
        "break: the code around it compiles as separate graphs, and fullgraph=True fails "
        "(dynamo: 'Unsupported output type for nonstrict_trace-ed function'). To make it one "
        "opaque op in one graph, give the break a capture_stub that computes outputs of the "
        "same structure, shapes and dtypes without reading values."
    )
    with _lock:
        first = name not in _warned
        _warned.add(name)
    if first:
        logger.warning(message)
    return TypeError(message)


def _layout_for(
    function_id: int, flat: list[Any], spec: pytree.TreeSpec, tensors: list[torch.Tensor]
) -> str:
    leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in flat]
    ident = (
        function_id,
        str(spec),
        tuple((type(x), x) if x is not _TENSOR else None for x in leaves),
    )
    with _lock:
        key = _layout_keys.get(ident)
    if key is not None:
        return key
    mutated = _written_tensors(function_id, flat, spec, tensors)
    with _lock:
        key = _layout_keys.get(ident)
        if key is None:
            key = f"{_NONCE}:{len(_layouts)}"
            _layouts[key] = _Layout(function_id, spec, leaves, mutated)
            _layout_keys[ident] = key
    return key


def _written_tensors(
    function_id: int, flat: list[Any], spec: pytree.TreeSpec, tensors: list[torch.Tensor]
) -> tuple[int, ...]:
    """Which of the call's tensors the fake function writes into: a dry run on fake copies
    (made in the tracing fake mode), comparing version counters."""
    _, fake, name = _functions[function_id]
    copies = [
        torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in tensors
    ]
    versions = [c._version for c in copies]
    it = iter(copies)
    args, kwargs = pytree.tree_unflatten(
        [next(it) if isinstance(x, torch.Tensor) else x for x in flat], spec
    )
    try:
        fake(*args, **kwargs)
    except Exception as exc:
        raise _unfakeable(name, exc) from exc
    return tuple(
        i for i, (c, v) in enumerate(zip(copies, versions, strict=True)) if c._version != v
    )


def _call_args(layout: _Layout, mutated: list[Any], rest: list[Any]) -> tuple[Any, Any]:
    m, r = iter(mutated), iter(rest)
    count = len(mutated) + len(rest)
    tensors = [next(m) if i in layout.mutated else next(r) for i in range(count)]
    it = iter(tensors)
    flat = [next(it) if x is _TENSOR else x for x in layout.leaves]
    args, kwargs = pytree.tree_unflatten(flat, layout.spec)
    return args, kwargs


def _rebuild(out_leaves: list[Any], outs: list[Any], out_spec: pytree.TreeSpec) -> Any:
    it = iter(outs)
    return pytree.tree_unflatten([next(it) if x is _TENSOR else x for x in out_leaves], out_spec)


def _fresh_outputs(result: Any, inputs: list[torch.Tensor]) -> tuple[list[Any], Any]:
    """The result's leaves and spec, with every tensor that shares storage with an input or an
    earlier output cloned: an op's outputs may alias nothing."""
    flat, spec = pytree.tree_flatten(result)
    seen = {t.untyped_storage()._cdata for t in inputs}
    out: list[Any] = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            if x.untyped_storage()._cdata in seen:
                x = x.clone()
            seen.add(x.untyped_storage()._cdata)
        out.append(x)
    return out, spec


def _layout(key: str) -> _Layout:
    layout = _layouts.get(key)
    if layout is None:
        raise RuntimeError(
            f"bcg: compiled code calls opaque layout {key!r}, which this process never traced "
            "(a graph from another process's compile cache?); disable torch.compile's caches "
            "for code with bcg breaks (torch._inductor.config.fx_graph_cache = False)"
        )
    return layout


def _real(mutated: list[torch.Tensor], rest: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    layout = _layout(key)
    function, _, name = _functions[layout.function]
    args, kwargs = _call_args(layout, mutated, rest)
    flat, spec = _fresh_outputs(function(*args, **kwargs), [*mutated, *rest])
    if spec != layout.out_spec:
        raise BreakOutputError(
            f"break {name!r} returned {spec} at run time, but {layout.out_spec} when "
            "torch.compile traced it: a compiled break must return one structure"
        )
    for i, (got, want) in enumerate(zip(flat, layout.out_leaves, strict=True)):
        if type(want) in PLAIN_VALUES and not same_value(got, want):
            raise BreakOutputError(
                f"break {name!r} returned {got!r} at run time as output leaf {i}, but {want!r} "
                "when torch.compile traced it, and the compiled code after it uses the traced "
                "value. Return the value as a tensor, or make it a value the call's arguments "
                "decide (dynamo guards on those and recompiles)."
            )
    return [x for x in flat if isinstance(x, torch.Tensor)]


def _fake(mutated: list[torch.Tensor], rest: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    layout = _layout(key)
    _, fake, _ = _functions[layout.function]
    args, kwargs = _call_args(layout, mutated, rest)
    flat, spec = _fresh_outputs(fake(*args, **kwargs), [*mutated, *rest])
    leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in flat]
    with _lock:
        if layout.out_spec is None:
            layout.out_spec, layout.out_leaves = spec, leaves
    return [x for x in flat if isinstance(x, torch.Tensor)]


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


def _real_mut(mutated: list[torch.Tensor], rest: list[torch.Tensor], key: str) -> None:
    _stash(key, _real(mutated, rest, key))


def _fake_mut(mutated: list[torch.Tensor], rest: list[torch.Tensor], key: str) -> None:
    _stash(key, _fake(mutated, rest, key))


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
                schema="(Tensor[] mutated, Tensor[] rest, str key) -> Tensor[]",
            )
            functional.register_fake(_fake)
            mutating = torch.library.custom_op(
                "bcg::opaque_mut",
                _real_mut,
                mutates_args=("mutated",),
                schema="(Tensor(a!)[] mutated, Tensor[] rest, str key) -> ()",
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
    return _op  # type: ignore[no-any-return]
