"""What a runner reports: its entries, the graph memory it holds, a start-up's report and its
counters (the public result types of :class:`bcg_core.BreakableGraphRunner`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from bcg_core._signature import Signature, describe_signature


@dataclass(frozen=True, repr=False)
class EntryStats:
    """One captured signature of a :class:`BreakableGraphRunner`, in :attr:`RunnerStats.entries`.

    Attributes:
        signature: the call signature the graph was captured for (see :func:`signature_of`).
        segments: graph segments launched per replay.
        breaks: breaks run per replay.
        pool_bytes: the bytes its (shared) pool held right after this capture; None where the
            backend cannot tell (CPU).
        replays: replays so far.
        capture_runs: how many times :meth:`BreakableGraphRunner.capture` ran the step for it
            (warm-ups + the capture, + one replay where a ``capture_stub`` ran at capture).
        pool: the memory pool it was captured into.
        capture_ms: the wall time of the capture itself in ms (warm-ups excluded; the capture
            stream synchronised at its end).
        warmup_ms: the wall time of its warm-ups in ms.
    """

    signature: Signature
    segments: int
    breaks: int
    pool_bytes: int | None
    replays: int
    capture_runs: int
    pool: Any
    capture_ms: float
    warmup_ms: float = 0.0

    def __repr__(self) -> str:
        # The signature in words, its first fields only: the raw key of a call of 200 tensors
        # made a repr (and a RunnerStats') of 13,000 characters.
        rest = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)[1:])
        return f"EntryStats(signature=<{describe_signature(self.signature)}>, {rest})"


@dataclass(frozen=True)
class GraphMemory:
    """The device memory a runner's graphs hold, in bytes.

    See :meth:`BreakableGraphRunner.graph_memory`.

    Attributes:
        pool_bytes: what the allocator holds in the runner's pool (graph intermediates, bridges
            and outputs; shared with every graph and runner using the pool; None where the
            backend cannot tell).
        static_bytes: the static input buffers and scalar slots of every entry (allocated
            outside the pool).
        bridge_bytes: break outputs held outside the pool (a break that returns a tensor it
            did not allocate in the capture, e.g. a buffer of its own).
    """

    pool_bytes: int | None
    static_bytes: int
    bridge_bytes: int

    @property
    def total_bytes(self) -> int | None:
        """Everything above (None when the pool's size is unknown)."""
        if self.pool_bytes is None:
            return None
        return self.pool_bytes + self.static_bytes + self.bridge_bytes


@dataclass(frozen=True)
class CaptureReport:
    """What :meth:`BreakableGraphRunner.capture_many` did.

    Attributes:
        captured: the entries it captured, in capture order (each with its capture and warm-up
            ms, segments, breaks and the pool's bytes right after it).
        failed: the calls that were not captured, as (signature, reason): their capture
            raised, or the runner could not capture (disabled by ``max_segments`` or
            ``BCG_DISABLE``, no device); they run eagerly.
        seconds: the wall time of the whole start-up (warm-ups and captures).
        memory: the graph memory the runner holds afterwards, which is what an engine
            subtracts before sizing its KV cache.
    """

    captured: tuple[EntryStats, ...]
    failed: tuple[tuple[Signature, str], ...]
    seconds: float
    memory: GraphMemory


@dataclass(frozen=True)
class RunnerStats:
    """Counters since construction (or the last :meth:`BreakableGraphRunner.reset`).

    Every call counts once in ``hits``, ``misses``, ``captures`` or ``failed_captures`` (a call
    whose replay raised counts in none).

    Attributes:
        hits: calls served by a replay.
        misses: calls run eagerly for want of a graph: an unknown signature outside a capture
            window, a blocked one, a call whose argument written by the graph shares
            memory with another argument, one made by a break of the runner's own replay or
            capture, or any call while the runner or breakable graphs are disabled
            (``BCG_DISABLE``, ``max_segments``: the capture that exceeded it too, no device).
        captures: successful captures.
        failed_captures: captures that raised (their signatures are blocked).
        evictions: entries dropped beyond ``max_entries`` (least recently used first).
        entries: one :class:`EntryStats` per captured signature, least recently used first.
    """

    hits: int
    misses: int
    captures: int
    failed_captures: int
    evictions: int
    entries: tuple[EntryStats, ...] = field(default=())
