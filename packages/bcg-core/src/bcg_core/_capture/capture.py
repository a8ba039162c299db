"""BreakableCUDAGraphCapture: the context manager that captures a forward into segments."""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from types import TracebackType
from typing import Any

import torch

from bcg_core._backends import CaptureStatus, GraphBackend, Segment
from bcg_core._capture import owned
from bcg_core._capture.aliases import (
    alias_tree,
    argument_layouts,
    refuse_changed_arguments,
    refuse_iterators,
)
from bcg_core._capture.bridges import Bridge, contains_device_tensor, copy_into_pool
from bcg_core._capture.compiles import as_capture_error, compiles_refused
from bcg_core._capture.context import (
    active_capture,
    captures_on_other_threads,
    enter_capture,
    exit_capture,
)
from bcg_core._capture.debug import DebugLevel, argument_tensors, debug_level, report_leaks
from bcg_core._capture.flag import breakable_graphs_disabled, disabled_reason
from bcg_core._capture.fresh import FreshTensorTracker
from bcg_core._capture.gc_pause import gc_paused
from bcg_core._capture.graph import BreakableCUDAGraph, BreakStep, SegmentStep, Step
from bcg_core._capture.modes import current_modes
from bcg_core._capture.streams import StreamTracker, stream_hooks
from bcg_core._errors import (
    BreakOutputError,
    CaptureError,
    ConcurrentCaptureError,
    UnjoinedStreamError,
    capture_refusal_hint,
)

logger = logging.getLogger("bcg_core")

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


def _warn_empty(backend: str) -> None:
    # torch warns when a whole graph is empty ("The CUDA Graph is empty"; bcg silences that for
    # each empty segment, which adjacent breaks make): a replay then does nothing, silently.
    warnings.warn(
        f"bcg: the breakable capture recorded no graph work and no break, so replay() will do "
        f"nothing. Was the captured code run on another device than the graph's "
        f"({backend!r}: e.g. CPU tensors in a CUDA graph, or tensors of another GPU)?",
        UserWarning,
        stacklevel=3,
    )


def internal_capture(cuda_graph: BreakableCUDAGraph, **kwargs: Any) -> BreakableCUDAGraphCapture:
    """A capture made by bcg itself, which warns nothing when it records nothing."""
    capture = BreakableCUDAGraphCapture(cuda_graph, **kwargs)
    capture._warns_if_empty = False
    return capture


class CaptureState:
    """Everything one capture in progress needs; reachable through :func:`active_capture`."""

    def __init__(
        self,
        backend: GraphBackend,
        stream: Any,
        pool: Any,
        mode: str,
        barrier_fn: Callable[[], object] | None,
        auto_join: bool,
        faithful: bool = True,
        debug: DebugLevel = DebugLevel.OFF,
    ) -> None:
        self.backend = backend
        self.stream = stream
        self.pool = pool
        self.mode = mode
        self.barrier_fn = barrier_fn
        self.auto_join = auto_join
        # A backend that runs ops while recording them has already executed the segment.
        self.launch_after_capture = faithful and not backend.executes_at_capture
        self.debug = debug
        self.tracker = StreamTracker(stream, backend)
        self.steps: list[Step] = []
        # Empty segments are not replayed but stay alive until the graph is reset: each holds a
        # reference on the pool, and releasing one mid-capture could free a bare-id pool.
        self.dropped: list[Segment] = []
        self.segment: Segment | None = None
        self.thread = threading.get_ident()
        self._segment_thread = 0
        self.in_break = False
        self.where = "before the first segment"
        self._segments_begun = 0
        self._last_break: str | None = None
        # The exception that left the last break, and where it was raised: the next segment
        # has begun by the time the capture's exit sees it (see where_raised).
        self._break_failure: tuple[BaseException, str] | None = None
        # The error that ended a segment's capture unsuccessfully (a host sync swallowed in it):
        # code that catches it and goes on runs unrecorded, so the capture can only fail.
        self.broken: BaseException | None = None
        # Set when the capture is left: a context that still holds this state (one it was
        # entered in but not left in, see exit_capture) no longer sees a capture.
        self.closed = False

    def begin_segment(self) -> None:
        self._segments_begun += 1
        after = f" (after break {self._last_break!r})" if self._last_break else ""
        self.where = f"in graph segment {self._segments_begun}{after}"
        if self.debug is not DebugLevel.OFF:
            logger.warning("bcg: capturing %s", self.where)
        self.tracker.begin_segment()
        segment = self.backend.new_segment()
        segment.capture_begin(self.pool, self.mode)
        self.segment = segment
        self._segment_thread = threading.get_ident()

    def _check_thread(self, what: str) -> None:
        # CUDA lets only the thread that began a capture end it, unless the mode is "relaxed";
        # autograd runs backward (and the breaks in it) on a worker thread.
        if self.mode != "relaxed" and threading.get_ident() != self._segment_thread:
            raise CaptureError(
                f"{self.where}: {what} was reached on a different thread than the one that "
                f"began the segment (autograd runs backward on its own thread). CUDA only allows "
                f"that with capture_error_mode='relaxed'; capture with that mode to put breaks "
                f"inside backward (current mode: {self.mode!r})."
            )

    def where_raised(self, exc: BaseException) -> str:
        """Where ``exc`` was raised: in the break it left (a break's function, its stub, the
        barrier, a refusal of its output), else where the capture is now."""
        failure = self._break_failure
        return failure[1] if failure is not None and failure[0] is exc else self.where

    def forget_errors(self) -> None:
        """Drop the errors this state keeps for the capture's exit. Each one's traceback holds
        the frames that hold this state: kept, the cycle left the state, its pool and segments
        (on CUDA, a capture lane each) to the garbage collector, and a process that failed
        captures often held more lanes, and their workspaces, than it ever used at once."""
        self._break_failure = None
        self.broken = None

    def end_segment(self) -> None:
        """Join forked side streams (or fail naming them) and end the segment's capture."""
        if self.broken is not None:
            # The segment ended with an error that the captured code caught: what ran after it
            # was never recorded (on CUDA the stream left capture mode), so a replay would
            # silently skip it. (Without this the capture succeeded on the CPU backend and
            # replayed the capture's values forever.)
            raise CaptureError(
                f"{self.where}: the captured code caught the error that ended this segment's "
                "capture and went on, unrecorded; a capture cannot continue past that error: "
                f"fix it, or let it propagate ({type(self.broken).__name__}: {self.broken})"
            ) from self.broken
        unjoined = self.tracker.unjoined()
        if unjoined and not self.auto_join:
            names = ", ".join(repr(s) for s in unjoined)
            raise UnjoinedStreamError(
                f"{self.where}: side stream(s) {names} were forked from the capturing stream and "
                "not joined back. Join them (capturing_stream.wait_stream(side)) before the "
                "segment ends, or capture with auto_join=True."
            )
        self.tracker.join_all()
        segment = self.segment
        assert segment is not None, "end_segment() outside a segment"
        try:
            segment.capture_end()
        except BaseException as exc:
            self.broken = exc
            forked = self.tracker.forked_this_segment()
            if forked and "unjoined" in str(exc).lower():
                names = ", ".join(repr(s) for s in forked)
                raise UnjoinedStreamError(
                    f"{self.where}: CUDA reports work left unjoined on a side stream; streams "
                    f"forked in this segment: {names}. Join them before the segment ends."
                ) from exc
            raise
        # Forget the segment only once it ended: abort() must still see a failed one.
        self.segment = None
        if segment.empty:
            self.dropped.append(segment)
            return
        self.steps.append(SegmentStep(segment))
        if self.launch_after_capture:
            # Faithful capture: run what was just recorded, on the capturing stream, so the next
            # break (and the code after the block) sees the values one eager step computes.
            segment.launcher()()

    def abort(self) -> None:
        """End a segment left open by an exception, so the stream stops capturing."""
        segment, self.segment = self.segment, None
        if segment is None:
            return
        # An unjoined fork would make ending the capture fail too; joining can itself fail when
        # the capture is already invalidated, which ending it below then reports.
        with contextlib.suppress(RuntimeError):
            self.tracker.join_all()
        try:
            segment.capture_end()
        except RuntimeError:
            self.backend.recover_after_failure(self.pool)
        segment.reset()
        if self.backend.capture_info(self.stream).status is not CaptureStatus.NONE:
            raise CaptureError("the capturing stream could not be taken out of capture mode")

    def split(self) -> None:
        """An explicit split with no eager work (see :func:`break_graph`)."""
        if self.in_break:
            return
        self._check_thread("break_graph()")
        self.end_segment()
        self.begin_segment()

    def record_break(
        self,
        fn: Callable[..., Any],
        stub: Callable[..., Any] | None,
        strict: bool,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run one break at capture: end the segment, barrier, run eagerly, record, resume."""
        self._check_thread(f"break {name!r}")
        self.end_segment()
        try:
            return self._run_break(fn, stub, strict, name, args, kwargs)
        except BaseException as exc:
            self._break_failure = (exc, self.where)
            raise
        finally:
            # Also after an error (the break's own, the barrier's, or bcg's refusal of what the
            # break did): a caller that catches it and goes on (a fallback path) is captured in
            # a new segment. (Left without a segment, its ops were not recorded and the
            # capture's exit failed an internal assertion.)
            self.begin_segment()

    def _run_break(
        self,
        fn: Callable[..., Any],
        stub: Callable[..., Any] | None,
        strict: bool,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """:meth:`record_break` between the segments: barrier, run eagerly, record."""
        self._last_break = name
        self.where = f"in break {name!r}"
        if self.debug is not DebugLevel.OFF:
            logger.warning("bcg: running break %r at capture", name)
        if self.barrier_fn is not None:
            self.barrier_fn()
        fresh: FreshTensorTracker | None = None
        pooling = bool(self.backend.alias_device_types)
        debugging = self.debug is not DebugLevel.OFF
        arguments = argument_tensors((args, kwargs))
        # The arguments it writes in place are graph memory, as its outputs are (the CPU
        # backend's 0-dim rule: a later segment's scalar[0] of a buffer the break fills is
        # re-read at replay, as on CUDA). Inference tensors keep no version: not noted.
        versions = [(t, t._version) for t in arguments if not t.is_inference()]
        layouts = argument_layouts((args, kwargs))
        refuse_iterators(name, args, kwargs)
        modes = current_modes()  # what the code around the break set up (autocast, inference)
        # Marked inside the break only now, right before the try that unmarks it: an error
        # reading the arguments above left the capture marked, and every later break of a
        # capture that caught it ran as a plain call, never replayed.
        self.in_break = True
        self.tracker.begin_break()
        raised = False
        caller = self.backend.current_stream()
        try:
            # The break allocates outside the pool: its temporaries are not graph memory (a
            # replay allocates them outside too). The outputs nothing else holds are copied
            # into the pool below (owned.py); where reference counts cannot tell, what its ops
            # create is recorded instead (fresh.py), as it is for the debug report. It runs in
            # a context of the caller's stream, so a stream it makes current and leaves so is
            # undone before the next segment begins (on the current stream); refused below.
            with (
                self.backend.stream_context(caller),
                self.backend.not_pool_growth(self.pool, self.stream.device),
            ):
                if (pooling and not owned.counts_tell()) or self.debug is not DebugLevel.OFF:
                    fresh = FreshTensorTracker(self.backend.device_type)
                    with fresh:
                        output = (stub if stub is not None else fn)(*args, **kwargs)
                else:
                    output = (stub if stub is not None else fn)(*args, **kwargs)
                left_on = self.backend.current_stream()
        except BaseException:
            raised = True
            raise
        finally:
            side_streams = self.tracker.end_break()
            self.in_break = False
            if raised:
                for side in side_streams:
                    self.stream.wait_stream(side)
        refuse_changed_arguments(name, layouts, (args, kwargs))
        made = None
        if pooling:  # read first, with the output held by the box alone (owned.sole_owned)
            box = [output]
            del output
            made = owned.sole_owned(box, self.stream.device)
            (output,) = box
            del box
        for side in side_streams:
            self.stream.wait_stream(side)
        if left_on.cuda_stream != caller.cuda_stream:
            # The rest of the forward would have been captured on that stream, and a replay
            # (where the break switches again) would launch it there, unordered with the caller.
            raise CaptureError(
                f"break {name!r} made {left_on!r} the current stream and did not restore it "
                f"({caller!r} was current when it was called). Use the side stream in a "
                "`with torch.cuda.stream(side):` block inside the break, so the stream is "
                "restored when the break returns."
            )
        device = self.backend.device_type
        if strict and contains_device_tensor(output, frozenset({device})):
            raise BreakOutputError(
                f"break {name!r} is strict but returned a {device.upper()} tensor. Write the "
                "result into a buffer passed as an argument and return None, or drop strict=True "
                "to have the output copied into a bridge buffer at every replay."
            )
        if fresh is not None and debugging:
            report_leaks(name, fresh, output, arguments, strict=self.debug is DebugLevel.STRICT)
        # The outputs nothing else holds are copied into the pool, so a bridge costs what a graph
        # intermediate costs (DESIGN.md, "Who may reuse a bridge's memory"); they are held by
        # alias, and the code after the break gets the owning copies, which keep their blocks
        # allocated for as long as it holds them. Everything else is held strongly.
        in_pool = None
        if made is None and fresh is not None and pooling:
            made = fresh.made_on(self.stream.device)
        if made is not None:
            with self.backend.allocate_to_pool(self.pool, self.stream.device) as routed:
                if routed:
                    output, in_pool = copy_into_pool(output, made)
        bridge = Bridge(name, output, in_pool, (args, kwargs))
        written = [t for t, version in versions if t._version != version]
        self.backend.note_graph_memory(self.pool, [*bridge.tensors, *written])
        self.steps.append(
            BreakStep(
                name=name,
                fn=fn,
                args=alias_tree(args, self.backend.alias_device_types, device),
                kwargs=alias_tree(kwargs, self.backend.alias_device_types, device),
                bridge=bridge,
                side_streams=side_streams,
                backend=self.backend,
                modes=modes,
                stubbed=stub is not None,
                device=self.stream.device,
            )
        )
        return output


class BreakableCUDAGraphCapture(AbstractContextManager["BreakableCUDAGraphCapture"]):
    """Capture the enclosed code into ``cuda_graph`` as segments split at break points.

    Like ``torch.cuda.graph``: work runs on ``stream`` inside the block, allocations come from
    the graph's pool (``pool`` overrides it), and ``capture_error_mode`` ("global",
    "thread_local" or "relaxed") is passed to every segment. ``barrier_fn`` runs before each
    break at capture, never at replay (e.g. a process-group barrier so all ranks reach a
    collective break together). With ``auto_join`` a side stream forked from the capturing
    stream and not joined is joined before its segment ends; without it the capture fails with
    :class:`UnjoinedStreamError` naming the stream.

    ``stream=None`` (the default) captures on the pool's capture lane: a stream only captures
    use, whose cuBLAS workspace (captured kernels bake its address) lives in memory of the
    lane's own, made there before the capture. A stream of your own that ran eager cuBLAS work
    (warm-ups) has its workspace in the ordinary allocator, and anyone clearing cuBLAS
    workspaces (torch.compile's cudagraph trees do at every recording) frees memory the graph
    still writes at every replay: warm up on another stream.

    ``faithful`` (default True): each segment is launched once on the capturing stream right
    after its capture ends, before the next break runs. Breaks then see the values an eager step
    computes (a size, an index or an ``.item()`` taken from a segment's output is real, no
    ``capture_stub`` needed), and when the block exits every output (and every in-place update,
    such as a KV cache write) equals one eager step; the caller's stream waits for the capturing
    stream at exit, so the outputs can be read right away. The cost is one replay per capture.
    ``faithful=False`` only records, as ``torch.cuda.graph`` does: segment outputs hold garbage
    until the first replay. The CPU backend executes every op while recording it, so its captures
    are faithful either way (``faithful=False`` changes nothing there).

    ``debug`` (None: the ``BCG_DEBUG`` environment variable; False, True or "strict"): log each
    segment and break as capture reaches it, and check each break for device tensors it created
    that are still alive afterwards but neither returned nor stored into its arguments' storage
    (a cache a later segment would read at its capture-time address). Each one is reported with
    the break's name and its size, as a warning, or as :class:`CaptureError` with "strict".
    Mark an intended one with :func:`keep_alive_ok`.

    Capture does not run ``gc.collect()`` unless torch's own switch for ``torch.cuda.graph``
    asks for it (``torch.compiler.config.force_cudagraph_gc``, env ``TORCH_CUDAGRAPH_GC=1``):
    with a serving-sized heap one collection costs more than the whole capture. Nor does it
    synchronise the device: the capturing stream waits for the caller's current stream instead.
    Automatic garbage collection is paused while the capture is open (a collection could
    destroy a dead CUDA graph, which invalidates a capture); the collector's state is restored
    at exit.

    Failure modes: bad arguments raise ``TypeError``/``ValueError`` before anything starts; a
    nested capture, a graph that already holds a capture (call ``reset()``), a stream that is
    already capturing, a machine without CUDA, or disabled breakable graphs (``BCG_DISABLE=1``,
    ``disable_breakable_graphs()``) raise :class:`CaptureError`. An exception from
    the captured code propagates unchanged (with a note saying where it was raised; an error
    that ended a segment's capture and that the captured code caught fails the capture at the
    next segment end with :class:`CaptureError`); in every case the stream leaves capture
    mode, context variables are reset, stream hooks are removed, and the graph is left in the
    failed state, ready for ``reset()`` and a new capture. A capture that recorded no graph
    work and no break warns (``UserWarning``, as torch warns about an empty graph): its replay
    does nothing, typically because the code ran on another device than the graph's.

    Args:
        cuda_graph: the empty :class:`BreakableCUDAGraph` to capture into.
        pool: a memory pool handle to allocate from instead of the graph's own (default None:
            ``cuda_graph.pool()``); the graph's :meth:`~BreakableCUDAGraph.pool` is then this
            one.
        stream: a ``torch.cuda.Stream`` to capture on (default None: the pool's capture lane).
        capture_error_mode: ``"global"`` (the default), ``"thread_local"`` or ``"relaxed"``,
            passed to every segment; breaks inside autograd's backward need ``"relaxed"``.
        barrier_fn: a callable run before each break at capture, never at replay (default
            None).
        auto_join: join unjoined side streams before each segment ends (default True); False
            raises :class:`UnjoinedStreamError` instead.
        faithful: launch each segment once right after its capture so breaks and the code after
            the block see eager values (default True); False only records.
        debug: False, True or ``"strict"``: log segments and breaks and report fresh tensors a
            break leaves alive (a warning, or :class:`CaptureError` with ``"strict"``). Default
            None: the ``BCG_DEBUG`` environment variable.

    Raises:
        TypeError: ``cuda_graph`` is not a :class:`BreakableCUDAGraph`, ``barrier_fn`` is not
            callable, ``auto_join`` or ``faithful`` is not a bool, or ``stream`` is not a
            stream of the graph's backend (a ``torch.cuda.Stream``; on the CPU backend one of
            its own).
        ValueError: ``capture_error_mode`` or ``debug`` has another value.
        CaptureError: on entering the block: this object is already in use, another capture is
            active here, breakable graphs are disabled, the backend's device is missing, the
            graph already holds a capture, or the stream is already capturing. Inside or at the
            end of the block: see :class:`CaptureError`.
        UnjoinedStreamError: a side stream was left unjoined and ``auto_join`` is False.
        BreakOutputError: a ``strict=True`` break returned a device tensor.
    """

    def __init__(
        self,
        cuda_graph: BreakableCUDAGraph,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        barrier_fn: Callable[[], object] | None = None,
        auto_join: bool = True,
        *,
        faithful: bool = True,
        debug: bool | str | None = None,
    ) -> None:
        if not isinstance(cuda_graph, BreakableCUDAGraph):
            raise TypeError(
                f"BreakableCUDAGraphCapture needs a BreakableCUDAGraph, got "
                f"{type(cuda_graph).__name__}; create one with BreakableCUDAGraph()"
            )
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(
                f"capture_error_mode must be one of {CAPTURE_ERROR_MODES}, "
                f"got {capture_error_mode!r}"
            )
        if barrier_fn is not None and not callable(barrier_fn):
            raise TypeError(f"barrier_fn must be callable or None, got {barrier_fn!r}")
        if not isinstance(auto_join, bool):
            raise TypeError(f"auto_join must be a bool, got {auto_join!r}")
        if not isinstance(faithful, bool):
            raise TypeError(f"faithful must be a bool, got {faithful!r}")
        if stream is not None:
            # By type, not by a cuda_stream attribute: a CPU stream's (negative) handle reached
            # the CUDA driver at __enter__, and a CUDA stream failed a CPU capture only there.
            cuda_graph._backend_impl.check_stream(stream)
        if pool is not None:
            cuda_graph._backend_impl.check_pool(pool)
        self.cuda_graph = cuda_graph
        # Off for bcg's own captures (the runner, the divergence check): they pick the graph's
        # backend from the arguments' device, so an empty capture there is a step with no
        # device work, not code run on another device.
        self._warns_if_empty = True
        self._pool = pool
        self._stream = stream
        self._mode = capture_error_mode
        self._barrier_fn = barrier_fn
        self._auto_join = auto_join
        self._faithful = faithful
        self._debug = debug_level(debug)
        self._state: CaptureState | None = None
        self._exit_stack: ExitStack | None = None

    def __enter__(self) -> BreakableCUDAGraphCapture:
        if self._state is not None:
            raise CaptureError("this BreakableCUDAGraphCapture is already in use")
        if active_capture() is not None:
            raise CaptureError(
                "nested breakable capture: a BreakableCUDAGraphCapture is already active in this "
                "context; capture graphs one after the other"
            )
        if breakable_graphs_disabled():
            raise CaptureError(
                f"breakable graphs are disabled ({disabled_reason()}); run the model eagerly "
                "instead of capturing (BreakableGraphRunner does so by itself)"
            )
        backend = self.cuda_graph._backend_impl
        backend.check_available()
        pool = self._pool if self._pool is not None else self.cuda_graph.pool()
        stream = self._stream
        if stream is None:
            stream = backend.capture_stream(pool, backend.current_stream().device)
        if backend.capture_info(stream).status is not CaptureStatus.NONE:
            raise CaptureError(
                f"stream {stream!r} is already capturing (inside torch.cuda.graph?); "
                "a breakable capture must start outside any other capture"
            )
        # Made before the graph is marked capturing: a failure in between (an interrupt) left
        # the graph capturing for good, refusing reset() and every later capture.
        stack = ExitStack()
        self.cuda_graph._begin_capture(pool)
        try:
            if torch.compiler.config.force_cudagraph_gc:
                gc.collect()  # torch.cuda.graph's opt-in switch (TORCH_CUDAGRAPH_GC=1)
            # No device-wide sync: ordering the capturing stream after the caller's is enough
            # for faithful launches (and breaks) to read inputs the caller's stream produced.
            caller = backend.current_stream()
            stream.wait_stream(caller)
            # Work left on the capturing stream by the block is ordered before the caller's
            # next work, so outputs of a faithful capture can be read on the caller's stream.
            stack.callback(caller.wait_stream, stream)
            state = CaptureState(
                backend,
                stream,
                pool,
                self._mode,
                self._barrier_fn,
                self._auto_join,
                faithful=self._faithful,
                debug=self._debug,
            )
            # Entered first, left last: what the segments and breaks reserve is the pool's.
            stack.enter_context(backend.count_pool_growth(pool, stream.device))
            stack.enter_context(gc_paused())
            stack.enter_context(backend.stream_context(stream))
            stack.enter_context(stream_hooks(backend))
            stack.enter_context(compiles_refused(backend.refuses_compiles))
            token = enter_capture(state, stream.cuda_stream)
            try:
                stack.callback(exit_capture, state, token, stream.cuda_stream)
            except BaseException:
                # Not yet on the stack (an interrupt in callback()): the capture stayed active
                # in this context for good, every later capture refused as nested.
                exit_capture(state, token, stream.cuda_stream)
                raise
            state.begin_segment()
        except BaseException:
            stack.close()
            self.cuda_graph._fail_capture(())
            raise
        self._state, self._exit_stack = state, stack
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        state, stack = self._state, self._exit_stack
        if state is None or stack is None:  # not an assert: python -O would strip it
            raise CaptureError(
                "BreakableCUDAGraphCapture was exited more times than it was entered; use it "
                "as a `with` block"
            )
        self._state = self._exit_stack = None
        try:
            with stack:
                if exc is None:
                    try:
                        state.end_segment()
                    except BaseException as end_exc:
                        self._fail(state, end_exc)
                        raise
                    self.cuda_graph._finish_capture(state.steps, state.dropped)
                    if not state.steps and self._warns_if_empty:
                        _warn_empty(self.cuda_graph.backend)
                else:
                    self._fail(state, exc)
                    refused = as_capture_error(exc)
                    if refused is not None:
                        where = state.where_raised(exc)
                        if hasattr(refused, "add_note"):  # Python >= 3.11
                            refused.add_note(
                                f"bcg: raised {where} of a breakable CUDA graph capture"
                            )
                        raise refused from exc
        finally:
            state.forget_errors()

    def _fail(self, state: CaptureState, exc: BaseException) -> None:
        # Asked before the stack closes: this capture is still registered, and so are others.
        others = captures_on_other_threads(state.thread)
        where = state.where_raised(exc)
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"bcg: raised {where} of a breakable CUDA graph capture")
            hint = capture_refusal_hint(exc)
            if hint is not None:
                exc.add_note(hint)
        try:
            state.abort()
        finally:
            self.cuda_graph._fail_capture(
                [*state.steps, *map(SegmentStep, state.dropped)], pool_compromised=True
            )
        # A raw CUDA capture error (bcg's own errors and user errors are not) while another
        # thread captures: say so, so that the step is not blamed for it.
        cuda_capture_error = (
            isinstance(exc, RuntimeError)
            and not isinstance(exc, CaptureError)
            and "captur" in str(exc).lower()
        )
        if others and cuda_capture_error:
            other = others[0]
            raise ConcurrentCaptureError(
                f"{where}: the capture failed with a CUDA capture error ({exc}) while "
                f"another thread was capturing too (stream {other.stream!r}, "
                f"capture_error_mode={other.mode!r}; this capture's: {state.mode!r}). In "
                "'global' mode a capture makes other threads' unsafe calls (allocations, "
                "synchronisations) fail: capture with capture_error_mode='thread_local' "
                "(runners do by default) or one thread at a time."
            ) from exc
