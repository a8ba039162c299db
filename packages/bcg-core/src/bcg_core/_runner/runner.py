"""BreakableGraphRunner: capture once per call signature, replay on every later call."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal, NoReturn, SupportsIndex, TypeVar

import torch

from bcg_core import _trees
from bcg_core._backends import backend_for_device
from bcg_core._capture.capture import CAPTURE_ERROR_MODES
from bcg_core._capture.context import active_capture
from bcg_core._capture.flag import (
    breakable_graphs_disabled,
    disabled_reason,
    flag_on,
    flag_reset,
)
from bcg_core._capture.graph import BreakableCUDAGraph
from bcg_core._capture.modes import autocast_state
from bcg_core._capture.opaque import call_uncompiled
from bcg_core._diagnostics.divergence import runner_divergence
from bcg_core._diagnostics.divergence_report import DivergenceReport
from bcg_core._errors import ConcurrentCaptureError, capture_refusal_hint
from bcg_core._runner.calls import CALLS_EXAMPLE, Call, call_bytes, call_shapes, check_call
from bcg_core._runner.capture_entry import capture_entry
from bcg_core._runner.entry import Entry
from bcg_core._runner.misses import MissLog
from bcg_core._runner.overlap import OverlapCheck
from bcg_core._runner.pool import PoolTurn, share_turn
from bcg_core._runner.progress import capture_progress
from bcg_core._runner.scalars import ScalarSlots, parameters
from bcg_core._runner.stats import CaptureReport, EntryStats, GraphMemory, RunnerStats
from bcg_core._signature import (
    FlatGuard,
    Signature,
    describe_difference,
    describe_signature,
    object_tensors,
    signature_and_tensors,
    tensor_paths,
)
from bcg_core._trees import one_shot_iterator

logger = logging.getLogger("bcg_core")

BLOCKED_LIMIT = 256
"""Failed signatures a runner keeps blocked (the latest ones); see ``blocked_signatures``."""


# warmup() yields the runner itself: typed as the caller's own class, so a subclass's window
# (DiTRunner's, a user's) gives that subclass with no cast.
_Runner = TypeVar("_Runner", bound="BreakableGraphRunner")
_is_compiling = torch.compiler.is_compiling


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
    Keywords are keyed by name in any order, except those that land in the step's ``**kwargs``
    (which sees the call's order): a call passing two or more of them in another order than
    the capture runs eagerly (a miss, said once).

    **One pool.** Every signature captures into one memory pool, :attr:`pool`, so graphs reuse
    each other's intermediate memory and the runner costs about what its largest graph costs;
    capture the largest shape first (:meth:`capture_many` does). ``pool=other.pool`` shares a
    pool with another runner (or a graph's ``pool()``): runners sharing a pool share one lock
    and one device event, so their replays run one at a time, as graphs sharing a pool must.

    **Capture** happens only in :meth:`capture`, :meth:`capture_many` or inside a
    :meth:`warmup` window: ``warmup_iters`` eager runs on :attr:`stream`, then the capture on
    the same stream, both under :func:`enable_breakable_cuda_graph`. Capturing runs the step
    ``warmup_iters + 1`` times (``EntryStats.capture_runs``): the capture itself executes the
    step once and its output is returned (no replay after capture, unless a ``capture_stub``
    ran instead of a break: then one replay computes the call's result). Stateful inputs (a KV
    cache position) advance that often: capture at start-up, then reset them.

    **Serving.** A known signature is replayed: the call's inputs are written into the static
    buffers (one batched copy), the graph replays under the runtime flag (and inside
    ``replay_context()`` if given), and a clone of the output is returned (``return_views=True``
    returns the static output itself, valid until the next replay); an argument the step
    returns itself is returned as the caller's tensor, as eager does, and a view of one (in its
    dtype or another: ``x.view(torch.int32)``) as the same view of the caller's tensor (cloned
    where that tensor is not laid out as its contiguous buffer). Device order: a call's
    input copies wait on an event recorded after the previous use of the pool, on whatever
    stream that ran, and the clone is taken on the replay stream before the next event. An
    unknown signature runs eagerly and never captures; the first :data:`MISS_LOG_LIMIT`
    distinct misses are logged with the fields that differ from the nearest captured
    signature, later ones are only counted in :attr:`stats`.

    **Threads.** Captures use ``capture_error_mode="thread_local"`` by default (any of
    "global", "thread_local", "relaxed"): CUDA then refuses unsafe calls only on the capturing
    thread, so runners with their own pools can capture in several threads at once (in
    "global" mode one thread's capture makes another's allocation fail). A capture that fails
    while another thread was capturing is reported as spoiled by it (warning) and its
    signature is not blocked: a later capture retries it.

    **Arguments written in place.** A tensor argument in containers is copied into a static
    buffer at every call; when the captured step writes that buffer in place (its version
    counter moved during capture: a KV cache update, a position advanced with ``add_``), the
    buffer is copied back into the caller's tensor after every replay (and after the capture),
    so the caller sees what eager would have left there; so is a buffer that a break writes at a
    replay though it did not at capture, and what ran before a replay raised. Writes that bump
    no version counter (through ``.data``) are not seen. Tensors inside objects are used in
    place (keyed by address), never copied. A call where an argument the graph writes shares
    memory with another argument runs eagerly (a miss, warned once): separate buffers would not
    see the write through the other; so does, in grad mode, one where such an argument requires
    grad (eager raises for a leaf). A step that changes a container it is given
    (``state["out"] = y``, ``items.append(t)``) gets copies, and a replay runs no Python: its
    capture fails and its signature runs eagerly (return the value instead).

    **Inference.** Outputs of a replay (and of a capture) carry no autograd history (but an
    argument the step returns as itself is the caller's tensor, with its own history); a graph
    replays in the inference mode it was captured in, and its output is cloned in the
    caller's mode. A graph holds the wrapped module's ``train()``/``eval()`` mode of its
    capture (the module, a bound method's, or the one behind a ``functools.partial`` or
    ``torch.compile``; not one a lambda closes over): a call in the other mode runs eagerly (a
    miss, warned once). It reads parameters
    where they were at capture: update weights in place (``load_state_dict``, ``p.copy_``);
    after anything that rebinds them (``model.to(dtype)``, ``param.data = ...``), call
    :meth:`reset`.

    **Failure modes.** Breakable graphs disabled (``BCG_DISABLE=1`` or inside
    :func:`disable_breakable_graphs`): every call runs eagerly, announced once per runner. A
    capture that raises blocks its signature (eager from then on) with a warning naming it; a
    capture with more than ``max_segments`` segments disables the runner (eager for everything,
    reason in :attr:`disabled_reason`); beyond ``max_entries`` the least recently used entry is
    evicted (after its last replay finished on the device) and its graph's memory goes back to
    the pool. A call holding a one-shot iterator (a generator, ``map``, ``iter(list)``) is never
    captured, since warm-ups and capture would each consume it: it runs once, eagerly (a miss,
    warned once). With ``device="cuda"`` and no CUDA device every call runs eagerly, with a
    one-time notice; ``device="cpu"`` captures CPU graphs (the CPU backend of
    :class:`BreakableCUDAGraph`, with CUDA's capture rules). Attribute access falls through to
    the wrapped module. Calls are serialised by a lock: static buffers are shared state. A
    runner cannot be copied or pickled (``TypeError``): make a new one over the module.

    Args:
        module: the module or callable to stand in for.
        device: the device static buffers live on and graphs capture for (default
            ``"cuda"``; ``"cpu"`` uses the CPU graph backend); another device type raises.
        max_entries: captured signatures kept, >= 1 (default 8); beyond it the least recently
            used is evicted.
        max_segments: a capture with more segments disables the runner, >= 1 (default None:
            no limit).
        warmup_iters: eager runs before each capture, >= 0 (default 2).
        return_views: return the static output itself instead of a clone (default False); it
            is valid until the next replay (passed back as an argument the graph writes, the
            call runs eagerly).
        replay_context: a zero-argument callable returning a context manager each replay runs
            inside (default None).
        pool: a memory pool to share with another runner or graph (``runner.pool``,
            ``graph.pool()``); default None: the runner makes its own on first use.
        as_tensor: argument positions (int) and keyword names (str) whose Python numbers are
            passed as 0-dim tensors, so one graph serves every value (default: none).
        capture_error_mode: CUDA's capture mode for every capture, ``"thread_local"`` (the
            default: other threads may allocate and capture meanwhile), ``"global"`` or
            ``"relaxed"``.

    Raises:
        TypeError: ``module`` is not callable, ``max_entries``, ``max_segments`` or
            ``warmup_iters`` is not an int, ``return_views`` not a bool, ``replay_context``
            not callable, ``pool`` is a graph or a runner instead of a pool, or ``as_tensor``
            is a single name or holds something other than ints and strings.
        ValueError: ``max_entries``, ``max_segments`` or ``warmup_iters`` is out of range, an
            ``as_tensor`` position is negative, or ``device`` is of a type no graph backend
            captures (``"mps"``, ``"meta"``).
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
        capture_error_mode: str = "thread_local",
    ) -> None:
        if not callable(module):
            raise TypeError(
                f"{type(self).__name__} wraps a callable (a model or a step), got {module!r}"
            )
        # Counts are ints (1.5 and True were taken; "2" failed a comparison with a raw error).
        for what, count in (
            ("max_entries", max_entries),
            ("max_segments", max_segments),
            ("warmup_iters", warmup_iters),
        ):
            if (count is not None or what != "max_segments") and (
                isinstance(count, bool) or not isinstance(count, int)
            ):
                raise TypeError(f"{what} must be an int, got {count!r}")
        if not isinstance(return_views, bool):
            raise TypeError(f"return_views must be a bool, got {return_views!r}")
        if replay_context is not None and not callable(replay_context):
            raise TypeError(
                "replay_context takes a zero-argument callable returning a context manager, "
                f"got {replay_context!r}"
            )
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_segments is not None and max_segments < 1:
            raise ValueError(f"max_segments must be >= 1 or None, got {max_segments}")
        if warmup_iters < 0:
            raise ValueError(f"warmup_iters must be >= 0, got {warmup_iters}")
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(
                f"capture_error_mode must be one of {CAPTURE_ERROR_MODES}, "
                f"got {capture_error_mode!r}"
            )
        if isinstance(pool, (BreakableCUDAGraph, BreakableGraphRunner)):
            raise TypeError(
                f"pool= takes a memory pool, got a {type(pool).__name__}; pass its pool "
                "(runner.pool, or graph.pool())"
            )
        self.module = module
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:  # torch's own text names neither bcg nor a fix
            raise ValueError(
                f"BreakableGraphRunner's device must be a torch.device or a device string such "
                f"as 'cuda', 'cuda:0' or 'cpu', got {device!r} ({str(e).splitlines()[0]})"
            ) from None
        self.max_entries = max_entries
        self.max_segments = max_segments
        self.warmup_iters = warmup_iters
        self.return_views = return_views
        self.replay_context = replay_context
        self.capture_error_mode = capture_error_mode
        self.disabled_reason: str | None = None
        self._graph_backend = backend_for_device(self.device)
        # What a replay asks the current stream of: None for a device without an index (the
        # current one), which the backend reads in one C call instead of resolving the device.
        self._stream_device: torch.device | None = (
            self.device if self.device.index is not None else None
        )
        if pool is not None:
            self._graph_backend.check_pool(pool)
        self._pool = pool
        self._owns_pool = pool is None
        turn = PoolTurn(self._graph_backend)
        self._turn = turn if pool is None else share_turn(pool, turn)
        self._lock = self._turn.lock
        self._scalars = ScalarSlots(as_tensor, module)
        self._lift = self._scalars.lift if self._scalars else None
        self._window = 0
        self._discard_outputs = False  # capture_many: no clone of outputs nobody reads
        self._warned_autocast = False
        self._warned_training = False
        # The module whose train()/eval() mode a graph holds (dropout, batch-norm statistics):
        # a call in the other mode runs eagerly.
        self._mode_module = _mode_module(module)
        # The names a keyword argument binds to by name; the others land in the step's
        # **kwargs, a dict in the call's order, which the signature (keywords by name) ignores.
        # None: the step takes no **kwargs, so keyword order never matters.
        self._named_keywords = _named_keywords(module)
        self._last_failure: tuple[Signature, str] | None = None  # set by _capture_failed
        # Why the last call of a captured signature ran eagerly (set by the refusals, read by
        # capture_many's report: only the refusal knows which rule it applied).
        self._refused_why: str | None = None
        self._entries: OrderedDict[Signature, Entry] = OrderedDict()
        # The last hit's guard, signature and entry (see _guard_last).
        self._last: tuple[FlatGuard, Signature, Entry] | None = None
        self._blocked: dict[Signature, str] = {}
        self._misses = MissLog(type(self).__name__)
        self._no_cuda_noticed = False
        self._disabled_noticed = False
        self._counts = {"hits": 0, "misses": 0, "captures": 0, "failed": 0, "evictions": 0}

    # -- the module stand-in ------------------------------------------------------------------

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # copy.copy, copy.deepcopy and pickle all come here. A shallow copy shared the entries
        # and pool with the original, and replayed graphs the original had reset (ReplayError);
        # a deep copy or a pickle failed on the lock ("cannot pickle '_thread.RLock' object").
        raise TypeError(
            f"a {type(self).__name__} cannot be copied or pickled: its graphs, static buffers "
            "and pool belong to this object. Make a new runner over the module (a copy of it "
            "if needed) and capture again; copy or save the module itself, not the runner"
        )

    def __getattr__(self, name: str) -> Any:
        # Only called for names the runner itself lacks; never recurse before __init__ ran.
        if name == "module" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module: replay the graph captured for this call's signature.

        An unknown signature is captured inside a :meth:`warmup` window, else run eagerly;
        with graphs disabled or unavailable every call runs eagerly (see the class docstring).

        Args:
            *args: positional arguments for the module.
            **kwargs: keyword arguments for the module.

        Returns:
            The module's output: a clone of the static output on a replay (the static output
            itself with ``return_views=True``; an argument the step returns is the caller's
            tensor), or the eager result.

        Raises:
            BreakOutputError: at replay, a break returned other tensors or plain values than at
                capture.
            Exception: whatever the module raises on an eager run (a failed capture does not
                raise: its signature is blocked and the call runs eagerly).
        """
        if _is_compiling():  # dynamo folds this to True while tracing; False at run time
            # Called from code torch.compile traces (generate()'s auto-compile of a model whose
            # forward calls the runner): a graph break, and the runner runs uncompiled. Traced,
            # its lock broke the frame and dynamo compiled the step's frames under it, so every
            # capture failed ("attempted to set_stance in a torch.compile region").
            return call_uncompiled(self.__call__, args, kwargs)
        with self._lock:
            # serves_eagerly, tested here, not through the property: each frame before the
            # launch delays the replay.
            if (
                self.disabled_reason is not None
                or breakable_graphs_disabled()
                or not self._graph_backend.is_available()
            ):
                self._announce_eager()
                self._counts["misses"] += 1  # a hit rate must not read 100% while nothing replays
                return self.module(*args, **kwargs)
            if self._turn.busy is not None:
                # A break of this runner's replay or capture, or of another runner's on the same
                # pool, calling it: an eager run, not a graph of the pool half-way through
                # another; a miss (as inside another capture), so every call is counted once.
                return self._eager_miss(
                    "a break of a replay or capture in this runner's pool (its own or a runner "
                    "sharing the pool) called it",
                    (args, kwargs),
                )
            if active_capture() is not None:
                return self._inside_capture(args, kwargs)
            values: list[bool | int | float] = []
            if self._lift is None:
                call_args, call_kwargs = args, kwargs
            else:
                call_args, call_kwargs, values = self._lift(args, kwargs)
            last = self._last
            guarded = None if last is None else last[0].match(call_args, call_kwargs)
            entry: Entry | None
            if last is not None and guarded is not None:
                _, sig, entry = last
                live = guarded
            else:
                sig, live = signature_and_tensors(call_args, call_kwargs)
                entry = self._entries.get(sig)
            if entry is not None:
                if (
                    entry.objects
                    and (stale := entry.stale_object(call_args, call_kwargs)) is not None
                ):
                    return self._stale_object(stale, (args, kwargs))
                if entry.keywords is not None and self._keyword_order(kwargs) != entry.keywords:
                    return self._other_keyword_order((args, kwargs))
                if entry.written and (pair := entry.overlap.find(live)) is not None:
                    return self._refuse(sig, live, pair, (args, kwargs))
                if entry.written and torch.is_grad_enabled() and entry.writes_grad(live):
                    return self._grad_written((args, kwargs))
                if (
                    torch._C._is_any_autocast_enabled() or entry.autocast is not None
                ) and autocast_state() != entry.autocast:
                    return self._other_autocast(entry, (args, kwargs))
                if (
                    entry.training is not None
                    and (mode := self._mode_module) is not None
                    and mode.training is not entry.training
                ):
                    return self._other_training(entry, (args, kwargs))
                replays = entry.replays
                try:
                    return self._replay(entry, live, values)
                finally:
                    # Bookkeeping after the launch: a call starts with the host behind the device.
                    if entry.replays > replays:  # a replay that raised served nothing
                        self._counts["hits"] += 1
                    if sig in self._entries:  # a break may have re-entered and evicted it
                        self._entries.move_to_end(sig)
                        if guarded is None:
                            self._guard_last(sig, entry, call_args, call_kwargs)
            if sig not in self._blocked and self._window > 0:
                return self._capture(sig, (args, kwargs), (call_args, call_kwargs), live, values)
            self._counts["misses"] += 1
            self._misses.note(sig, self._blocked, self._entries)
            return self.module(*args, **kwargs)

    # -- capture control ----------------------------------------------------------------------

    def capture(self, *args: Any, **kwargs: Any) -> Any:
        """Capture the graph for this call's signature and return the call's output.

        Runs the step ``warmup_iters + 1`` times (warm-ups, then the capture, whose output is
        returned); once when the signature is already captured (a replay) or cannot be
        captured (blocked, graphs disabled, no CUDA: one eager run). A capture that raises
        blocks the signature, logs a warning, and the call runs eagerly instead. A call whose
        argument the step writes overlaps another argument (or is expanded, or requires grad)
        is captured, then its graph is dropped and the call runs once more, eagerly (a miss,
        logged once; :meth:`capture_many` lists it as failed): capture with separate tensors.

        Args:
            *args: positional arguments for the module, as in a call.
            **kwargs: keyword arguments for the module.

        Returns:
            The call's output (a clone of the static output unless ``return_views=True``; an
            argument the step returns is the caller's tensor).
        """
        if _is_compiling():  # as in __call__: a graph break where torch.compile traces it
            return call_uncompiled(self.capture, args, kwargs)
        with self.warmup():
            return self(*args, **kwargs)

    def capture_many(
        self,
        calls: Iterable[Call],
        *,
        order: Literal["largest_first", "given"] = "largest_first",
        progress: bool | None = None,
    ) -> CaptureReport:
        """Capture one graph per call, as engines do at start-up.

        ``order="largest_first"`` captures in decreasing total bytes of the call's tensors (ties
        keep the given order): a graph captured later into the shared pool reuses the memory
        that larger graphs freed during their capture, so the pool ends up the size of the
        largest graph. Outputs are not kept (use :meth:`capture` for one). Beyond
        ``max_entries`` (default 8) the least recently used entries are evicted as usual, with a
        warning: an engine passes ``max_entries`` >= its number of shapes. Calls already
        captured are replayed once and not reported again.

        Args:
            calls: ``(args, kwargs)`` pairs, an args tuple and a kwargs dict each.
            order: ``"largest_first"`` (the default) or ``"given"`` (keep the given order).
            progress: a progress bar on stderr (tqdm, else rich, when installed); None (the
                default) shows it when stderr is a terminal.

        Returns:
            A :class:`CaptureReport`: per size its capture and warm-up ms, segments, breaks and
            pool bytes after; the sizes that were not captured and why (a capture that raised,
            a runner disabled by ``max_segments`` or ``BCG_DISABLE``, no device); the memory
            the runner holds.

        Raises:
            ValueError: ``order`` has another value.
            TypeError: an item of ``calls`` is not an ``(args_tuple, kwargs_dict)`` pair
                (checked before anything is captured).
        """
        if order not in ("largest_first", "given"):
            raise ValueError(f"order must be 'largest_first' or 'given', got {order!r}")
        if not isinstance(calls, Iterable):
            raise TypeError(f"capture_many takes a list of {CALLS_EXAMPLE}, got {calls!r}")
        checked = [check_call(i, c) for i, c in enumerate(calls)]
        if order == "largest_first":
            checked.sort(key=call_bytes, reverse=True)  # stable: ties keep the given order
        started = time.perf_counter()
        evictions = self._counts["evictions"]
        captured: list[EntryStats] = []
        failed: list[tuple[Signature, str]] = []
        with self.warmup(), capture_progress(len(checked), progress) as advance:
            for args, kwargs in checked:
                with self._lock:
                    c = self._counts
                    before = (c["captures"], c["failed"], c["hits"])
                    self._discard_outputs = True
                    self._refused_why = None
                    try:
                        self(*args, **kwargs)
                    finally:
                        self._discard_outputs = False
                    if self._counts["captures"] > before[0]:
                        sig = next(reversed(self._entries))
                        captured.append(self._entry_stats(sig, self._entries[sig]))
                    elif self._counts["failed"] > before[1]:
                        assert self._last_failure is not None  # what _capture_failed counted
                        failed.append(self._last_failure)
                    elif self._counts["hits"] == before[2]:  # not a replay of a captured call
                        # (Counted, not looked up: a subclass may take a keyword out of the
                        # signature, as DiTRunner does return_dict.)
                        failed.append(self._not_captured(args, kwargs))
                advance(call_shapes(args, kwargs))
        seconds = time.perf_counter() - started
        if self._counts["evictions"] > evictions:
            logger.warning(
                "bcg: capture_many evicted %d graph(s) it had just captured (max_entries=%d); "
                "pass max_entries >= the number of shapes to keep them all",
                self._counts["evictions"] - evictions,
                self.max_entries,
            )
        return CaptureReport(tuple(captured), tuple(failed), seconds, self.graph_memory())

    def graph_memory(self) -> GraphMemory:
        """The device memory this runner's graphs hold now.

        Measure it after the start-up captures and give the rest of the device to the KV cache.
        Waits for nothing; the pool's figure is what the allocator reserved in the captures and
        warm-ups into it (see :meth:`BreakableCUDAGraph.pool_bytes`).

        Returns:
            A :class:`GraphMemory` (pool, static buffers, bridges outside the pool).
        """
        with self._lock:
            backend = self._graph_backend
            # Entries captured before a failed capture keep the pool they were captured into.
            pools = {id(e.graph.pool()): e.graph.pool() for e in self._entries.values()}
            if self._pool is not None:
                pools.setdefault(id(self._pool), self._pool)
            sizes = [backend.pool_bytes(p) for p in pools.values()]
            pool_bytes = None if None in sizes else sum(n for n in sizes if n is not None)
            statics: dict[int, int] = {}
            bridges: dict[int, int] = {}
            for entry in self._entries.values():
                for t in (*entry.statics, *entry.scalars):
                    _note_storage(statics, t)
                for t in entry.graph._bridge_tensors_outside_pool():
                    _note_storage(bridges, t)  # pooled bridges are counted in the pool
            # A break returning its argument bridges the static buffer itself: counted once.
            outside = sum(n for ptr, n in bridges.items() if ptr not in statics)
            return GraphMemory(pool_bytes, sum(statics.values()), outside)

    @contextlib.contextmanager
    def warmup(self: _Runner) -> Iterator[_Runner]:
        """Context manager: a window in which calls with unknown signatures are captured.

        The window belongs to the runner, not to the thread: while one is open, every caller's
        unknown signatures are captured. Windows nest.

        Yields:
            This runner.
        """
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

        Raises:
            RuntimeError: called from a break of this runner's own replay or capture (nothing
                is reset then).
        """
        with self._lock:
            if self._turn.busy is self:
                # A break of this runner's own replay or capture: the graph running now would
                # be reset under it.
                raise RuntimeError(
                    f"{type(self).__name__}.reset() was called from a break of its own replay "
                    "or capture; call it after the runner's call has returned"
                )
            self._turn.drain()
            for entry in self._entries.values():
                entry.graph.reset()
            self._entries.clear()
            self._last = None
            self._blocked.clear()
            self._misses.clear()
            self.disabled_reason = self._disabled_after_reset()
            self._counts = dict.fromkeys(self._counts, 0)
            if self._owns_pool:
                self._pool = None

    def _disabled_after_reset(self) -> str | None:
        """Why the runner stays disabled after :meth:`reset` (None: it is enabled again); set
        under the lock, in the same step as the reset, so no call of another thread gets in
        between."""
        return None

    @property
    def pool(self) -> Any:
        """The memory pool every graph of this runner captures into.

        Made on first use (or the one given as ``pool=``); pass it as ``pool=`` to another
        runner or graph to share it.

        Raises:
            CaptureError: the runner's backend cannot capture (``device="cuda"`` without CUDA).
        """
        with self._lock:
            if self._pool is None:
                self._graph_backend.check_available()
                self._pool = self._graph_backend.new_pool()
                share_turn(self._pool, self._turn)
            return self._pool

    @property
    def stream(self) -> Any:
        """The stream warm-ups and captures run on: the capture lane of :attr:`pool`.

        A stream only captures into that pool use, whose cuBLAS workspace lives in memory of its
        own (see :class:`BreakableCUDAGraphCapture`); made with the pool on first use.

        Raises:
            CaptureError: the runner's backend cannot capture (``device="cuda"`` without CUDA).
        """
        with self._lock:
            return self._graph_backend.capture_stream(self.pool, self.device)

    def check_divergence(self, *args: Any, **kwargs: Any) -> DivergenceReport:
        """Compare eager and replay for this call on the graph captured for its signature.

        Bitwise, seed 0 (see :func:`bcg_core.check_divergence`); use it before serving, with
        inputs other than the capture's. The check writes the inputs into the entry's static
        buffers and replays its graph, ordered with the pool's other replays.

        Args:
            *args: positional arguments of the call to check.
            **kwargs: keyword arguments of the call to check.

        Returns:
            A :class:`DivergenceReport` for this one input set.

        Raises:
            ValueError: no graph is captured for the call's signature (the message says which
                fields differ from the nearest captured one).
            RuntimeError: called from a break of a replay or capture in this runner's pool (its
                own or a runner's sharing the pool); nothing is checked then.
        """
        with self._lock:
            if self._turn.busy is not None:
                # The check loads its inputs into the static buffers and replays the graph: from
                # a break of that graph's replay, the rest of the replay computed with the
                # check's inputs and returned that silently (and another graph of the pool
                # would overwrite memory the running one still reads).
                raise RuntimeError(
                    f"{type(self).__name__}.check_divergence() was called from a break of a "
                    "replay or capture in this runner's pool (its own or a runner's sharing the "
                    "pool); call it after that call has returned"
                )
            sig, live, values = self._signature_of(args, kwargs)
            entry = self._entries.get(sig)
            if entry is None:
                why = describe_difference(sig, list(self._entries))
                raise ValueError(f"no graph is captured for this call's signature: {why}")

            def load() -> tuple[tuple[Any, ...], dict[str, Any]]:
                entry.load(live, values)
                return entry.static_call

            # Ordered with the pool's replays on other streams, as a call is; in the capture's
            # inference mode, as a replay is; a break calling this runner runs eagerly, as in
            # a replay (replaying the graph inside its own check would overwrite its buffers).
            stream = self._graph_backend.current_stream(self._stream_device)
            self._turn.wait(stream)
            self._turn.busy = self
            try:
                with _capture_mode(entry.inference):
                    return runner_divergence(
                        self.module, entry.graph, entry.output, load, self.replay_context
                    )
            finally:
                self._turn.busy = None
                self._turn.record(stream)

    @property
    def stats(self) -> RunnerStats:
        """A snapshot of the counters and of every captured entry (see :class:`RunnerStats`)."""
        with self._lock:
            entries = tuple(self._entry_stats(sig, e) for sig, e in self._entries.items())
            c = self._counts
            return RunnerStats(
                c["hits"], c["misses"], c["captures"], c["failed"], c["evictions"], entries
            )

    @property
    def serves_eagerly(self) -> bool:
        """Whether every call runs eagerly now, whatever its signature.

        True when the runner disabled itself (:attr:`disabled_reason`), breakable graphs are
        disabled in this context (``BCG_DISABLE``, :func:`disable_breakable_graphs`), or its
        backend cannot capture on this machine (``device="cuda"`` without CUDA).
        """
        return (
            self.disabled_reason is not None
            or breakable_graphs_disabled()
            or not self._graph_backend.is_available()
        )

    @property
    def blocked_signatures(self) -> dict[Signature, str]:
        """Signatures whose capture failed, with the reason; they run eagerly.

        The latest 256 are kept: an older one is captured again at its next call in a capture
        window, and blocked again if that capture fails too."""
        with self._lock:
            return dict(self._blocked)

    # -- internals ----------------------------------------------------------------------------

    @staticmethod
    def _entry_stats(sig: Signature, e: Entry) -> EntryStats:
        return EntryStats(
            sig,
            e.graph.num_segments,
            e.graph.num_breaks,
            e.pool_bytes,
            e.replays,
            e.capture_runs,
            e.graph.pool(),
            e.capture_ms,
            e.warmup_ms,
        )

    def _announce_eager(self) -> None:
        """Say once why this runner runs every call eagerly (a call found it cannot graph)."""
        if self.disabled_reason is not None:
            return  # said when the runner disabled itself
        if breakable_graphs_disabled():
            if not self._disabled_noticed:
                self._disabled_noticed = True
                logger.warning(
                    "bcg: breakable graphs are disabled (%s); %s runs every call eagerly",
                    disabled_reason(),
                    type(self).__name__,
                )
        elif not self._no_cuda_noticed:
            self._no_cuda_noticed = True
            logger.warning(
                "bcg: no CUDA device is available; %s runs eagerly (no graphs are captured). "
                "To capture CPU graphs of CPU tensors without a GPU (CUDA's capture rules), "
                'pass device="cpu"',
                type(self).__name__,
            )

    def _capture(
        self,
        sig: Signature,
        call: Call,
        lifted: Call,
        live: list[torch.Tensor],
        values: list[Any],
    ) -> Any:
        iterator = one_shot_iterator(*call)
        if iterator is not None:
            # Warm-ups and the capture would each run the step on it: the capture (whose output
            # this call returns) computed with it exhausted. Run once, eagerly, as given.
            where, kind = iterator
            self._misses.refused(
                "one-shot iterator",
                f"{where} of this call is a {kind.__name__} (a one-shot iterator): a capture "
                "runs the step several times, each consuming it, so such calls run eagerly; "
                "pass a list or tuple to capture the call",
            )
            return self._eager_miss(
                f"{where} is a one-shot iterator (a capture runs the step several times): pass "
                "a list or tuple",
                call,
            )
        backend = self._graph_backend
        current = backend.current_stream(self.device)
        # The pool, the warm-ups and the capture use the current device (its lane): made so in
        # the context of the runner's device's stream (on CUDA, entering a stream's context
        # makes its device current). With another device current, a runner on cuda:1 captured
        # on cuda:0's lane, its kernels went uncaptured to cuda:1's stream, and every replay
        # returned the capture's output.
        with backend.stream_context(current):
            pool, lane = self.pool, self.stream
        self._turn.busy = self
        entry: Entry | None = None
        try:
            with backend.stream_context(current):
                entry = capture_entry(
                    self.module,
                    call,
                    lifted,
                    live,
                    values,
                    backend=backend,
                    device=self.device,
                    pool=pool,
                    lane=lane,
                    turn=self._turn,
                    scalars=self._scalars,
                    warmups=self.warmup_iters,
                    capture_error_mode=self.capture_error_mode,
                )
        except BaseException as exc:
            self._turn.busy = None
            if self._owns_pool:
                # A capture that failed half-way can leave torch routing host allocations to
                # the pool; later captures start in a fresh one (the graphs made keep theirs).
                self._pool = None
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: the pool rule kept, the signature not blamed
            self._capture_failed(sig, exc)
        if entry is None:
            # Served eagerly only here, past the except block: the error's traceback holds the
            # failed capture's frames (its graph, pool and static buffers), which the eager run
            # would otherwise keep alive, a second copy of the step's memory at its peak.
            return self.module(*call[0], **call[1])
        self._turn.busy = None
        if self._mode_module is not None:
            entry.training = self._mode_module.training
        entry.keywords = self._keyword_order(call[1])
        graph = entry.graph
        if self.return_views and entry.written:
            # The caller holds the static output: passed back as an argument the graph writes
            # (h = runner(h)), the copy-back after the replay overwrote the output it returns
            # with the argument's new values. Such a call runs eagerly, as one overlapping
            # another argument does. (An output that is a static input buffer, the argument
            # returned, passed back as that argument is its own buffer: nothing is copied.)
            statics = {t.untyped_storage().data_ptr() for t in entry.statics}
            outputs = [
                t
                for t in _trees.tensor_leaves(entry.output)
                if t.numel() and t.untyped_storage().data_ptr() not in statics
            ]
            entry.overlap = OverlapCheck(entry.written, [*object_tensors(*lifted), *outputs])
        pair = entry.overlap.find(live)
        if pair is not None:
            # The capture ran on separate buffers: its result is not what eager gives. The
            # caller's tensors are untouched (nothing was copied back), so eager runs cleanly.
            graph.reset()
            return self._refuse(sig, live, pair, call)
        if torch.is_grad_enabled() and entry.writes_grad(live):
            graph.reset()  # its runs wrote static buffers only: eager runs cleanly
            return self._grad_written(call)
        if self.max_segments is not None and graph.num_segments > self.max_segments:
            self.disabled_reason = (
                f"a capture produced {graph.num_segments} graph segments, more than "
                f"max_segments={self.max_segments}; graphs would cost more than they save"
            )
            graph.reset()
            logger.warning("bcg: runner disabled: %s", self.disabled_reason)
            self._counts["misses"] += 1  # served eagerly, as every call from now on
            return self.module(*call[0], **call[1])
        self._counts["captures"] += 1
        self._entries[sig] = entry
        while len(self._entries) > self.max_entries:
            _, old = self._entries.popitem(last=False)
            self._last = None
            self._turn.drain()  # its last replay may still run on some stream
            old.graph.reset()
            self._counts["evictions"] += 1
        # The capture executed the step (segments are launched as they are captured), so its
        # output holds this call's result: no replay is needed.
        entry.store(live)
        # (A clone capture_many discards would stay cached outside the pool.)
        if self._discard_outputs:
            result = entry.output
        elif entry.returned:
            result = entry.output_for(live, self.return_views)
        else:
            result = entry.output if self.return_views else entry.clone()
        self._turn.record(current)
        return result

    def _signature_of(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Signature, list[torch.Tensor], list[bool | int | float]]:
        """A call's signature, its tensors in containers and its lifted numbers, as a call
        computes them (``__call__`` does it inline: each frame before the launch delays it)."""
        if self._lift is None:
            return (*signature_and_tensors(args, kwargs), [])
        call_args, call_kwargs, values = self._lift(args, kwargs)
        return (*signature_and_tensors(call_args, call_kwargs), values)

    def _not_captured(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Signature, str]:
        """Why a call in a capture window that neither captured, failed nor replayed ran
        eagerly (for :meth:`capture_many`'s report)."""
        sig = self._signature_of(args, kwargs)[0]
        if self.disabled_reason is not None:
            why = f"the runner is disabled: {self.disabled_reason}"
        elif breakable_graphs_disabled():
            why = f"breakable graphs are disabled ({disabled_reason()})"
        elif not self._graph_backend.is_available():
            why = f"the {self.device.type} graph backend is not available"
        elif active_capture() is not None:
            why = "a breakable capture is open around capture_many"
        elif self._refused_why is not None:
            why = self._refused_why
        elif sig in self._blocked:
            why = f"its capture failed earlier ({self._blocked[sig]})"
        else:
            why = "an argument the graph writes shares memory with another argument or object"
        return sig, why

    def _capture_failed(self, sig: Signature, exc: Exception) -> None:
        """Count and report a failed capture and block its signature; the caller runs the call
        eagerly."""
        self._counts["failed"] += 1
        hint = capture_refusal_hint(exc)
        why = f"{type(exc).__name__}: {exc}" + ("" if hint is None else f" [{hint}]")
        self._last_failure = (sig, why)
        if isinstance(exc, ConcurrentCaptureError):
            # Not this signature's fault: a later capture (in a warmup window) retries it.
            logger.warning(
                "bcg: capture for signature %s was spoiled by another thread's capture (%s); "
                "this call runs eagerly and the signature is not blocked",
                sig,
                exc,
            )
            return
        # Bounded: a serving loop failing at every new shape kept each signature (and the classes
        # in it) until reset(). The oldest is forgotten; its next capture call tries it again.
        if len(self._blocked) >= BLOCKED_LIMIT:
            del self._blocked[next(iter(self._blocked))]
        self._blocked[sig] = why
        logger.warning(
            "bcg: capture failed for the call with %s (%s); this signature runs eagerly "
            "from now on",
            describe_signature(sig),
            why,
        )

    def _eager_miss(self, why: str, call: Call) -> Any:
        """Run ``call`` eagerly as a miss; ``why`` is what :meth:`capture_many` reports."""
        self._counts["misses"] += 1
        self._refused_why = why
        return self.module(*call[0], **call[1])

    def _refuse(
        self, sig: Signature, live: list[torch.Tensor], pair: tuple[int, int], call: Call
    ) -> Any:
        """Run eagerly a call whose written argument shares memory with another argument or a
        tensor inside an object argument (see ``overlap.py``): a miss, said once."""
        paths = tensor_paths(sig)
        i, j = pair
        inside = tensor_paths(sig, "tensor@")
        if j < len(live):
            other = paths[j]
        elif j - len(live) < len(inside):
            other = inside[j - len(live)]
        else:
            other = "the static output an earlier call returned (return_views=True)"
        shared = (
            f"{paths[i]} of this call is expanded (several of its elements at one address)"
            if j == i
            else f"{paths[i]} and {other} of this call share memory"
        )
        self._misses.refused(
            "overlap",
            f"{shared} and the captured step writes "
            f"{paths[i]} in place; the runner copies each argument into a buffer of its own, "
            "so such calls run eagerly: pass tensors that do not overlap (clone one) to replay "
            "the graph",
        )
        return self._eager_miss(
            "an argument the graph writes shares memory with another argument or object",
            call,
        )

    def _grad_written(self, call: Call) -> Any:
        """Run eagerly, in grad mode, a call whose argument that the graph writes in place
        requires grad: eager raises for a leaf and records the write for another tensor,
        where a replay would write it silently without history (a miss, said once)."""
        self._misses.refused(
            "written argument requires grad",
            "an argument that the captured step writes in place requires grad and grad mode is "
            "on: eager raises for a leaf (or records the write), a replay would write it "
            "silently, so such calls run eagerly; call under torch.no_grad() or "
            "torch.inference_mode(), or pass a tensor that does not require grad (detach it), "
            "to replay the graph",
        )
        return self._eager_miss(
            "an argument the graph writes in place requires grad (grad mode is on)", call
        )

    def _inside_capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run eagerly a call made while a breakable capture is open in this context (this
        runner for a submodule of a step captured whole, by hand or by another runner): its
        ops belong to that capture. A replay there is refused (ReplayError, failing that
        capture) and a capture would fail and block the signature for good."""
        self._counts["misses"] += 1
        self._misses.refused(
            "inside a capture",
            "called while a breakable capture is open (a step captured whole around this "
            "runner): it runs its module eagerly, into that capture",
        )
        return self.module(*args, **kwargs)

    def _stale_object(self, stale: Any, call: Call) -> Any:
        """Run eagerly a call that passes another object than the capture's, equal to what the
        capture's was, while the capture's one has changed since: the graph's breaks read the
        capture's object (a miss, said once)."""
        self._misses.refused(
            "stale object",
            f"the graph for this call's signature was captured with another "
            f"{type(stale).__qualname__} object argument, which has changed since the capture; "
            "the graph reads that object at every replay, not the one passed now, so such calls "
            "run eagerly: pass the object the graph was captured with (update it in place), or "
            "leave the captured one unchanged",
        )
        return self._eager_miss(
            f"its graph reads another {type(stale).__qualname__} object argument, changed "
            "since the capture",
            call,
        )

    def _keyword_order(self, kwargs: dict[str, Any]) -> tuple[str, ...] | None:
        """The order of the keywords a call passes into the step's ``**kwargs``, when two or
        more land there (a step iterating them computes in that order); else None."""
        named = self._named_keywords
        if named is None or len(kwargs) < 2:
            return None
        free = tuple(name for name in kwargs if name not in named)
        return free if len(free) > 1 else None

    def _other_keyword_order(self, call: Call) -> Any:
        """Run eagerly a call passing the keywords the step's ``**kwargs`` receives in another
        order than the capture: its graph computed in the capture's order (a miss, said
        once)."""
        self._misses.refused(
            "keyword order",
            "this call passes the keywords that the step receives in its **kwargs in another "
            "order than its graph's capture did; the signature keys keywords by name, but the "
            "step sees them in the call's order (a graph of one order replayed for the other "
            "computed in the capture's order), so such calls run eagerly: pass them in one "
            "order",
        )
        return self._eager_miss(
            "it passes the keywords of the step's **kwargs in another order than the capture",
            call,
        )

    def _other_autocast(self, entry: Entry, call: Call) -> Any:
        """Run eagerly a call under another autocast state than its graph's capture: the
        graph's kernels are the ones autocast chose then (a miss, warned once)."""
        if not self._warned_autocast:
            self._warned_autocast = True
            logger.warning(
                "bcg: %s's graph for this call was captured with autocast %s and the call runs "
                "with autocast %s: it runs eagerly. Capture and call under the same autocast "
                "(or use one runner per autocast setting).",
                type(self).__name__,
                "off" if entry.autocast is None else entry.autocast,
                "off" if (now := autocast_state()) is None else now,
            )
        return self._eager_miss(
            "its signature's graph was captured under another autocast state (one runner per "
            "autocast setting)",
            call,
        )

    def _other_training(self, entry: Entry, call: Call) -> Any:
        """Run eagerly a call made in the other train()/eval() mode than its graph's capture:
        the graph holds the capture's mode (dropout on or off, batch-norm statistics used or
        updated), a miss warned once."""
        if not self._warned_training:
            self._warned_training = True
            mode = {True: "train()", False: "eval()"}
            logger.warning(
                "bcg: %s's graph for this call was captured in %s mode and the module is now in "
                "%s mode: it runs eagerly. Capture in the mode you serve in (usually eval()), "
                "or call reset() after switching.",
                type(self).__name__,
                mode[bool(entry.training)],
                mode[not entry.training],
            )
        return self._eager_miss(
            "its signature's graph was captured in the other train()/eval() mode (call "
            "reset() after switching)",
            call,
        )

    def _replay(self, entry: Entry, live: list[torch.Tensor], values: list[Any]) -> Any:
        stream = self._graph_backend.current_stream(self._stream_device)
        turn = self._turn
        # Static buffers and pool memory are free once the last use of the pool is done.
        turn.wait(stream)
        token = flag_on()
        self._turn.busy = self
        # The graph runs in the capture's inference mode: its bridges and what its breaks read
        # are inference tensors or not as at capture, and writing them in the other mode
        # raises. Written arguments are copied back and the output cloned in the caller's
        # mode. (Entered by hand, not in a `with` frame: a replay in the capture's mode pays
        # one test.)
        mode = (
            None
            if torch.is_inference_mode_enabled() is entry.inference
            else _capture_mode(entry.inference)
        )
        versions: list[int] | None = None
        launched = False
        try:
            try:
                if mode is not None:
                    mode.__enter__()
                try:
                    entry.load(live, values)
                    if entry.watched:
                        versions = entry.watched_versions()
                    launched = True
                    if self.replay_context is None:
                        entry.graph.replay()
                    else:
                        with self.replay_context():
                            entry.graph.replay()
                finally:
                    if mode is not None:
                        mode.__exit__(None, None, None)
            except BaseException:
                # The steps that ran wrote what eager would have left in the arguments (not
                # after a load that raised: the buffers then hold another call's values).
                if launched:
                    with contextlib.suppress(Exception):
                        entry.store(live, versions)
                raise
            entry.store(live, versions)
            if entry.returned:
                out = entry.output_for(live, self.return_views)
            else:
                out = entry.output if self.return_views else entry.clone()
        finally:
            self._turn.busy = None
            flag_reset(token)
            turn.record(stream)
        entry.replays += 1
        return out

    def _guard_last(
        self, sig: Signature, entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Keep a :class:`FlatGuard` of this hit, so that a call repeating it skips building
        and hashing its signature. Dropped whenever an entry leaves ``_entries``."""
        guard = FlatGuard.of(args, kwargs)
        self._last = None if guard is None else (guard, sig, entry)


@contextlib.contextmanager
def _capture_mode(inference: bool) -> Iterator[None]:
    """Inference mode as at capture, grad mode as the caller's (leaving inference mode would
    turn grad mode on, and breaks would record autograd)."""
    grad = torch.is_grad_enabled()
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        yield


def _note_storage(seen: dict[int, int], t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    seen.setdefault(storage.data_ptr(), storage.nbytes())


def _named_keywords(module: Any) -> frozenset[str] | None:
    """The parameter names a keyword argument of ``module`` binds to by name when it takes
    ``**kwargs`` (other keywords land there, in the call's order); None when it takes none.
    A callable whose signature cannot be read may take any keyword into ``**kwargs``."""
    params = parameters(module)
    if params is None:
        return frozenset()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params if p.kind in by_name)


def _mode_module(module: Any) -> torch.nn.Module | None:
    """The ``nn.Module`` whose ``training`` flag a call of ``module`` runs in: the module itself
    (the module torch.compile wrapped, whose flag ``model.eval()`` sets), the module a bound
    method belongs to, or the one behind a ``functools.partial`` or a torch.compile'd function
    (``torch.compile(model.decode)``: both hid a bound method, and a graph captured in
    ``eval()`` replayed without dropout after ``model.train()``); None for other callables."""
    seen: set[int] = set()
    while id(module) not in seen:
        seen.add(id(module))
        if isinstance(module, torch.nn.Module):
            inner = getattr(module, "_orig_mod", module)
            return inner if isinstance(inner, torch.nn.Module) else module
        if isinstance(module, functools.partial):
            module = module.func
        elif (owner := getattr(module, "__self__", None)) is not None:
            module = owner
        else:
            module = getattr(module, "_torchdynamo_orig_callable", None)
            if module is None:
                return None
    return None
