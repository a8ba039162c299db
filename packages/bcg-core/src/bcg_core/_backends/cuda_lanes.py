"""Capture lanes: the streams captures run on when the caller names none, each with a pool
that holds the cuBLAS workspaces cached for it.

cuBLAS kernels bake the address of the workspace torch caches per (cuBLAS handle, stream), and
torch frees every cached workspace whenever anyone calls ``_cuda_clearCublasWorkspaces()``
(torch.compile's cudagraph trees do at every recording). A workspace that eager work made in
the ordinary allocator is then free memory that a graph still writes at every replay. On a
lane, the calling thread's workspace is made inside the lane's own pool before each capture
(:meth:`CaptureLane.ensure_workspaces`), so whatever clears it, its memory stays the lane's.

A pool leases one lane for its lifetime, so graphs of different live pools never share a
workspace (they may replay at the same time on different streams). A :class:`CudaPool` gives
its lane back when it is collected (its graphs, which hold it, are gone by then) and a later
pool reuses it, workspace included; a bare pool id keeps its lane for the process. Lanes are
never destroyed, so there are as many as pools were ever alive at once.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import weakref
from typing import Any

import torch

from bcg_core._backends.cuda_pool import CudaPool, allocate_to_pool
from bcg_core._backends.cudart import RUNTIME
from bcg_core._backends.seam import pool_id

logger = logging.getLogger("bcg_core")


class CaptureLane:
    """A stream only captures use, and the pool its cuBLAS workspaces live in."""

    def __init__(self, index: int) -> None:
        self.index = index
        with torch.cuda.device(index):
            self.stream = _private_stream()
            self.workspaces = CudaPool()

    def ensure_workspaces(self) -> None:
        """Make the calling thread's cuBLAS workspace for this stream exist, in
        :attr:`workspaces`: nothing happens when it does; after a clear it is made there."""
        with (
            torch.cuda.device(self.index),
            allocate_to_pool(self.workspaces, self.index),
            torch.cuda.stream(self.stream),
        ):
            # Asking for the handle makes torch attach the stream's workspace, allocating it if
            # it is missing, without running a kernel (a first matmul of a new dtype costs tens
            # of ms of module loading). cuBLASLt shares that workspace unless told not to.
            torch.cuda.current_blas_handle()  # type: ignore[no-untyped-call]
            if _SEPARATE_LT_WORKSPACE:
                a = torch.ones(8, 8, device=torch.device("cuda", self.index))
                torch.addmm(a[0], a, a)  # a cuBLASLt call: its own workspace for the stream


# torch >= 2.11 shares the cuBLAS workspace with cuBLASLt unless this is set to 0.
_SEPARATE_LT_WORKSPACE = os.environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").strip() == "0"
_lock = threading.RLock()  # re-entrant: a CudaPool's finalizer may run inside a locked block
_leased: dict[tuple[int, ...], CaptureLane] = {}
_free: dict[int, list[CaptureLane]] = {}
# Pools collected while another thread held _lock: given back by the next lease (see _give_back).
_returned: collections.deque[tuple[int, ...]] = collections.deque()


def lease_lane(pool: Any, index: int) -> CaptureLane:
    """The lane of ``pool`` on device ``index``, leased on its first capture."""
    # A CudaPool is keyed by the object (its id changes when a failed capture renews it);
    # a bare pool id by the id.
    key = (index, id(pool)) if isinstance(pool, CudaPool) else (index, *pool_id(pool))
    with _lock:
        while _returned:
            _release(_returned.popleft())
        lane = _leased.get(key)
        if lane is None:
            free = _free.setdefault(index, [])
            lane = free.pop() if free else CaptureLane(index)
            _leased[key] = lane
            if isinstance(pool, CudaPool):
                weakref.finalize(pool, _give_back, key)
        return lane


def make_spare_lane(index: int) -> None:
    """Make a free lane on device ``index`` if it has never had one, so that the first capture
    of the process does not pay for making it (a stream and an anchored pool)."""
    with _lock:
        if index not in _free:
            _free[index] = [CaptureLane(index)]


def _give_back(key: tuple[int, ...]) -> None:
    # A pool's finalizer runs wherever a garbage collection does: possibly in a thread that
    # holds the graph lock (cuda_graph.py) while another thread, inside lease_lane, holds _lock
    # and waits for the graph lock to make a lane. Waiting for _lock here would deadlock both,
    # so the key is queued instead when _lock is taken, and the next lease gives it back.
    if not _lock.acquire(blocking=False):
        _returned.append(key)
        return
    try:
        _release(key)
    finally:
        _lock.release()


def _release(key: tuple[int, ...]) -> None:
    lane = _leased.pop(key, None)
    if lane is not None:
        _free.setdefault(lane.index, []).append(lane)


def _private_stream() -> torch.cuda.Stream:
    """A stream nobody else holds, on the current device. torch's streams come from a small
    pool shared by every user, so one may already carry someone's workspace; a stream made
    through the bindings is new. It is never destroyed: the driver could hand its handle out
    again, and whoever got it would find the lane's workspace cached under it."""
    handle = RUNTIME.create_stream()
    if handle is not None:
        return torch.cuda.ExternalStream(handle)  # type: ignore[no-untyped-call]
    logger.warning(
        "bcg: cuda-bindings cannot create a stream, so captures run on one of torch's shared "
        "streams: a cuBLAS workspace that eager work cached on it lies outside the graph's "
        "pool, and is freed when anyone clears cuBLAS workspaces (torch.compile does)."
    )
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]
