"""BreakableCUDAGraph: the captured sequence of graph segments and eager break steps."""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, SupportsIndex

import torch

from bcg_core import _trees
from bcg_core._backends import GraphBackend, Segment, backend_named
from bcg_core._capture.bridges import Bridge
from bcg_core._capture.context import active_capture, routed_warmup
from bcg_core._capture.modes import Modes, current_modes, run_in
from bcg_core._capture.profile import named, profile_enabled
from bcg_core._errors import BreakOutputError, CaptureError, ReplayError


@dataclass(frozen=True)
class SegmentStep:
    """A captured, non-empty graph segment."""

    segment: Segment
    kind: Literal["graph"] = "graph"


@dataclass(frozen=True)
class BreakStep:
    """An eager break: ``fn`` re-run at replay on the capture-time argument aliases, the side
    streams it used joined into the replay stream, then its output copied into ``bridge``."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    bridge: Bridge
    side_streams: tuple[Any, ...]
    backend: GraphBackend
    modes: Modes = (False, None)  # the inference and autocast modes it ran under at capture
    stubbed: bool = False  # its capture_stub ran at capture instead of fn
    # The capture's device: its segments replay on that device's current stream, whichever
    # device is current (torch's CUDAGraph.replay switches to it).
    device: Any = None
    kind: Literal["break"] = "break"

    def run(self) -> None:
        fresh = self.fn(*self.args, **self.kwargs)
        # Join the side streams first: the bridge copy runs on the replay stream and may read
        # a tensor the break computed on one of them. (The current device's stream joined
        # them when another device was current: a runner on cuda:1 called with cuda:0 current.)
        if self.side_streams:
            stream = self.backend.current_stream(self.device)
            for side in self.side_streams:
                stream.wait_stream(side)
        self.bridge.update(fresh)

    def launcher(self) -> Callable[[], Any]:
        """The cheapest callable equivalent to :meth:`run`: per-break host cost is the budget
        (a break should cost about one graph launch), so a break that returned None and used
        no side stream only checks that it returns None again."""
        if not self.bridge.trivial or self.side_streams:
            return self.run
        return functools.partial(_expect_none, self.name, self.fn, self.args, self.kwargs)


Step = SegmentStep | BreakStep

_MIXED = object()  # breaks captured under different modes: every replay compares per break


def _expect_none(name: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
    if fn(*args, **kwargs) is not None:
        raise BreakOutputError(
            f"break {name!r} returned None at capture but a value at replay; the code after "
            "the break was captured with None. A break must return the same structure every "
            "time: return None always, or a value (a tensor is then bridged) always."
        )


def _step_names(steps: Sequence[Step]) -> list[str]:
    """``bcg.segment[i]`` (i counting segments) or ``bcg.break:<name>`` for each step."""
    names, segments = [], 0
    for step in steps:
        if isinstance(step, SegmentStep):
            names.append(f"bcg.segment[{segments}]")
            segments += 1
        else:
            names.append(f"bcg.break:{step.name}")
    return names


class _State(enum.Enum):
    EMPTY = "empty"
    CAPTURING = "capturing"
    CAPTURED = "captured"
    FAILED = "failed"


class BreakableCUDAGraph:
    """A forward captured as CUDA graph segments separated by eager break points.

    Create it empty, capture into it with :class:`BreakableCUDAGraphCapture`, then call
    :meth:`replay` as often as needed: segments are launched in capture order on the current
    stream, and each break point runs eagerly between them.

    Pool: every segment captures into one private memory pool, created lazily by :meth:`pool`.
    Several graphs may share a pool (``BreakableCUDAGraph(pool=other.pool())``); as with
    ``torch.cuda.graph``, graphs that share a pool must be replayed one at a time, never
    concurrently. The pool's memory is returned when every graph that uses it is garbage
    collected: :meth:`reset` keeps the pool, and its memory, for the next capture (DESIGN.md,
    "Pool ownership"). A bare ``torch.cuda.graph_pool_handle()`` id follows torch's rule: freed
    once every graph captured into it is reset.

    Streams: replay uses ``torch.cuda.current_stream()`` at the time of the call; break points see
    it through :func:`get_current_stream`.

    Backend: ``backend="cuda"`` (the default) captures CUDA graphs; ``backend="cpu"`` captures
    CPU tensors into recorded segments with CUDA's capture rules (host synchronisations inside a
    segment raise), for running and checking breakable graphs without a GPU. Any other value
    raises :class:`ValueError`.

    Profiling: with ``profile=True`` (None, the default: the ``BCG_PROFILE`` environment variable
    at capture) each replay step runs inside ``torch.profiler.record_function`` and, on CUDA, an
    NVTX range, named ``bcg.segment[i]`` or ``bcg.break:<name>``. Off, replay runs the bare
    launchers (the ranges are built into the replay plan only when on).

    Failure modes: :meth:`replay` raises :class:`ReplayError` before a successful capture, after a
    failed one, and while a capture is active in the calling context. A failed capture leaves the
    graph in the failed state; :meth:`reset` clears it for a new capture. A graph cannot be
    copied or pickled (``TypeError``).

    Args:
        pool: a memory pool handle to capture into, from another graph's :meth:`pool` or a
            runner's ``pool``, so the graphs share memory (replay them one at a time); on CUDA
            also ``torch.cuda.graph_pool_handle()``. Anything else raises ``TypeError``.
            Default None: the graph makes its own pool on first use.
        backend: ``"cuda"`` (the default) or ``"cpu"``, the device whose graphs are captured.
        profile: True names each replay step for the profiler, False never does; None (the
            default) reads ``BCG_PROFILE`` at capture.

    Raises:
        ValueError: ``backend`` is neither ``"cuda"`` nor ``"cpu"``.
        TypeError: ``profile`` is not a bool or None, or ``pool`` is no pool handle.
    """

    def __init__(
        self, pool: Any = None, *, backend: str = "cuda", profile: bool | None = None
    ) -> None:
        graph_backend = backend_named(backend)
        if profile is not None and not isinstance(profile, bool):
            raise TypeError(f"profile must be a bool or None, got {profile!r}")
        self._profile = profile
        # Segments are assigned before the pool so that, when the graph is collected, they
        # release the pool before the pool object itself goes.
        self._steps: tuple[Step, ...] = ()
        self._dropped: tuple[Segment, ...] = ()
        self._plan: tuple[Callable[[], Any], ...] = ()
        # The modes every break ran under at capture (_MIXED when they differ; None without
        # breaks), and the plans for replays under other modes (modes.py), made when first met.
        self._modes: Modes | object | None = None
        self._plans_under: dict[Modes, tuple[Callable[[], Any], ...]] = {}
        self._backend: GraphBackend = graph_backend
        self._backend.prepare()
        if pool is not None:
            self._backend.check_pool(pool)
        self._pool = pool
        self._owns_pool = pool is None
        self._state = _State.EMPTY
        self._lock = threading.Lock()
        self._replaying = 0  # replays running now: reset() under one would drop its segments

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # copy.copy, copy.deepcopy and pickle all come here. A shallow copy shared the
        # segments, and its reset() dropped them under the original (still "captured"); a deep
        # copy or a pickle failed on the lock ("cannot pickle '_thread.lock' object").
        raise TypeError(
            "a BreakableCUDAGraph cannot be copied or pickled: its segments and pool belong to "
            "this object; capture a new graph instead"
        )

    def pool(self) -> Any:
        """This graph's memory pool handle, created on first use.

        Returns:
            The handle passed at construction, or the graph's own pool. Pass it as ``pool`` to
            another graph or capture to share the memory (then replay them one at a time).

        Raises:
            CaptureError: the backend cannot capture here (``backend="cuda"`` without CUDA).
        """
        with self._lock:
            if self._pool is None:
                self._pool = self._backend.new_pool()
            return self._pool

    def pool_bytes(self) -> int | None:
        """Bytes the allocator holds in this graph's pool right now.

        Returns:
            What the allocator reserved for the pool in the captures and warm-ups into it
            (shared with every graph that uses it; more when another thread reserved memory
            meanwhile), or None where the backend cannot tell (CPU, a bare pool id).

        Raises:
            CaptureError: the backend cannot capture here (``backend="cuda"`` without CUDA).
        """
        return self._backend.pool_bytes(self.pool())

    @contextlib.contextmanager
    def warmup(self) -> Iterator[Any]:
        """Run the warm-ups before a capture of this graph inside this block.

        The block runs on the stream the capture will use (the pool's capture lane, its cuBLAS
        workspace made first in memory of its own), ordered after the caller's stream and before
        its next work, with the calling thread's allocations routed to the graph's pool. What
        the warm-ups free then stays in the pool, where the capture reuses it, instead of cached
        outside it (the memory ``torch.cuda.graph`` releases with ``empty_cache()`` at every
        capture). Breaks called in the block allocate outside the pool, as at capture: their
        temporaries are never graph memory. A bare pool id (a tuple) is not routed into: the
        allocator has no pool of that id before its first capture.

        Yields:
            The stream the warm-ups run on.

        Raises:
            CaptureError: inside a capture (warm up before it), or where the backend cannot
                capture (no CUDA: use ``backend="cpu"``).
        """
        if active_capture() is not None:
            raise CaptureError("warmup() inside a breakable capture: warm up before capturing")
        backend = self._backend
        backend.check_available()
        pool = self.pool()
        caller = backend.current_stream()
        lane = backend.capture_stream(pool, caller.device)
        lane.wait_stream(caller)
        try:
            with (
                backend.stream_context(lane),
                backend.count_pool_growth(pool, caller.device),
                contextlib.ExitStack() as routing,
            ):
                if not isinstance(pool, tuple) and routing.enter_context(
                    backend.allocate_to_pool(pool, caller.device)
                ):
                    # Breaks called in the warm-ups allocate outside the pool, as at capture.
                    routing.enter_context(
                        routed_warmup(lambda: backend.allocate_outside_pool(pool, caller.device))
                    )
                yield lane
        finally:
            caller.wait_stream(lane)

    def replay(self) -> None:
        """Launch every non-empty segment and run every break, in capture order.

        Runs on the caller's current stream (never switches streams); outputs captured as static
        tensors hold the new results once that stream reaches them.

        Raises:
            ReplayError: the graph holds no successful capture (never captured, reset, or the
                capture failed), or a breakable capture is active in this context.
            BreakOutputError: a break returned another structure, tensors of other number,
                shapes or dtypes, or other plain values (``None``, bools, numbers, strings),
                than at capture.
        """
        if self._state is not _State.CAPTURED:
            raise ReplayError(self._not_ready())
        if active_capture() is not None:
            raise ReplayError(
                "replay() was called while a breakable capture is active; replay after the "
                "capture block has exited"
            )
        # Checked again and counted at once, under reset()'s lock: a reset on another thread
        # between the check above and the count dropped the segments of the replay under it.
        with self._lock:
            if self._state is not _State.CAPTURED:
                raise ReplayError(self._not_ready())
            self._replaying += 1
        try:
            # Replay never switches streams: the replay stream is simply torch's current stream.
            plan = self._plan
            if self._modes is not None and (now := current_modes()) != self._modes:
                plan = self._plan_under(now)
            i = 0
            try:
                for i, run in enumerate(plan):  # noqa: B007 (i names the step that raised)
                    run()
            except BaseException as exc:
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note(f"bcg: raised at replay by {self._step_label(i)}")
                raise
        finally:
            with self._lock:
                self._replaying -= 1

    def reset(self) -> None:
        """Drop all segments and breaks (and their bridges); keep the pool for the next capture.

        Leaves the graph empty, ready for a new capture, also after a failed one.

        Raises:
            ReplayError: this graph is being captured or replayed right now (a break of its
                own replay called it, or a replay runs on another thread).
        """
        with self._lock:
            if self._state is _State.CAPTURING:
                raise ReplayError(
                    "reset() was called while this graph is being captured; call it after the "
                    "capture's with block has exited (a failed capture leaves the graph ready "
                    "for reset())"
                )
            if self._replaying:
                # The running replay would go on over dropped segments: torch's raw "replay
                # without a preceding successful capture" on CUDA, silently on the CPU backend.
                raise ReplayError(
                    "reset() was called while this graph is being replayed (from a break of "
                    "its own replay, or on another thread); call it after replay() has returned"
                )
            for step in self._steps:
                if isinstance(step, SegmentStep):
                    step.segment.reset()
            for segment in self._dropped:
                segment.reset()
            self._steps = ()
            self._dropped = ()
            self._plan = ()
            self._modes = None
            self._plans_under = {}
            self._state = _State.EMPTY

    @property
    def backend(self) -> str:
        """The backend this graph captures with: "cuda" or "cpu"."""
        return self._backend.name

    @property
    def is_captured(self) -> bool:
        """True after a successful capture, until :meth:`reset`."""
        return self._state is _State.CAPTURED

    @property
    def num_segments(self) -> int:
        """Graph segments launched per replay (empty segments are dropped at capture)."""
        return sum(1 for s in self._steps if isinstance(s, SegmentStep))

    @property
    def num_breaks(self) -> int:
        """Eager break steps run per replay."""
        return sum(1 for s in self._steps if isinstance(s, BreakStep))

    @property
    def step_kinds(self) -> tuple[Literal["graph", "break"], ...]:
        """The kind of each replay step, in order."""
        return tuple(s.kind for s in self._steps)

    @property
    def break_names(self) -> tuple[str, ...]:
        """The name of each break step, in order."""
        return tuple(s.name for s in self._steps if isinstance(s, BreakStep))

    def _break_argument_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the breaks receive at replay (aliases of the capture's), in step order;
        tensors inside objects are not among them."""
        found: list[torch.Tensor] = []
        for step in self._steps:
            if isinstance(step, BreakStep):
                found.extend(_trees.tensor_leaves((step.args, step.kwargs), into_objects=False))
        return tuple(found)

    def _ran_stubs(self) -> bool:
        """Whether a ``capture_stub`` ran instead of a break at capture: what the code after it
        computed at capture came from the stub's values, not the real function's."""
        return any(isinstance(s, BreakStep) and s.stubbed for s in self._steps)

    def _bridge_tensors_outside_pool(self) -> tuple[torch.Tensor, ...]:
        """The tensors the bridges hold strongly: outputs that do not lie in the pool."""
        held: list[torch.Tensor] = []
        for step in self._steps:
            if isinstance(step, BreakStep):
                pooled = {id(t) for t in step.bridge.pooled}
                held.extend(t for t in step.bridge.tensors if id(t) not in pooled)
        return tuple(held)

    def __repr__(self) -> str:
        return (
            f"BreakableCUDAGraph(state={self._state.value}, segments={self.num_segments}, "
            f"breaks={self.num_breaks})"
        )

    # -- used by BreakableCUDAGraphCapture --------------------------------------------------

    @property
    def _backend_impl(self) -> GraphBackend:
        return self._backend

    def _begin_capture(self, pool: Any) -> None:
        """Start a capture into ``pool``: from now on the graph's pool (a capture given
        another pool than the graph's puts the graph's memory there, so :meth:`pool` and
        :meth:`pool_bytes` answer for it)."""
        with self._lock:
            if self._state is _State.CAPTURING:
                raise CaptureError("this graph is already being captured")
            if self._state is not _State.EMPTY:
                raise CaptureError(
                    f"this graph already holds a {self._state.value} capture; call reset() "
                    "before capturing into it again"
                )
            if pool is not self._pool:
                self._pool = pool
                self._owns_pool = False
            self._state = _State.CAPTURING

    def _finish_capture(self, steps: Sequence[Step], dropped: Sequence[Segment]) -> None:
        plan = [s.segment.launcher() if isinstance(s, SegmentStep) else s.launcher() for s in steps]
        if profile_enabled(self._profile):
            names = _step_names(steps)
            plan = [named(run, n, self._backend) for run, n in zip(plan, names, strict=True)]
        modes = {s.modes for s in steps if isinstance(s, BreakStep)}
        with self._lock:
            self._steps = tuple(steps)
            self._dropped = tuple(dropped)
            self._plan = tuple(plan)
            self._modes = None if not modes else modes.pop() if len(modes) == 1 else _MIXED
            self._plans_under = {}
            self._state = _State.CAPTURED

    def _plan_under(self, now: Modes) -> tuple[Callable[[], Any], ...]:
        """The plan of a replay under modes other than the capture's: each break that ran
        under other modes runs under its own again."""
        plan = self._plans_under.get(now)
        if plan is None:
            plan = tuple(
                run_in(s.modes, run) if isinstance(s, BreakStep) and s.modes != now else run
                for s, run in zip(self._steps, self._plan, strict=True)
            )
            self._plans_under[now] = plan  # a racing duplicate is equal: no lock needed
        return plan

    def _fail_capture(self, steps: Sequence[Step], pool_compromised: bool = False) -> None:
        for step in steps:
            if isinstance(step, SegmentStep):
                step.segment.reset()
        with self._lock:
            if pool_compromised and self._owns_pool:
                # A capture that failed half-way can leave torch routing host allocations to
                # the pool; the next capture starts in a fresh one.
                self._pool = None
            self._steps = ()
            self._plan = ()
            self._modes = None
            self._plans_under = {}
            self._state = _State.FAILED

    def _step_label(self, index: int) -> str:
        step = self._steps[index]
        if isinstance(step, BreakStep):
            return f"break {step.name!r} (step {index + 1} of {len(self._steps)})"
        return f"{_step_names(self._steps)[index]} (step {index + 1} of {len(self._steps)})"

    def _not_ready(self) -> str:
        if self._state is _State.FAILED:
            return "the last capture of this graph failed; call reset() and capture again"
        if self._state is _State.CAPTURING:
            return "replay() was called while this graph is being captured"
        return "this graph holds no capture yet; capture it with BreakableCUDAGraphCapture first"
