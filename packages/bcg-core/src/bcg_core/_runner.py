"""BreakableGraphRunner: capture once per call signature, replay on every later call."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from bcg_core import _trees
from bcg_core._backends import backend_for
from bcg_core._capture import BreakableCUDAGraphCapture
from bcg_core._divergence import runner_divergence
from bcg_core._divergence_report import DivergenceReport
from bcg_core._flag import enable_breakable_cuda_graph
from bcg_core._graph import BreakableCUDAGraph
from bcg_core._signature import (
    Signature,
    describe_difference,
    identity_objects,
    signature_and_tensors,
    static_call,
)

logger = logging.getLogger("bcg_core")


@dataclass(frozen=True)
class EntryStats:
    """One captured signature: graph segments launched per replay, and its pool's bytes."""

    signature: Signature
    segments: int
    breaks: int
    pool_bytes: int | None
    replays: int


@dataclass(frozen=True)
class RunnerStats:
    """Counters since construction (or the last :meth:`BreakableGraphRunner.reset`)."""

    hits: int
    misses: int
    captures: int
    failed_captures: int
    evictions: int
    entries: tuple[EntryStats, ...] = field(default=())


@dataclass
class _Entry:
    graph: BreakableCUDAGraph
    statics: list[torch.Tensor]
    static_args: tuple[Any, ...]
    static_kwargs: dict[str, Any]
    output: Any
    keep_alive: list[Any]
    pool_bytes: int | None
    replays: int = 0


class BreakableGraphRunner:
    """Stand-in for a module (or any callable) that replays one breakable graph per signature.

    The signature of a call (see ``_signature.py``) is its tensor shapes, dtypes and devices, its
    constants and container structure, and every other object by identity. For each captured
    signature the runner owns persistent static input buffers (a CPU tensor input, such as a
    timestep, gets a buffer on ``device``), a :class:`BreakableCUDAGraph` in its own pool, and the
    static output.

    Capture only happens in :meth:`capture` or inside a :meth:`warmup` window: warm-up runs on a
    side stream, then the call is captured under :func:`enable_breakable_cuda_graph`. While
    serving, a known signature is replayed (live inputs copied into the static buffers with one
    batched copy; the replay runs inside ``replay_context()`` if given) and a clone of the output
    is returned (``return_views=True`` returns the static output itself, valid until the next
    replay). An unknown signature runs eagerly and never captures; the first miss of each
    signature logs which fields differ from the captured ones.

    Failure modes: a capture that raises blocks its signature (eager from then on) with a warning
    naming it; a capture with more than ``max_segments`` segments disables the runner (eager for
    everything, reason in :attr:`disabled_reason`); beyond ``max_entries`` the least recently used
    entry is evicted and its memory freed. With ``device="cuda"`` and no CUDA device every call
    runs eagerly, with a one-time notice; ``device="cpu"`` captures CPU graphs (the CPU backend of
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
    ) -> None:
        if not callable(module):
            raise TypeError(f"BreakableGraphRunner wraps a callable, got {module!r}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_segments is not None and max_segments < 1:
            raise ValueError(f"max_segments must be >= 1 or None, got {max_segments}")
        if warmup_iters < 0:
            raise ValueError(f"warmup_iters must be >= 0, got {warmup_iters}")
        self.module = module
        self.device = torch.device(device)
        self.max_entries = max_entries
        self.max_segments = max_segments
        self.warmup_iters = warmup_iters
        self.return_views = return_views
        self.replay_context = replay_context
        self.disabled_reason: str | None = None
        self._lock = threading.RLock()
        self._window = 0
        self._entries: OrderedDict[Signature, _Entry] = OrderedDict()
        self._blocked: dict[Signature, str] = {}
        self._diagnosed: set[Signature] = set()
        self._no_cuda_noticed = False
        # device="cpu" captures CPU graphs; every other device goes to the CUDA backend.
        self._graph_backend = backend_for("cpu" if self.device.type == "cpu" else "cuda")
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
            sig, live = signature_and_tensors(args, kwargs)
            entry = self._entries.get(sig)
            if entry is not None:
                self._entries.move_to_end(sig)
                self._counts["hits"] += 1
                return self._replay(entry, live)
            if sig not in self._blocked and self._window > 0:
                return self._capture(sig, args, kwargs)
            self._counts["misses"] += 1
            self._diagnose_miss(sig)
            return self.module(*args, **kwargs)

    # -- capture control ----------------------------------------------------------------------

    def capture(self, *args: Any, **kwargs: Any) -> Any:
        """Capture (if not captured yet) the graph for this call's signature and return the
        call's output from a replay; falls back to eager when capture is impossible."""
        with self.warmup():
            return self(*args, **kwargs)

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
        """Drop every entry, block and counter; re-enable a disabled runner."""
        with self._lock:
            for entry in self._entries.values():
                entry.graph.reset()
            self._entries.clear()
            self._blocked.clear()
            self._diagnosed.clear()
            self.disabled_reason = None
            self._counts = dict.fromkeys(self._counts, 0)

    def check_divergence(self, *args: Any, **kwargs: Any) -> DivergenceReport:
        """Compare eager and replay for this call on the graph captured for its signature
        (bitwise, seed 0; see :func:`bcg_core.check_divergence`): e.g. before serving, with
        inputs other than the capture's. Raises :class:`ValueError` when no graph is captured
        for the call's signature."""
        with self._lock:
            sig, live = signature_and_tensors(args, kwargs)
            entry = self._entries.get(sig)
            if entry is None:
                why = describe_difference(sig, list(self._entries))
                raise ValueError(f"no graph is captured for this call's signature: {why}")
            return runner_divergence(self.module, entry, live, self.replay_context)

    @property
    def stats(self) -> RunnerStats:
        with self._lock:
            entries = tuple(
                EntryStats(sig, e.graph.num_segments, e.graph.num_breaks, e.pool_bytes, e.replays)
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
        if not self._graph_backend.is_available():
            if not self._no_cuda_noticed:
                self._no_cuda_noticed = True
                logger.warning(
                    "bcg: no CUDA device is available; %s runs eagerly (no graphs are captured)",
                    type(self).__name__,
                )
            return False
        return True

    def _static(self, t: torch.Tensor) -> torch.Tensor:
        buf = torch.empty_like(t, device=self.device) if t.device != self.device else t.clone()
        buf.copy_(t)
        return buf

    def _capture(self, sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        statics: list[torch.Tensor] = []

        def make_static(t: torch.Tensor) -> torch.Tensor:
            buf = self._static(t)
            statics.append(buf)
            return buf

        static_args, static_kwargs = static_call(args, kwargs, make_static)
        backend = self._graph_backend
        graph = BreakableCUDAGraph(backend=backend.name)
        # Static buffers are device memory the graph re-reads at every replay.
        backend.note_graph_memory(graph.pool(), statics)
        try:
            if self._side is None:
                # One stream for every warm-up and capture: each new stream costs a cuBLAS
                # workspace that is never returned.
                self._side = backend.new_stream(self.device)
            side = self._side
            side.wait_stream(backend.current_stream(self.device))
            with backend.stream_context(side), enable_breakable_cuda_graph():
                for _ in range(self.warmup_iters):
                    self.module(*static_args, **static_kwargs)
            backend.current_stream(self.device).wait_stream(side)
            with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph, stream=side):
                output = self.module(*static_args, **static_kwargs)
        except Exception as exc:
            self._counts["failed"] += 1
            self._blocked[sig] = f"{type(exc).__name__}: {exc}"
            graph.reset()
            logger.warning(
                "bcg: capture failed for signature %s (%s: %s); this signature runs eagerly from "
                "now on",
                sig,
                type(exc).__name__,
                exc,
            )
            return self.module(*args, **kwargs)
        if self.max_segments is not None and graph.num_segments > self.max_segments:
            self.disabled_reason = (
                f"a capture produced {graph.num_segments} graph segments, more than "
                f"max_segments={self.max_segments}; graphs would cost more than they save"
            )
            graph.reset()
            logger.warning("bcg: runner disabled: %s", self.disabled_reason)
            return self.module(*args, **kwargs)
        entry = _Entry(
            graph=graph,
            statics=statics,
            static_args=static_args,
            static_kwargs=static_kwargs,
            output=output,
            keep_alive=identity_objects(args, kwargs),
            pool_bytes=graph.pool_bytes(),
        )
        self._counts["captures"] += 1
        self._entries[sig] = entry
        while len(self._entries) > self.max_entries:
            _, old = self._entries.popitem(last=False)
            old.graph.reset()
            self._counts["evictions"] += 1
        return self._replay(entry, signature_and_tensors(args, kwargs)[1])

    def _replay(self, entry: _Entry, live: list[torch.Tensor]) -> Any:
        pairs = [
            (d, s) for d, s in zip(entry.statics, live, strict=True) if d.data_ptr() != s.data_ptr()
        ]
        if pairs:
            dst, src = [d for d, _ in pairs], [s for _, s in pairs]
            torch._foreach_copy_(dst, src)
        entry.replays += 1
        if self.replay_context is None:
            entry.graph.replay()
        else:
            with self.replay_context():
                entry.graph.replay()
        if self.return_views:
            return entry.output
        return _trees.map_tensors(entry.output, torch.Tensor.clone)

    def _diagnose_miss(self, sig: Signature) -> None:
        if sig in self._diagnosed:
            return
        self._diagnosed.add(sig)
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
