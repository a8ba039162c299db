"""Graph memory pools on CUDA: a pool id anchored so it outlives the graphs that use it, and
torch's per-thread routing that puts eager allocations in a pool."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bcg_core._backends.cuda_graph import TorchGraph
from bcg_core._backends.seam import pool_id

logger = logging.getLogger("bcg_core")


class CudaPool:
    """A graph memory pool that stays valid while this object lives.

    torch frees a pool (in both its device and its pinned-host allocator) when the last graph
    captured into it is reset; capturing into that id again then fails an allocator assertion.
    So the pool is anchored by an empty graph captured into it at creation and kept here: the
    pool survives ``reset()`` of every graph that uses it, and is returned to the allocator when
    this object (held by every graph that shares it) is collected.
    """

    def __init__(self) -> None:
        self.id: Any = None
        self._anchor: TorchGraph | None = None
        self._lock = threading.Lock()
        self.bytes = 0  # see count_pool_growth
        self.renew()

    def grew(self, nbytes: int) -> None:
        """Count ``nbytes`` the allocator reserved for this pool (negative: take back bytes
        counted for a block that reserved them outside it)."""
        with self._lock:
            self.bytes += nbytes

    def renew(self) -> None:
        """Move to a fresh pool id, anchored the same way.

        A capture that failed half-way can leave torch routing allocations to the old id in its
        pinned-host allocator, which Python cannot stop; every later capture into that id then
        fails ("beginAllocateToPool: already recording to mempool_id"). Graphs captured into the
        old id keep its memory (torch counts their use) and replay as before; later captures
        through this object go to the new id. The old anchor is reset: once the old id's last
        graph is reset too, its device memory goes back to the allocator (``empty_cache``, or
        torch's own retry before an out-of-memory error). The device reference the failed
        capture took was given back by ``_end_pool_routing``; the pinned-host allocator keeps
        its own, so it never frees the pool it still routes to. (On the H200, 300 failed
        captures kept 6.6 GiB reserved while old anchors were kept, 2 MiB once they were reset:
        ``benchmarks/probe_failed_capture_memory.py``.)
        """
        old, self._anchor = self._anchor, None
        if old is not None:
            old.reset()
        self.id = torch.cuda.graph_pool_handle()
        anchor = self._anchor = TorchGraph()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            # relaxed: the anchor must not disturb (or be disturbed by) captures on other threads
            anchor.capture_begin(self.id, "relaxed")
            anchor.capture_end()

    def __repr__(self) -> str:
        return f"CudaPool(id={self.id})"


def device_index(device: Any) -> int:
    """The CUDA device index ``device`` names (an index, a string, a ``torch.device``), the
    current device when it names none."""
    # Per-break and per-call path: an int or a torch.device is read directly (building a
    # torch.device and asking torch.cuda for the current device cost several us).
    if isinstance(device, int):
        return device
    index = device.index if isinstance(device, torch.device) else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def reserved_bytes(index: int) -> int:
    """What the device's caching allocator holds (``torch.cuda.memory_reserved``), read from
    torch's nested statistics: the flat dictionary ``memory_reserved`` builds first costs about
    100 us, which at two reads per break made a start-up of 35 sizes 20 % slower."""
    stats = getattr(torch._C, "_cuda_memoryStats", None)
    if stats is None:
        return torch.cuda.memory_reserved(index)
    return int(stats(index)["reserved_bytes"]["all"]["current"])


@contextlib.contextmanager
def count_pool_growth(pool: Any, device: Any) -> Iterator[None]:
    """Count what the device's allocator newly reserves inside the block as ``pool``'s.

    A pool's memory is reserved only while something is captured or routed into it, and it is
    never returned while the pool lives, so the sum over its captures and warm-ups is its size
    (more, when another thread's eager work reserved memory at the same time). The figure does
    not come from torch's snapshot of the pool: reading that snapshot in the states bcg's
    captures leave crashed torch 2.11 (``_capture/fresh.py``). A bare pool id is not counted.
    """
    with _growth_counted(pool, device, 1):
        yield


@contextlib.contextmanager
def _growth_counted(pool: Any, device: Any, sign: int) -> Iterator[None]:
    """Add (``sign`` 1) or take back (-1) what the allocator newly reserves in the block to or
    from a :class:`CudaPool`'s count; a bare pool id is not counted."""
    if not isinstance(pool, CudaPool):
        yield
        return
    index = device_index(device)
    before = reserved_bytes(index)
    try:
        yield
    finally:
        pool.grew(sign * max(0, reserved_bytes(index) - before))


_ROUTING_API = (
    "_cuda_beginAllocateCurrentThreadToPool",
    "_cuda_endAllocateToPool",
    "_cuda_releasePool",
)


@functools.cache
def _routing_api() -> tuple[Callable[[int, Any], None], ...] | None:
    """torch's per-thread pool routing (what ``torch.cuda.use_mem_pool`` uses, torch >= 2.8),
    or None (said once) when this torch lacks it."""
    fns = tuple(getattr(torch._C, name, None) for name in _ROUTING_API)
    # torch.cuda.memory registers placeholder classes under these names in builds without them.
    if all(callable(f) and not isinstance(f, type) for f in fns):
        return fns  # type: ignore[return-value]
    logger.warning(
        "bcg: torch %s has no per-thread pool routing (torch._C.%s, torch >= 2.8): a break's "
        "output is held outside the graph's pool for the graph's lifetime, which costs more "
        "memory than a graph intermediate. Upgrade torch to share it through the pool.",
        torch.__version__,
        _ROUTING_API[0],
    )
    return None


@contextlib.contextmanager
def allocate_to_pool(pool: Any, device: Any) -> Iterator[bool]:
    api = _routing_api()
    if api is None:
        yield False
        return
    begin, end, release = api
    index = device_index(device)
    pid = pool_id(pool)
    # begin takes a reference on the pool and release gives it back, as use_mem_pool does.
    begin(index, pid)
    try:
        yield True
    finally:
        try:
            end(index, pid)
        finally:
            release(index, pid)


@contextlib.contextmanager
def not_pool_growth(pool: Any, device: Any) -> Iterator[None]:
    """Inside :func:`count_pool_growth`: what the allocator newly reserves in this block is
    not ``pool``'s (a break's allocations, outside the pool)."""
    with _growth_counted(pool, device, -1):
        yield


@contextlib.contextmanager
def allocate_outside_pool(pool: Any, device: Any) -> Iterator[None]:
    """Inside a block of :func:`allocate_to_pool` for ``pool``: route nothing in this block
    (the thread's allocations go to the ordinary allocator, not counted as the pool's), then
    route to the pool again."""
    api = _routing_api()
    if api is None:
        yield
        return
    begin, end, release = api
    index = device_index(device)
    pid = pool_id(pool)
    end(index, pid)
    release(index, pid)  # the reference the enclosing block took; it takes one again below
    try:
        with not_pool_growth(pool, device):
            yield
    finally:
        begin(index, pid)
