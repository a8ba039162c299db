"""Break points: the decorator that marks eager functions, and the explicit split."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar, overload

import torch

from bcg_core._capture import opaque
from bcg_core._capture.context import active_capture, outside_pool, warmup_outside_pool
from bcg_core._capture.flag import is_in_breakable_cuda_graph

F = TypeVar("F", bound=Callable[..., Any])

_is_compiling = torch.compiler.is_compiling


# -- the break observer of the divergence check (_divergence.py) -------------------------------
BreakObserver = Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
_OBSERVER: ContextVar[BreakObserver | None] = ContextVar("bcg_break_observer", default=None)
_observer_lock = threading.Lock()
_observing = 0  # observe_breaks() blocks open in any context; the eager path reads only this


@contextlib.contextmanager
def observe_breaks(observer: BreakObserver | None) -> Iterator[None]:
    """In this block (this context only), an enabled break called outside a capture is handed
    to ``observer(name, fn, args, kwargs)``, which must call ``fn`` and return its result;
    ``None`` calls through (for breaks nested in an observed one). Refcounted, so a break
    costs one global read when no block is open anywhere."""
    global _observing
    with _observer_lock:
        _observing += 1
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)
        with _observer_lock:
            _observing -= 1


def breaks_observed() -> bool:
    """Whether an observer (the divergence check's eager run) sees this context's break calls:
    adapters whose eager path skips their break (transformers' sdpa kernel op) take the break
    path then, so eager makes the break calls a replay makes."""
    return bool(_observing) and _OBSERVER.get() is not None


# The function and the options in one call (``eager_on_graph(fn, name="x")``) is supported
# as well as the two decorator forms, and typed as such (no cast needed).
@overload
def eager_on_graph(
    fn: F,
    /,
    *,
    enable: bool = True,
    capture_stub: Callable[..., Any] | None = None,
    strict: bool = False,
    name: str | None = None,
    gated: bool = False,
) -> F: ...


@overload
def eager_on_graph(
    fn: None = None,
    /,
    *,
    enable: bool = True,
    capture_stub: Callable[..., Any] | None = None,
    strict: bool = False,
    name: str | None = None,
    gated: bool = False,
) -> Callable[[F], F]: ...


def eager_on_graph(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    enable: bool = True,
    capture_stub: Callable[..., Any] | None = None,
    strict: bool = False,
    name: str | None = None,
    gated: bool = False,
) -> Any:
    """Mark a function (or method) as a break point of breakable CUDA graphs.

    During a breakable capture a call ends the current graph segment, runs eagerly (the
    ``capture_stub`` instead, if given, with the same arguments), and the next segment starts.
    At every replay the real function runs again on the tensors it saw at capture (held as
    non-owning aliases: the caller keeps static inputs alive) and its returned tensors are copied
    into the ones returned at capture, which the next segment reads. Return values must keep the
    same structure, shapes and dtypes; non-tensor values are frozen at capture (a ``None``,
    bool, number or string that comes back different at a replay raises). With
    ``strict=True`` returning a CUDA tensor fails at capture: write into an argument buffer.

    Outside a capture, inside another break, or with ``enable=False`` the function is simply
    called. With ``gated=True`` it is a break only while :func:`is_in_breakable_cuda_graph` is
    true, and otherwise simply called (the flag is read when the call runs, also in compiled
    code: adapters that patch model code use this).

    Inside a ``torch.compile``d function a break stays a break without breaking dynamo's graph:
    a call whose arguments are tensors, numbers, strings, dtypes and devices in lists, tuples and
    dicts is one opaque op (``bcg::opaque``) that inductor cannot see into or move work across,
    and that runs this wrapper eagerly at run time, so a capture around the compiled call
    records the break (``fullgraph=True`` works). To know the outputs, the compiler runs the
    ``capture_stub`` (else the function) once on fake tensors; non-tensor return values are
    frozen then (checked at every run like a replay's). A call with other arguments (a module,
    a plain object) makes dynamo graph-break there and call the wrapper eagerly. Tensors the
    break writes must be among its arguments: the compiler orders the code around the op by
    those alone. Usable bare (``@eager_on_graph``) or configured
    (``@eager_on_graph(strict=True)``); the wrapper keeps name and docstring. Above or below
    ``@staticmethod``/``@classmethod`` alike, the method keeps its kind.

    Args:
        fn: the function to mark (bare use, or ``eager_on_graph(fn, name=...)`` with the
            keyword arguments); None (the default) returns a decorator configured by them.
        enable: False makes the wrapper a plain call, never a break (default True).
        capture_stub: a callable run at capture instead of ``fn``, with the same arguments,
            whose return value stands for ``fn``'s (same structure, shapes and dtypes); replays
            run ``fn``. Default None: ``fn`` itself runs at capture.
        strict: True raises :class:`BreakOutputError` at capture when the break returns a
            device tensor, for breaks meant to write into argument buffers (default False:
            returned tensors are copied into bridge buffers at every replay).
        name: the break's name in ``break_names``, logs and error messages (default: the
            function's ``__qualname__``; an op of ``torch.ops`` as torch prints it, such as
            ``aten.cumsum.default``).
        gated: True makes the call a break only while the flag (``is_in_breakable_cuda_graph``)
            is on, read when the call runs, so adapters need no flag read in code that
            ``torch.compile`` traces (default False: a break whenever a capture is active).

    Returns:
        The wrapped function (bare use), or a decorator that wraps one.

    Raises:
        TypeError: ``enable``, ``strict`` or ``gated`` is not a bool, ``name`` is not a
            non-empty str, ``capture_stub`` or the decorated object is not callable, or either is a
            coroutine function (``async def``), an async generator function or a
            generator function: its body would not run in the break (make it a plain function
            that returns its value).
        BreakOutputError: at capture, ``strict=True`` and a device tensor was returned (at
            replay, :meth:`BreakableCUDAGraph.replay` raises it when the returned structure,
            shapes, dtypes or plain values differ from capture's).
    """
    for option, value in (("enable", enable), ("strict", strict), ("gated", gated)):
        if not isinstance(value, bool):
            # a truthy string such as "false" would silently mean True
            raise TypeError(f"eager_on_graph's {option} must be a bool, got {value!r}")
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError(f"eager_on_graph's name must be a non-empty str or None, got {name!r}")
    if capture_stub is not None and not callable(capture_stub):
        raise TypeError(f"capture_stub must be callable, got {capture_stub!r}")
    if capture_stub is not None:
        stub_name = getattr(capture_stub, "__qualname__", None) or repr(capture_stub)
        _refuse_lazy_body(capture_stub, f"eager_on_graph's capture_stub {stub_name}")

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        if isinstance(f, (staticmethod, classmethod)):
            # Applied over @staticmethod/@classmethod: wrap the function and keep the kind (a
            # plain wrapper in the class would bind the instance as the first argument).
            # (Through eager_on_graph, not decorate itself: a closure holding itself is a cycle.)
            again = eager_on_graph(
                enable=enable, capture_stub=capture_stub, strict=strict, name=name, gated=gated
            )
            return type(f)(again(f.__func__))
        if not callable(f):
            raise TypeError(f"@eager_on_graph decorates a callable, got {f!r}")
        break_name: str = name or _default_name(f)
        _refuse_lazy_body(f, f"@eager_on_graph {break_name}")

        def call_eagerly(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if _observing:
                observe = _OBSERVER.get()
                if observe is not None:
                    return observe(break_name, f, args, kwargs)
            return f(*args, **kwargs)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _is_compiling():  # dynamo folds this to True while tracing; False at run time
                if not enable:
                    return f(*args, **kwargs)
                reason = opaque.untraceable(opaque_id, args, kwargs)
                if reason is None:
                    return opaque.call(opaque_id, args, kwargs)
                import torch._dynamo  # imported already: dynamo is tracing this

                # Alone, the graph break at graph_broken made fullgraph=True fail with dynamo's
                # "function marked as skipped", hinting to trace into it; this one says why.
                why = f"bcg: break {break_name}{opaque.UNTRACEABLE}{reason}"
                torch._dynamo.graph_break(msg=why)
                return graph_broken(*args, **kwargs)
            return run(*args, **kwargs)

        # The break at run time, apart from the wrapper: graph_broken wraps this, not the
        # wrapper, which holds graph_broken (a cycle kept every dropped break's function, and
        # what its closure holds, a model or tensors, for the garbage collector). It carries
        # the function's name: dynamo's graph-break and fullgraph errors name it.
        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            if gated and not is_in_breakable_cuda_graph():
                return f(*args, **kwargs)
            state = active_capture()
            if state is None:
                if not enable:
                    return f(*args, **kwargs)
                outside = warmup_outside_pool()
                if outside is not None:  # a warm-up's break: its temporaries are not pool memory
                    with outside_pool(outside):
                        return call_eagerly(args, kwargs)
                return call_eagerly(args, kwargs)
            if state.in_break or not enable:
                return f(*args, **kwargs)
            record = _record_undynamo if "torch._dynamo" in sys.modules else _record
            return record(state, f, capture_stub, strict, break_name, args, kwargs)

        # The opaque op's real implementation is the wrapper itself (run, not compiling then).
        opaque_id = opaque.register(wrapper, capture_stub or f, break_name, weak=True)
        # Dynamo graph-breaks at a dynamo-disabled function and calls it eagerly at run time.
        # (torch's lazy form of torch.compiler.disable: importing dynamo up front would cost
        # every process ~1 s.)
        graph_broken = torch._disable_dynamo(run, recursive=True)  # type: ignore[attr-defined]
        return wrapper

    return decorate if fn is None else decorate(fn)


def _default_name(f: Callable[..., Any]) -> str:
    """A break's name when none is given: the function's ``__qualname__``. An op of
    ``torch.ops`` is named as torch prints it (``aten.cumsum``, ``aten.cumsum.default``): a
    packet's ``__qualname__`` is pybind11's internal class name, an overload's drops the
    overload."""
    if isinstance(f, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(f)
    return getattr(f, "__qualname__", None) or repr(f)


def _lazy_kind(f: Callable[..., Any]) -> str | None:
    """What ``f`` returns instead of running its body when called, or None for a plain
    function: a coroutine, an async generator or a generator (a callable object is judged by
    its ``__call__``)."""
    while isinstance(f, functools.partial):
        f = f.func  # inspect sees through a partial of a function, not of a callable object
    candidates = [f]
    if not inspect.isroutine(f):
        candidates.append(type(f).__call__)  # f is callable, so its type has __call__
    for candidate in candidates:
        if inspect.iscoroutinefunction(candidate):
            return "an async def function (its body runs only when the coroutine is awaited)"
        if inspect.isasyncgenfunction(candidate):
            return "an async generator function (its body runs only when it is iterated)"
        if inspect.isgeneratorfunction(candidate):
            return "a generator function (its body runs only when the generator is iterated)"
    return None


def _refuse_lazy_body(f: Callable[..., Any], subject: str) -> None:
    """A break runs its function's body between segments; a coroutine or generator function
    would only create an object there, with nothing of the body run (and replays would make
    coroutines never awaited). Refused when decorated."""
    kind = _lazy_kind(f)
    if kind is not None:
        raise TypeError(
            f"{subject} is {kind}, so a break would run none of its work: make it a plain "
            "function (def, no await or yield) that does the work and returns its value, and "
            "await or iterate outside it"
        )


def _record(state: Any, *call: Any) -> Any:
    return state.record_break(*call)


def _split_state(state: Any) -> None:
    state.split()


def _split() -> None:
    state = active_capture()
    if state is not None:
        (_split_undynamo if "torch._dynamo" in sys.modules else _split_state)(state)


# The capture's own work at a break or split (segments ended and begun, the break run and
# bridged) runs without dynamo. Under the CPU backend's recorder dynamo skips a compiled
# function's frame, but it compiled the frames entered where the recorder is off (bcg's own and
# a break's body, unlike at replay) and deferred their side effects: a break calling a break
# found the capture not yet marked in a break and failed an internal assertion. (Chosen only
# once dynamo is imported: before, nothing compiles, and torch's wrapper would import it.)
_record_undynamo = torch._disable_dynamo(_record, recursive=True)  # type: ignore[attr-defined]
_split_undynamo = torch._disable_dynamo(_split_state, recursive=True)  # type: ignore[attr-defined]
_compiled_split = torch._disable_dynamo(  # type: ignore[attr-defined]
    _split, recursive=True
)


def break_graph() -> None:
    """Split the current graph segment here, with no eager work; a no-op outside a capture.

    The segment before and the one after replay in order, as around an :func:`eager_on_graph`
    break that does nothing. Inside a ``torch.compile``d function dynamo graph-breaks here, and
    the split happens; ``fullgraph=True`` therefore refuses it, with an error saying so.
    """
    if _is_compiling():
        import torch._dynamo  # imported already: dynamo is tracing this

        # The graph break below alone made fullgraph=True fail with dynamo's "function marked
        # as skipped", naming bcg's `_split` and hinting to trace into it; this one says why.
        # (In the default mode it is one more, empty, graph break at the same place.)
        torch._dynamo.graph_break(msg=_SPLIT_UNDER_COMPILE)
        _compiled_split()
    else:
        _split()


_SPLIT_UNDER_COMPILE = (
    "bcg: break_graph() is a dynamo graph break under torch.compile (the split is no op the "
    "compiler could keep in place), which fullgraph=True refuses: compile without "
    "fullgraph=True, or split at an @eager_on_graph break taking a tensor (one opaque op, "
    "which fullgraph=True keeps)"
)
