"""BreakableGraphRunner: capture once per call signature, replay on every later call."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from bcg_core import _trees
from bcg_core._backends import backend_for
from bcg_core._capture.capture import BreakableCUDAGraphCapture
from bcg_core._capture.flag import (
    breakable_graphs_disabled,
    disabled_reason,
    enable_breakable_cuda_graph,
    flag_on,
    flag_reset,
)
from bcg_core._capture.graph import BreakableCUDAGraph
from bcg_core._diagnostics.divergence import runner_divergence
from bcg_core._diagnostics.divergence_report import DivergenceReport
from bcg_core._runner.entry import Entry
from bcg_core._runner.pool import PoolTurn, share_turn
from bcg_core._runner.scalars import ScalarSlots
from bcg_core._signature import (
    Signature,
    describe_difference,
    describe_signature,
    identity_objects,
    signature_and_tensors,
    static_call,
)

logger = logging.getLogger("bcg_core")

MISS_LOG_LIMIT = 8
"""Distinct missed signatures logged with their details; later misses are only counted."""

Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class EntryStats:
    """One captured signature: graph segments launched per replay, breaks run per replay, the
    bytes its (shared) pool held right after this capture (None where the backend cannot
    tell), replays so far, how many times :meth:`BreakableGraphRunner.capture` ran the step
    for it (warm-ups + the capture), the pool it was captured into, and the wall time of the
    capture itself in ms (warm-ups excluded; the capture stream synchronised at its end)."""

    signature: Signature
    segments: int
    breaks: int
    pool_bytes: int | None
    replays: int
    capture_runs: int
    pool: Any
    capture_ms: float


@dataclass(frozen=True)
class RunnerStats:
    """Counters since construction (or the last :meth:`BreakableGraphRunner.reset`)."""

    hits: int
    misses: int
    captures: int
    failed_captures: int
    evictions: int
    entries: tuple[EntryStats, ...] = field(default=())


class BreakableGraphRunner:
    """Stand-in for a module (or any callable) that replays one breakable graph per signature.

    **Signatures.** The signature of a call (see ``_signature.py``) is its tensor shapes,
    dtypes and devices, its constants and container structure, the addresses of tensors inside
    object arguments, and every other object by identity. For each captured signature the
    runner owns persistent static input buffers (a CPU tensor input, such as a timestep, gets a
    buffer on ``device``), a :class:`BreakableCUDAGraph` and its static output. A Python number
    is a constant of the signature unless its argument is named in ``as_tensor`` (positions and
    keyword names, e.g. ``as_tensor=("t", "guidance")``): there a ``bool``/``int``/``float`` is
    passed to the captured call as a 0-dim tensor on ``device`` (dtype as ``torch.tensor(v)``),
    rewritten at every call, so one graph serves every value; the model must accept a tensor
    there (arithmetic works unchanged; ``int(t)`` or ``if t > 0`` would sync the host).

    **One pool.** Every signature captures into one memory pool, :attr:`pool`, so graphs reuse
    each other's intermediate memory and the runner costs about what its largest graph costs;
    capture the largest shape first (:meth:`capture_many` does). ``pool=other.pool`` shares a
    pool with another runner (or a graph's ``pool()``): runners sharing a pool share one lock
    and one device event, so their replays run one at a time, as graphs sharing a pool must.

    **Capture** happens only in :meth:`capture`, :meth:`capture_many` or inside a
    :meth:`warmup` window: ``warmup_iters`` eager runs on :attr:`stream`, then the capture on
    the same stream, both under :func:`enable_breakable_cuda_graph`. Capturing runs the step
    ``warmup_iters + 1`` times (``EntryStats.capture_runs``): the capture itself executes the
    step once and its output is returned (no replay after capture). Stateful inputs (a KV cache
    position) advance that often: capture at start-up, then reset them.

    **Serving.** A known signature is replayed: the call's inputs are written into the static
    buffers (one batched copy), the graph replays under the runtime flag (and inside
    ``replay_context()`` if given), and a clone of the output is returned (``return_views=True``
    returns the static output itself, valid until the next replay). Device order: a call's
    input copies wait on an event recorded after the previous use of the pool, on whatever
    stream that ran, and the clone is taken on the replay stream before the next event. An
    unknown signature runs eagerly and never captures; the first :data:`MISS_LOG_LIMIT`
    distinct misses are logged with the fields that differ from the nearest captured
    signature, later ones are only counted in :attr:`stats`.

    **Failure modes.** Breakable graphs disabled (``BCG_DISABLE=1`` or inside
    :func:`disable_breakable_graphs`): every call runs eagerly, announced once per runner. A
    capture that raises blocks its signature (eager from then on) with a warning naming it; a
    capture with more than ``max_segments`` segments disables the runner (eager for everything,
    reason in :attr:`disabled_reason`); beyond ``max_entries`` the least recently used entry is
    evicted (after its last replay finished on the device) and its graph's memory goes back to
    the pool. With ``device="cuda"`` and no CUDA device every call runs eagerly, with a
    one-time notice; ``device="cpu"`` captures CPU graphs (the CPU backend of
    :class:`BreakableCUDAGraph`, with CUDA's capture rules). Attribute access falls through to
    the wrapped module. Calls are serialised by a lock: static buffers are shared state.
    """

    def __init__(
        self,
        module: Callable[..., Any],
        *,
        device: torch.device | str = "cuda",
        max_entries: int = 8,
        max_segments: int | None = None,
        warmup_iters: int = 2,
        return_views: bool = False,
        replay_context: Callable[[], AbstractContextManager[Any]] | None = None,
        pool: Any = None,
        as_tensor: Iterable[int | str] = (),
    ) -> None:
        if not callable(module):
            raise TypeError(f"BreakableGraphRunner wraps a callable, got {module!r}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_segments is not None and max_segments < 1:
            raise ValueError(f"max_segments must be >= 1 or None, got {max_segments}")
        if warmup_iters < 0:
            raise ValueError(f"warmup_iters must be >= 0, got {warmup_iters}")
        if isinstance(pool, (BreakableCUDAGraph, BreakableGraphRunner)):
            raise TypeError(
                f"pool= takes a memory pool, got a {type(pool).__name__}; pass its pool "
                "(runner.pool, or graph.pool())"
            )
        self.module = module
        self.device = torch.device(device)
        self.max_entries = max_entries
        self.max_segments = max_segments
        self.warmup_iters = warmup_iters
        self.return_views = return_views
        self.replay_context = replay_context
        self.disabled_reason: str | None = None
        # device="cpu" captures CPU graphs; every other device goes to the CUDA backend.
        self._graph_backend = backend_for("cpu" if self.device.type == "cpu" else "cuda")
        self._pool = pool
        self._owns_pool = pool is None
        turn = PoolTurn(self._graph_backend)
        self._turn = turn if pool is None else share_turn(pool, turn)
        self._lock = self._turn.lock
        self._scalars = ScalarSlots(as_tensor, module)
        self._lift = self._scalars.lift if self._scalars else None
        self._window = 0
        self._entries: OrderedDict[Signature, Entry] = OrderedDict()
        self._blocked: dict[Signature, str] = {}
        self._logged_misses: set[Signature] = set()
        self._no_cuda_noticed = False
        self._disabled_noticed = False
        self._side: Any = None
        self._counts = {"hits": 0, "misses": 0, "captures": 0, "failed": 0, "evictions": 0}

    # -- the module stand-in ------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # Only called for names the runner itself lacks; never recurse before __init__ ran.
        if name == "module" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if not self._can_graph():
                return self.module(*args, **kwargs)
            values: list[bool | int | float] = []
            if self._lift is None:
                call_args, call_kwargs = args, kwargs
            else:
                call_args, call_kwargs, values = self._lift(args, kwargs)
            sig, live = signature_and_tensors(call_args, call_kwargs)
            entry = self._entries.get(sig)
            if entry is not None:
                self._entries.move_to_end(sig)
                self._counts["hits"] += 1
                return self._replay(entry, live, values)
            if sig not in self._blocked and self._window > 0:
                return self._capture(sig, (args, kwargs), (call_args, call_kwargs), values)
            self._counts["misses"] += 1
            self._diagnose_miss(sig)
            return self.module(*args, **kwargs)

    # -- capture control ----------------------------------------------------------------------

    def capture(self, *args: Any, **kwargs: Any) -> Any:
        """Capture the graph for this call's signature and return the call's output.

        Runs the step ``warmup_iters + 1`` times (warm-ups, then the capture, whose output is
        returned); once when the signature is already captured (a replay) or cannot be
        captured (blocked, graphs disabled, no CUDA: one eager run).
        """
        with self.warmup():
            return self(*args, **kwargs)

    def capture_many(
        self, calls: Iterable[Call], *, order: Literal["largest_first", "given"] = "largest_first"
    ) -> None:
        """Capture one graph per call, as engines do at start-up; each call is
        ``(args, kwargs)``. ``order="largest_first"`` (the default) captures in decreasing
        total bytes of the call's tensors (ties keep the given order): a graph captured later
        into the shared pool reuses the memory that larger graphs freed during their capture,
        so the pool ends up the size of the largest graph. ``order="given"`` keeps the order.
        Outputs are not kept (use :meth:`capture` for one); see :attr:`stats`.
        """
        if order not in ("largest_first", "given"):
            raise ValueError(f"order must be 'largest_first' or 'given', got {order!r}")
        checked = [_check_call(i, c) for i, c in enumerate(calls)]
        if order == "largest_first":
            checked.sort(key=_call_bytes, reverse=True)  # stable: ties keep the given order
        with self.warmup():
            for args, kwargs in checked:
                self(*args, **kwargs)

    @contextlib.contextmanager
    def warmup(self) -> Iterator[BreakableGraphRunner]:
        """A window in which calls with unknown signatures are captured."""
        with self._lock:
            self._window += 1
        try:
            yield self
        finally:
            with self._lock:
                self._window -= 1

    def reset(self) -> None:
        """Drop every entry, block and counter; re-enable a disabled runner.

        Waits until the last replay has finished on the device, then resets every graph. A
        pool this runner made is released (a later capture makes a new one): its memory
        returns to the allocator once nothing else holds it (``torch.cuda.empty_cache()``
        then returns it to the device). A pool given with ``pool=`` is kept for later
        captures: the graphs' blocks return to it, for whoever shares it.
        """
        with self._lock:
            self._turn.drain()
            for entry in self._entries.values():
                entry.graph.reset()
            self._entries.clear()
            self._blocked.clear()
            self._logged_misses.clear()
            self.disabled_reason = None
            self._counts = dict.fromkeys(self._counts, 0)
            if self._owns_pool:
                self._pool = None

    @property
    def pool(self) -> Any:
        """The memory pool every graph of this runner captures into (made on first use; pass
        it as ``pool=`` to share it). Raises :class:`CaptureError` where the runner's backend
        cannot capture (``device="cuda"`` without CUDA)."""
        with self._lock:
            if self._pool is None:
                self._graph_backend.check_available()
                self._pool = self._graph_backend.new_pool()
                share_turn(self._pool, self._turn)
            return self._pool

    @property
    def stream(self) -> Any:
        """The stream warm-ups run on (one per runner, made on first use and reused: each
        stream that runs cuBLAS work keeps a workspace). Captures then run on the pool's capture
        lane, ordered after it (see :class:`BreakableCUDAGraphCapture`)."""
        with self._lock:
            if self._side is None:
                self._side = self._graph_backend.new_stream(self.device)
            return self._side

    def check_divergence(self, *args: Any, **kwargs: Any) -> DivergenceReport:
        """Compare eager and replay for this call on the graph captured for its signature
        (bitwise, seed 0; see :func:`bcg_core.check_divergence`): e.g. before serving, with
        inputs other than the capture's. Raises :class:`ValueError` when no graph is captured
        for the call's signature."""
        with self._lock:
            values: list[bool | int | float] = []
            if self._lift is None:
                call_args, call_kwargs = args, kwargs
            else:
                call_args, call_kwargs, values = self._lift(args, kwargs)
            sig, live = signature_and_tensors(call_args, call_kwargs)
            entry = self._entries.get(sig)
            if entry is None:
                why = describe_difference(sig, list(self._entries))
                raise ValueError(f"no graph is captured for this call's signature: {why}")

            def load() -> tuple[tuple[Any, ...], dict[str, Any]]:
                entry.load(live, values)
                return entry.static_call

            # Ordered with the pool's replays on other streams, as a call is.
            stream = self._graph_backend.current_stream(self.device)
            self._turn.wait(stream)
            try:
                return runner_divergence(
                    self.module, entry.graph, entry.output, load, self.replay_context
                )
            finally:
                self._turn.record(stream)

    @property
    def stats(self) -> RunnerStats:
        with self._lock:
            entries = tuple(
                EntryStats(
                    sig,
                    e.graph.num_segments,
                    e.graph.num_breaks,
                    e.pool_bytes,
                    e.replays,
                    e.capture_runs,
                    e.graph.pool(),
                    e.capture_ms,
                )
                for sig, e in self._entries.items()
            )
            c = self._counts
            return RunnerStats(
                c["hits"], c["misses"], c["captures"], c["failed"], c["evictions"], entries
            )

    @property
    def blocked_signatures(self) -> dict[Signature, str]:
        """Signatures whose capture failed, with the reason; they run eagerly."""
        with self._lock:
            return dict(self._blocked)

    # -- internals ----------------------------------------------------------------------------

    def _can_graph(self) -> bool:
        if self.disabled_reason is not None:
            return False
        if breakable_graphs_disabled():
            if not self._disabled_noticed:
                self._disabled_noticed = True
                logger.warning(
                    "bcg: breakable graphs are disabled (%s); %s runs every call eagerly",
                    disabled_reason(),
                    type(self).__name__,
                )
            return False
        if not self._graph_backend.is_available():
            if not self._no_cuda_noticed:
                self._no_cuda_noticed = True
                logger.warning(
                    "bcg: no CUDA device is available; %s runs eagerly (no graphs are captured). "
                    "To capture CPU graphs of CPU tensors without a GPU (CUDA's capture rules), "
                    'pass device="cpu"',
                    type(self).__name__,
                )
            return False
        return True

    def _capture(self, sig: Signature, call: Call, lifted: Call, values: list[Any]) -> Any:
        backend, device = self._graph_backend, self.device
        statics: list[torch.Tensor] = []
        fill: list[int] = []

        def make_static(t: torch.Tensor) -> torch.Tensor:
            if t.device == device:
                buf = t.clone()
            else:
                buf = torch.empty_like(t, device=device)
                buf.copy_(t)
                if t.dim() == 0 and t.device.type == "cpu" and buf.device.type != "cpu":
                    fill.append(len(statics))
            statics.append(buf)
            return buf

        static_args, static_kwargs = static_call(*lifted, make_static)
        scalars: list[torch.Tensor] = []
        if values:
            static_args, static_kwargs, scalars = self._scalars.place(
                static_args, static_kwargs, values, device
            )
        graph = BreakableCUDAGraph(pool=self.pool, backend=backend.name)
        # Static buffers and scalar slots are device memory the graph re-reads at every replay.
        backend.note_graph_memory(graph.pool(), [*statics, *scalars])
        current, side = backend.current_stream(device), self.stream
        # The side stream reads the static buffers written on the current stream, and may
        # reuse pool memory that the last replay (on any stream) still uses.
        side.wait_stream(current)
        self._turn.wait(side)
        try:
            with backend.stream_context(side), enable_breakable_cuda_graph():
                for _ in range(self.warmup_iters):
                    self.module(*static_args, **static_kwargs)
            backend.synchronize((side,))  # start-up only: the capture's own time is reported
            started = time.perf_counter()
            # The capture runs on the pool's capture lane, after the warm-ups (see
            # BreakableCUDAGraphCapture: the workspace cuBLAS caches per stream must not be
            # one the warm-ups made outside the pool).
            with (
                backend.stream_context(side),
                enable_breakable_cuda_graph(),
                BreakableCUDAGraphCapture(graph),
            ):
                output = self.module(*static_args, **static_kwargs)
            backend.synchronize((side,))
            capture_ms = (time.perf_counter() - started) * 1e3
        except Exception as exc:
            current.wait_stream(side)  # before the static buffers are freed
            return self._capture_failed(sig, graph, exc, call)
        current.wait_stream(side)
        if self.max_segments is not None and graph.num_segments > self.max_segments:
            self.disabled_reason = (
                f"a capture produced {graph.num_segments} graph segments, more than "
                f"max_segments={self.max_segments}; graphs would cost more than they save"
            )
            graph.reset()
            logger.warning("bcg: runner disabled: %s", self.disabled_reason)
            return self.module(*call[0], **call[1])
        entry = Entry(
            graph=graph,
            statics=statics,
            fill=tuple(fill),
            scalars=scalars,
            output=output,
            static_call=(static_args, static_kwargs),
            keep_alive=identity_objects(*call),
            capture_runs=self.warmup_iters + 1,
            capture_ms=capture_ms,
            pool_bytes=graph.pool_bytes(),
        )
        self._counts["captures"] += 1
        self._entries[sig] = entry
        while len(self._entries) > self.max_entries:
            _, old = self._entries.popitem(last=False)
            self._turn.drain()  # its last replay may still run on some stream
            old.graph.reset()
            self._counts["evictions"] += 1
        # The capture executed the step (segments are launched as they are captured), so its
        # output holds this call's result: no replay is needed.
        result = output if self.return_views else entry.clone()
        self._turn.record(current)
        return result

    def _capture_failed(
        self, sig: Signature, graph: BreakableCUDAGraph, exc: Exception, call: Call
    ) -> Any:
        self._counts["failed"] += 1
        self._blocked[sig] = f"{type(exc).__name__}: {exc}"
        graph.reset()
        if self._owns_pool:
            # A capture that failed half-way can leave torch routing host allocations to the
            # pool; later captures start in a fresh one (the graphs already made keep theirs).
            self._pool = None
        logger.warning(
            "bcg: capture failed for the call with %s (%s: %s); this signature runs eagerly "
            "from now on",
            describe_signature(sig),
            type(exc).__name__,
            exc,
        )
        return self.module(*call[0], **call[1])

    def _replay(self, entry: Entry, live: list[torch.Tensor], values: list[Any]) -> Any:
        stream = self._graph_backend.current_stream(self.device)
        turn = self._turn
        # Static buffers and pool memory are free once the last use of the pool is done.
        turn.wait(stream)
        token = flag_on()
        try:
            entry.load(live, values)
            if self.replay_context is None:
                entry.graph.replay()
            else:
                with self.replay_context():
                    entry.graph.replay()
            out = entry.output if self.return_views else entry.clone()
        finally:
            flag_reset(token)
            turn.record(stream)
        entry.replays += 1
        return out

    def _diagnose_miss(self, sig: Signature) -> None:
        logged = self._logged_misses
        if sig in logged or len(logged) > MISS_LOG_LIMIT:
            return
        logged.add(sig)
        if len(logged) > MISS_LOG_LIMIT:
            logger.warning(
                "bcg: %s: further misses are not logged; stats.misses counts them",
                type(self).__name__,
            )
            return
        if sig in self._blocked:
            why = f"its capture failed earlier ({self._blocked[sig]})"
        else:
            why = describe_difference(sig, list(self._entries))
        logger.warning(
            "bcg: %s has no graph for this call and runs it eagerly (captures happen only in "
            "capture() or a warmup() window): %s",
            type(self).__name__,
            why,
        )


def _check_call(index: int, call: Any) -> Call:
    if (
        not isinstance(call, tuple)
        or len(call) != 2
        or not isinstance(call[0], tuple)
        or not isinstance(call[1], dict)
    ):
        raise TypeError(
            f"capture_many takes (args, kwargs) pairs, e.g. [((x,), {{}}), ((y,), {{'t': t}})]; "
            f"item {index} is {type(call).__name__}"
        )
    return call


def _call_bytes(call: Call) -> int:
    return sum(t.numel() * t.element_size() for t in _trees.tensor_leaves(call))
