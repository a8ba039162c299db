"""The divergence check: does replaying a captured breakable graph give what running eagerly gives?

A value read on the host and used inside a segment (a number from ``.item()``, a Python list of
sequence lengths) is frozen into the segment at capture, and every replay reuses it: silent wrong
output. This module captures a callable once, then for other inputs runs it eagerly and by replay
and compares, break call by break call, to name the first segment whose results differ.

How the two runs are observed: the eager run goes through the break decorator, which hands each
enabled break call to the observer set by ``_breaks.observe_breaks`` (one global read per break
call when no check runs); the replay is an instrumented walk over the graph's steps (the
ordinary ``replay()`` is untouched). Both record, per break call, its arguments after it ran
and the output that the code after it sees, plus the step's output and its arguments as the
step leaves them (a step may write its result into an argument); tensors are cloned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from bcg_core import _trees
from bcg_core._backends import (
    backend_for,
    backend_for_tensors,
    backend_named,
    record_source_locations,
)
from bcg_core._capture.breaks import observe_breaks
from bcg_core._capture.capture import internal_capture
from bcg_core._capture.context import active_capture
from bcg_core._capture.flag import (
    breakable_graphs_disabled,
    disabled_reason,
    enable_breakable_cuda_graph,
    flag_on,
    flag_reset,
)
from bcg_core._capture.graph import BreakableCUDAGraph, BreakStep, SegmentStep
from bcg_core._compare import bitwise_equal
from bcg_core._diagnostics.divergence_report import Cause, DivergenceReport, Status, TensorDiff
from bcg_core._diagnostics.step_state import StepStateWatch
from bcg_core._errors import BreakOutputError, CaptureError
from bcg_core._signature import (
    Signature,
    copy_unless_same,
    flatten_signature,
    signature_and_tensors,
    static_buffer,
    static_call,
)

Call = tuple[tuple[Any, ...], dict[str, Any]]
InputSet = Any  # a Call, a tuple of positional arguments, one argument, or a callable of those


@dataclass(frozen=True)
class _Values:
    """A frozen structure: its leaves (tensors cloned) and its spec."""

    leaves: list[Any]
    spec: _trees.TreeSpec


@dataclass(frozen=True)
class _BreakCall:
    name: str
    arguments: _Values  # after the call: see _eager
    outputs: _Values


@dataclass(frozen=True)
class _Run:
    calls: list[_BreakCall]
    output: _Values
    written: _Values  # the step's own arguments once it returned
    compared: bool = True  # False: no break call, no tensor returned, no argument written


@dataclass(frozen=True)
class _Finding:
    call: int  # index of the break call where it was seen; len(calls) for the step's output
    part: str  # "arguments", "outputs", "sequence", "output" or "written"
    name: str | None
    diffs: tuple[TensorDiff, ...]
    cause: Cause

    @property
    def order(self) -> tuple[int, int]:
        """Position in execution order: a break's arguments before its outputs, the step's
        output before the arguments it leaves written."""
        return self.call, 1 if self.part in ("outputs", "written") else 0

    def where(self) -> str:
        if self.part == "output":
            return "the step's output"
        if self.part == "written":
            return "the arguments the step wrote"
        return f"the {self.part} of break {self.name!r} (call {self.call + 1})"


_EAGER_VS_REPLAY = ("eager", "replay")
RAISED_IN = "bcg divergence check: raised in"  # the note on an exception from a run of fn
_EAGER_VS_EAGER = ("run 1", "run 2")


def check_divergence(
    fn: Callable[..., Any],
    inputs: Sequence[InputSet],
    *,
    backend: str | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    seed: int = 0,
) -> DivergenceReport:
    """Report the first graph segment whose replay differs from running ``fn`` eagerly.

    ``fn`` is captured with the first input set; for every other set it runs eagerly and by
    replay, and the two runs are compared.

    ``inputs``: two or more input sets. A set is ``(args_tuple, kwargs_dict)``, a tuple of
    positional arguments, a single non-tuple argument, or a zero-argument callable returning
    one of those (called before every run: use it when host metadata lives in an object that
    the engine updates in place). Tensors in containers (tuples, lists, dicts ...) are copied
    into static buffers made from set 0, which the capture reads and which every later set is
    copied into before its eager run and its replay, so both read identical memory: their
    shapes, dtypes and devices must match set 0's (else :class:`ValueError`, before anything
    runs). Every other value (Python numbers, lists, strings, objects and the tensors inside
    them) reaches the eager run as given; the replay cannot see it, since the graph holds what
    it saw at capture — which is the class of bug this check finds.

    Compared, in order, with ``atol``/``rtol`` (bitwise when both are 0, NaNs equal): the
    arguments of every enabled break call once it ran (state it updates, such as a KV cache,
    is compared as the call leaves it), the output the code after it sees
    (non-tensor outputs are frozen at capture), and ``fn``'s output. The first difference
    blames the segment that produced it (see :class:`DivergenceReport`); a difference that a
    segment writes only into state read by a later segment is blamed where it first reaches a
    break or the output. On the CPU backend the report lists the source lines of the segment's
    operations (recorded at capture; CUDA segments have none).

    Randomness: ``torch.manual_seed(seed)`` runs before each eager run and before each replay
    (a CUDA graph draws from the seed and offset current at replay; the CPU backend re-runs
    random ops from the same generator in eager order), and the caller's RNG state is restored
    afterwards. Each set runs eagerly twice; when the two eager runs differ the report says
    ``"nondeterministic"`` there instead of blaming the replay.

    ``backend``: "cpu" or "cuda"; None picks "cuda" when an input tensor is on a CUDA device.
    ``fn`` runs once to warm up and once under capture with set 0, then three times per other
    set (eager, eager, replay), all with the breakable-graph flag on: it must be repeatable
    (writing this step's cache slot is; incrementing a counter is not: Python attributes of
    the modules it calls and private generators that one eager run changes are reported as
    ``"stateful"``, naming them; tensor state such as a cache position is put back by a
    callable input set). The step's tensor arguments are compared too, as it leaves them, so a
    result written into an argument is checked. Cost: memory for one clone of every break
    call's arguments and outputs, and of the step's arguments, per run. Errors:
    :class:`TypeError` or :class:`ValueError` for bad arguments, and :class:`ValueError` when
    there is nothing to compare (no break call, no tensor returned, no argument written); a
    failed capture raises as in :class:`BreakableCUDAGraphCapture`; an exception from ``fn``
    carries a note saying in which run it was raised (the warm-up, the capture, an eager run
    or the replay, and of which input set); the graph is always released.

    Args:
        fn: the callable to check; it must be repeatable (see above).
        inputs: two or more input sets, in the forms above; set 0 is captured, every other set
            is compared.
        backend: ``"cpu"`` or ``"cuda"``, keyword only; None (the default) picks the backend of
            the input tensors.
        atol: absolute tolerance, >= 0 (default 0.0: bitwise with ``rtol=0``).
        rtol: relative tolerance, >= 0 (default 0.0).
        seed: the seed set before every eager run and every replay (default 0).

    Returns:
        A :class:`DivergenceReport`: ``status="ok"`` when every set matched, else the first
        set, segment and tensors that differed (or ``"nondeterministic"``, or ``"stateful"``).

    Raises:
        TypeError: ``fn`` is not callable, ``atol`` or ``rtol`` is not a number, ``seed`` is
            not an int, or ``inputs`` is a tensor, string or mapping instead of a list of
            input sets.
        ValueError: negative or NaN ``atol`` or ``rtol``, fewer than two input sets, an unknown
            ``backend``, an input set whose structure, shapes, dtypes or devices differ from
            set 0's, or nothing to compare (no break call, no tensor returned, no argument
            written).
        CaptureError: called inside a breakable capture or where breakable graphs are
            disabled (``BCG_DISABLE``, :func:`disable_breakable_graphs`), both before anything
            runs, or the capture fails as in :class:`BreakableCUDAGraphCapture`.
    """
    if not callable(fn):
        raise TypeError(f"check_divergence needs a callable, got {fn!r}")
    for label, tolerance in (("atol", atol), ("rtol", rtol)):
        if not isinstance(tolerance, (int, float)):
            raise TypeError(f"check_divergence's {label} must be a number, got {tolerance!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        # torch.manual_seed failed on it only after the warm-up and capture had run.
        raise TypeError(f"check_divergence's seed must be an int, got {seed!r}")
    if not (atol >= 0 and rtol >= 0):  # NaN too: torch.isclose refused it after the capture
        raise ValueError(f"atol and rtol must be >= 0, got atol={atol}, rtol={rtol}")
    if isinstance(inputs, (torch.Tensor, str, bytes, Mapping)):
        # list() of a tensor is its rows: fn would be checked on rows, and say "ok".
        raise TypeError(
            "check_divergence's inputs is a list of input sets (two or more, the first one "
            f"captured), got a {type(inputs).__name__}: pass [x0, x1], or [(x0, m0), (x1, m1)] "
            "for several arguments"
        )
    sets = list(inputs)
    if len(sets) < 2:
        raise ValueError(
            f"check_divergence needs at least two input sets (one to capture with, one or more "
            f"to compare), got {len(sets)}"
        )
    if active_capture() is not None:
        raise CaptureError("check_divergence() cannot run inside a breakable capture")
    if breakable_graphs_disabled():
        # Else fn ran its warm-up, then the capture refused with a logged hint to set the very
        # BCG_DISABLE=1 that refused it.
        raise CaptureError(
            f"check_divergence() needs to capture, but breakable graphs are disabled "
            f"({disabled_reason()}); run the check without BCG_DISABLE (or outside "
            "disable_breakable_graphs())"
        )
    first = _resolve(sets[0])
    name = _pick_backend(backend, first)
    sig0, _ = signature_and_tensors(*first)
    for i, entry in enumerate(sets[1:], start=1):
        if not callable(entry):
            _check_same_shapes(sig0, _resolve(entry), i)
    statics: list[torch.Tensor] = []

    def make_static(t: torch.Tensor) -> torch.Tensor:
        statics.append(static_buffer(t, t.device))
        return statics[-1]

    static_args, static_kwargs = static_call(*first, make_static)
    graph = BreakableCUDAGraph(backend=name)
    # Static buffers are memory the graph re-reads at every replay, as the runner's are.
    backend_for(name).note_graph_memory(graph.pool(), statics)
    with _restored_rng():
        try:
            output = _capture(graph, fn, static_args, static_kwargs)

            def loader(entry: InputSet, i: int) -> Callable[[], Call]:
                def load() -> Call:
                    with _phase(f"loading input set {i}"):
                        call = _resolve(entry)
                    live = _check_same_shapes(sig0, call, i)
                    copy_unless_same(statics, live)
                    fill = iter(statics)
                    return static_call(*call, lambda _: next(fill))

                return load

            for i, entry in enumerate(sets[1:], start=1):
                report = compare_eager_and_replay(
                    fn, graph, output, loader(entry, i), atol=atol, rtol=rtol, seed=seed,
                    input_set=i, input_sets=len(sets),
                )  # fmt: skip
                if not report.ok:
                    return report
            return report
        finally:
            graph.reset()


def compare_eager_and_replay(
    fn: Callable[..., Any],
    graph: BreakableCUDAGraph,
    output: Any,
    load: Callable[[], Call],
    *,
    replay_context: Callable[[], AbstractContextManager[Any]] | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    seed: int = 0,
    input_set: int = 1,
    input_sets: int = 2,
) -> DivergenceReport:
    """One comparison on a captured ``graph``: ``load()`` copies the inputs into the graph's
    static buffers and returns the call for the eager runs; ``output`` is the capture-time
    output, which the replay refreshes. Runs eager twice and the replay once, each after
    ``torch.manual_seed(seed)`` (the caller restores the RNG state), and reports as
    :func:`check_divergence` does."""
    if not graph.is_captured:
        raise ValueError("the graph holds no capture; capture it before checking divergence")
    ok = DivergenceReport("ok", graph.backend, input_sets, graph.num_segments, graph.num_breaks)
    watch = StepStateWatch(fn)
    with watch.watching():
        first = _eager(fn, load(), seed, f"eager run 1 of input set {input_set}")
    changes = watch.changes()
    if changes:
        generator = any(c.kind == "generator" for c in changes)
        diffs = tuple(
            TensorDiff(c.where, None, None, "a private generator, advanced by the step")
            if c.kind == "generator"
            else TensorDiff(c.where, None, None, f"{c.before} before, {c.after} after")
            for c in changes
        )
        return dataclasses.replace(
            ok,
            status="stateful",
            input_set=input_set,
            observed_at=", ".join(c.where for c in changes),
            cause="private_generator" if generator else "step_attribute",
            diffs=diffs,
        )
    if not first.compared:
        raise ValueError(
            "check_divergence has nothing to compare: the step made no break call, returned no "
            "tensor and wrote none of its tensor arguments, so eager and replay would be equal "
            "whatever the graph does. Return the tensors the step computes (or write them into "
            "an argument)"
        )
    second = _eager(fn, load(), seed, f"eager run 2 of input set {input_set}")
    static = load()
    with _phase(f"the replay of input set {input_set}"):
        replayed = _replay(graph, output, static, seed, replay_context)
    found = _first_difference(first, second, atol, rtol, _EAGER_VS_EAGER)
    status: Status = "nondeterministic"
    if found is None:
        found = _first_difference(first, replayed, atol, rtol, _EAGER_VS_REPLAY)
        status = "diverged"
    if found is None:
        return ok
    where = found.where()
    if status == "diverged" and (atol or rtol):
        # Blame where the replay first differs at all, not where the difference has grown
        # past the tolerance (a break can amplify it), unless eager differs from itself there.
        origin = _first_difference(first, replayed, 0.0, 0.0, _EAGER_VS_REPLAY)
        noise = _first_difference(first, second, 0.0, 0.0, _EAGER_VS_EAGER)
        if (
            origin is not None
            and origin.order < found.order
            and (noise is None or noise.order > origin.order)
        ):
            where = f"{origin.where()} (within atol/rtol there; beyond them at {where})"
            found = origin
    segment, before, after = _blame(found, list(graph.break_names))
    return dataclasses.replace(
        ok,
        status=status,
        input_set=input_set,
        observed_at=where,
        segment=segment,
        break_before=before,
        break_after=after,
        cause=found.cause,
        diffs=found.diffs,
        source_lines=_source_lines(graph, segment),
    )


# -- the runs ------------------------------------------------------------------------------------


def _capture(
    graph: BreakableCUDAGraph, fn: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]
) -> Any:
    """Warm up once on a side stream (library handles, lazy state), then capture after it on
    the pool's capture lane, as the runner does; CPU segments record their source lines."""
    backend = backend_for(graph.backend)
    side = backend.new_stream()
    side.wait_stream(backend.current_stream())
    with backend.stream_context(side), _phase("the warm-up (an eager run) of input set 0"):
        token = flag_on()  # an eager run: no capture-failure hint if it raises
        try:
            fn(*args, **kw)
        finally:
            flag_reset(token)
    backend.current_stream().wait_stream(side)
    with (
        _phase("the capture of input set 0"),
        backend.stream_context(side),
        record_source_locations(),
        enable_breakable_cuda_graph(),
        internal_capture(graph),
    ):
        output = fn(*args, **kw)
    # Breaks ran for real at capture (the side stream waits for them); eager runs on the
    # current stream.
    backend.current_stream().wait_stream(side)
    return output


@contextlib.contextmanager
def _phase(what: str) -> Iterator[None]:
    """Say in which run of the check an exception was raised."""
    try:
        yield
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"{RAISED_IN} {what}")
        raise


def _versions(call: Call) -> list[int | None]:
    versions: list[int | None] = []
    for t in _trees.tensor_leaves(call):
        try:
            versions.append(t._version)
        except RuntimeError:  # an inference tensor keeps no version: count it as written
            versions.append(None)
    return versions


def _eager(fn: Callable[..., Any], call: Call, seed: int, what: str) -> _Run:
    """Run ``fn`` eagerly, recording each break call's arguments *after* it ran and its output.

    After, not before: a break's arguments often include state that it updates (a KV cache),
    which before the call still holds what the previous run wrote; a repeatable step leaves the
    same state behind in every run, whatever it started from."""
    calls: list[_BreakCall] = []

    def observe(
        name: str, f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        with observe_breaks(None):  # breaks nested in a break are part of it, as at replay
            out = f(*args, **kwargs)
        calls.append(_BreakCall(name, _freeze((args, kwargs)), _freeze(out)))
        return out

    before = _versions(call)
    torch.manual_seed(seed)
    with _phase(what), observe_breaks(observe):
        token = flag_on()  # an eager run: no capture-failure hint if it raises
        try:
            out = fn(*call[0], **call[1])
        finally:
            flag_reset(token)
    output = _freeze(out)
    wrote = any(v is None or v != w for v, w in zip(before, _versions(call), strict=True))
    compared = bool(calls) or wrote or any(isinstance(x, torch.Tensor) for x in output.leaves)
    return _Run(calls, output, _freeze(call), compared)


def _replay(
    graph: BreakableCUDAGraph,
    output: Any,
    call: Call,
    seed: int,
    replay_context: Callable[[], AbstractContextManager[Any]] | None,
) -> _Run:
    """``graph.replay()`` step by step, recording each break call as :func:`_eager` does;
    ``call`` is the static call, whose arguments the replay leaves written."""
    calls: list[_BreakCall] = []
    torch.manual_seed(seed)
    with replay_context() if replay_context is not None else contextlib.nullcontext():
        for step in graph._steps:  # the steps replay() launches, in order
            if isinstance(step, SegmentStep):
                step.segment.launcher()()
                continue
            fresh: list[Any] = []
            try:
                dataclasses.replace(step, fn=_recording(step.fn, fresh)).run()
                outputs = _freeze(step.bridge.output)
            except BreakOutputError:
                # A changed plain value or structure: replay on with what the code after the
                # break was captured with, so that the comparison names this break's outputs.
                outputs = _refused_output(step.bridge.output, fresh)
            arguments = _freeze((step.args, step.kwargs))
            calls.append(_BreakCall(step.name, arguments, outputs))
    return _Run(calls, _freeze(output), _freeze(call))


def _recording(fn: Callable[..., Any], into: list[Any]) -> Callable[..., Any]:
    """``fn``, appending each of its results to ``into``."""

    def recorded(*args: Any, **kwargs: Any) -> Any:
        into.append(fn(*args, **kwargs))
        return into[-1]

    return recorded


def _refused_output(captured: Any, fresh: list[Any]) -> _Values:
    """What the code after a break sees once its bridge refused the break's output: the
    capture's plain values, and the break's own tensors where the structure is the same (the
    refusal came before their copy: the stale capture-time tensors were reported as a tensor
    difference the break never made)."""
    frozen = _freeze(captured)
    if not fresh:
        return frozen
    new = _freeze(fresh[-1])
    if new.spec != frozen.spec:
        return frozen
    leaves = [
        n if isinstance(n, torch.Tensor) and isinstance(o, torch.Tensor) else o
        for o, n in zip(frozen.leaves, new.leaves, strict=True)
    ]
    return _Values(leaves, frozen.spec)


# -- comparing -----------------------------------------------------------------------------------


def _freeze(obj: Any) -> _Values:
    leaves, spec = _trees.flatten(obj)
    return _Values([x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def _first_difference(
    a: _Run, b: _Run, atol: float, rtol: float, labels: tuple[str, str]
) -> _Finding | None:
    """The first value, in execution order, where runs ``a`` and ``b`` differ (``labels``
    name them in the diffs' text)."""
    la, lb = labels
    for j, (x, y) in enumerate(zip(a.calls, b.calls, strict=False)):
        if x.name != y.name:
            diff = TensorDiff(
                f"break call {j + 1}", None, None, f"{la} called {x.name!r}, {lb} {y.name!r}"
            )
            return _Finding(j, "sequence", x.name, (diff,), "break_sequence")
        diffs = _compare(x.arguments, y.arguments, atol, rtol, labels, call_paths=True)
        if diffs:
            frozen = any(d.shape is None for d in diffs)
            cause: Cause = "frozen_break_argument" if frozen else "baked_in_segment"
            return _Finding(j, "arguments", x.name, diffs, cause)
        diffs = _compare(x.outputs, y.outputs, atol, rtol, labels)
        if diffs:
            frozen = any(d.shape is None for d in diffs)
            return _Finding(
                j, "outputs", x.name, diffs, "frozen_break_output" if frozen else "break_itself"
            )
    if len(a.calls) != len(b.calls):
        j = min(len(a.calls), len(b.calls))
        diff = TensorDiff(
            "break calls", None, None,
            f"{la} made {len(a.calls)} break calls, {lb} {len(b.calls)}",
        )  # fmt: skip
        name = a.calls[j].name if j < len(a.calls) else b.calls[j].name
        return _Finding(j, "sequence", name, (diff,), "break_sequence")
    diffs = _compare(a.output, b.output, atol, rtol, labels)
    if diffs:
        return _Finding(len(a.calls), "output", None, diffs, "baked_in_segment")
    diffs = _compare(a.written, b.written, atol, rtol, labels, call_paths=True)
    if diffs:
        return _Finding(len(a.calls), "written", None, diffs, "baked_in_segment")
    return None


def _blame(found: _Finding, names: list[str]) -> tuple[int | None, str | None, str | None]:
    """(segment numbered from 1, break before it, break after it) for a finding."""

    def name(j: int) -> str | None:
        return names[j] if 0 <= j < len(names) else None

    if found.cause == "break_itself":
        return None, None, found.name
    # Arguments of call j (or the output, j == len(names)) come from the segment before it; a
    # frozen output of call j is used by the segment after it.
    j = found.call + 1 if found.part == "outputs" else found.call
    return j + 1, name(j - 1), name(j)


def _compare(
    a: _Values,
    b: _Values,
    atol: float,
    rtol: float,
    labels: tuple[str, str],
    call_paths: bool = False,
) -> tuple[TensorDiff, ...]:
    root = "" if call_paths else "output"
    paths = [_call_path(p) if call_paths else p for p in _trees.key_paths(a.spec, root)]
    if a.spec != b.spec:
        if not _trees.same_up_to_key_order(b.spec, a.spec):
            where = str(_trees.difference(b.spec, a.spec, root=root))
            where = _call_path(where) if call_paths else where
            return (TensorDiff("structure", None, None, f"at {labels[1]} {where} in {labels[0]}"),)
        by_path = dict(zip(_trees.key_paths(b.spec, root), b.leaves, strict=True))
        other = [by_path[p] for p in _trees.key_paths(a.spec, root)]
    else:
        other = b.leaves
    diffs = []
    for path, x, y in zip(paths, a.leaves, other, strict=True):
        diff = _leaf_diff(path, x, y, atol, rtol, labels)
        if diff is not None:
            diffs.append(diff)
    return tuple(diffs)


def _call_path(path: str) -> str:
    # A break's arguments are walked as (args, kwargs): "[0][1]" is args[1], "[1]['m']" kwargs.
    return ("args" if path.startswith("[0]") else "kwargs") + path[3:]


def _leaf_diff(
    path: str, x: Any, y: Any, atol: float, rtol: float, labels: tuple[str, str]
) -> TensorDiff | None:
    la, lb = labels
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        shape = tuple(x.shape)
        if x.shape != y.shape or x.dtype != y.dtype:
            what = f"{la} {list(x.shape)} {x.dtype}, {lb} {list(y.shape)} {y.dtype}"
            return TensorDiff(path, shape, None, what)
        worst = _tensor_diff(x, y.to(x.device), atol, rtol)
        if worst is None:
            return None
        return TensorDiff(path, shape, worst, f"max |{la} - {lb}| = {worst:.4g}")
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return TensorDiff(path, None, None, f"{la} {_short(x)}, {lb} {_short(y)}")
    if _same_value(x, y):
        return None
    frozen = " (frozen at capture)" if lb == "replay" else ""
    return TensorDiff(path, None, None, f"{la} {_short(x)}, {lb} {_short(y)}{frozen}")


def _same_value(x: Any, y: Any, pending: set[tuple[int, int]] | None = None) -> bool:
    if x is y:
        return True
    if isinstance(x, types.FunctionType) and isinstance(y, types.FunctionType):
        # A closure made anew at every call (transformers' mask predicates, and_masks(...))
        # is the same argument when its code and captured values are: by identity, two eager
        # runs of one input set differed and the check never judged the replay.
        pending = set() if pending is None else pending
        if (id(x), id(y)) in pending:
            return True  # a function reached again through its own closure (recursion)
        pending.add((id(x), id(y)))
        return x.__code__ is y.__code__ and _same_parts(
            (x.__defaults__, x.__kwdefaults__, *_cells(x)),
            (y.__defaults__, y.__kwdefaults__, *_cells(y)),
            pending,
        )
    if type(x) in (tuple, list) and type(y) is type(x):
        return len(x) == len(y) and _same_parts(x, y, pending)
    try:
        equal = x == y
        if not isinstance(equal, bool) and getattr(equal, "ndim", None) == 0:
            equal = bool(equal)  # numpy scalars (a break's np.float64) compare to np.bool_
        if isinstance(equal, bool):
            return equal or (_is_nan(x) and _is_nan(y))
    except Exception:
        pass
    return True  # values that cannot be compared (arrays, custom objects) are not judged


def _same_parts(x: Sequence[Any], y: Sequence[Any], pending: set[tuple[int, int]] | None) -> bool:
    return all(_same_value(a, b, pending) for a, b in zip(x, y, strict=True))


def _cells(fn: types.FunctionType) -> list[Any]:
    """The values a function's closure holds (an empty cell as a marker of its own)."""
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:
            values.append(_EMPTY_CELL)
    return values


_EMPTY_CELL = object()


def _is_nan(value: Any) -> bool:
    if not (isinstance(value, float) or getattr(value, "ndim", None) == 0):
        return False
    try:
        return bool(value != value)
    except Exception:
        return False


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _tensor_diff(x: torch.Tensor, y: torch.Tensor, atol: float, rtol: float) -> float | None:
    """None when ``x`` and ``y`` (same shape and dtype) are equal — bitwise when atol and rtol
    are 0, else within ``atol + rtol * |x|`` (NaNs equal) — else max |x - y|."""
    if atol == 0 and rtol == 0 and bitwise_equal(x, y):
        return None
    was_complex = x.is_complex()
    if was_complex:
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    if x.dtype is torch.bool:
        x, y = x.to(torch.uint8), y.to(torch.uint8)
    if (atol or rtol) and bool(torch.isclose(y, x, rtol=rtol, atol=atol, equal_nan=True).all()):
        return None
    if not x.is_floating_point():
        # Integers exactly: a double drops the low bits of a large int64 (2**60 + 4 against
        # 2**60 + 2 was "max |eager - replay| = 0").
        exact = (x.long() - y.long()).abs()
        return float(exact.max()) if exact.numel() else 0.0
    xd, yd = x.double(), y.double()
    nan_x, nan_y = torch.isnan(xd), torch.isnan(yd)
    # Equal values differ by 0 (an infinity on both sides too, where x - y is NaN), a NaN on
    # one side only by inf; nan_to_num made an infinite gap the largest float.
    gap = torch.where((xd == yd) | (nan_x & nan_y), 0.0, (xd - yd).abs())
    gap = torch.where(nan_x ^ nan_y, math.inf, gap)
    if was_complex:  # |eager - replay| of complex values, not of their parts one by one
        gap = torch.hypot(gap[..., 0], gap[..., 1])
    return float(gap.max()) if gap.numel() else 0.0


# -- inputs --------------------------------------------------------------------------------------


def _resolve(entry: InputSet) -> Call:
    value = entry() if callable(entry) else entry
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], tuple)
        and isinstance(value[1], dict)
    ):
        return value[0], dict(value[1])
    if isinstance(value, tuple):
        return value, {}
    return (value,), {}


def _pick_backend(backend: str | None, call: Call) -> str:
    if backend is None:
        return backend_for_tensors(_trees.tensor_leaves(call)).name
    return backend_named(backend).name


def _check_same_shapes(sig0: Signature, call: Call, index: int) -> list[torch.Tensor]:
    """The call's tensors in static-buffer order; ValueError if they cannot be copied into set
    0's buffers (another structure, or another shape, dtype or device)."""
    sig, live = signature_and_tensors(*call)
    if sig[0] != sig0[0]:
        where = _trees.difference(sig[0], sig0[0], root="call")
        raise ValueError(
            f"input set {index} has another structure than set 0 ({where} in set 0); every "
            "set must have the same arguments, containers and keys"
        )
    mine, base = flatten_signature(sig), flatten_signature(sig0)
    for path, key in mine.items():
        if key[0] == "tensor" and key[:4] != base[path][:4]:  # any layout copies in
            raise ValueError(
                f"input set {index}: {path} is a tensor {list(key[1])} {key[2]} on {key[3]} but "
                f"{list(base[path][1])} {base[path][2]} on {base[path][3]} in set 0. The check "
                "copies every set into set 0's static buffers, so shapes, dtypes and devices "
                "must match: check each shape with its own input sets"
            )
    return live


def _restored_rng() -> AbstractContextManager[Any]:
    # manual_seed reseeds every initialised CUDA device: restore them all afterwards.
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
    return torch.random.fork_rng(devices=devices)


def _source_lines(graph: BreakableCUDAGraph, segment: int | None) -> tuple[str, ...]:
    """The distinct user source lines of graph segment ``segment`` (CPU backend only)."""
    if segment is None:
        return ()
    return tuple(dict.fromkeys(loc for seg in _segments_of(graph, segment) for loc in _locs(seg)))


def _segments_of(graph: BreakableCUDAGraph, segment: int) -> Iterator[Any]:
    number = 1
    for step in graph._steps:
        if isinstance(step, BreakStep):
            number += 1
        elif number == segment:
            yield step.segment


def _locs(segment: Any) -> tuple[str, ...]:
    # Only CPU segments record locations (inside record_source_locations()).
    found: tuple[str, ...] = getattr(segment, "source_locations", ())
    return found


def runner_divergence(
    module: Callable[..., Any],
    graph: BreakableCUDAGraph,
    output: Any,
    load: Callable[[], Call],
    replay_context: Callable[[], AbstractContextManager[Any]] | None,
) -> DivergenceReport:
    """:meth:`BreakableGraphRunner.check_divergence` on one entry: its graph and capture-time
    output, and ``load()``, which writes the call's inputs into the entry's static buffers and
    returns the static call."""
    with _restored_rng():
        return compare_eager_and_replay(module, graph, output, load, replay_context=replay_context)
