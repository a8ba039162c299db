"""``torch.cuda.CUDAGraph`` objects captured and destroyed one thread at a time.

torch (2.11 and earlier) keeps the graphs registered with each CUDA generator in an unlocked
``std::unordered_set``: ``CUDAGraph.capture_begin`` inserts into it (and, when it was empty,
allocates the generator's graph seed and offset tensors), the graph's destructor erases from it
(and frees those tensors when it empties). Two threads doing either at once are a data race on
the set and the tensors. (It was not seen to crash: two threads making, capturing and dropping
6000 bare torch graphs ran clean on the H200. The SIGSEGVs of issue 21 came from reading the
allocator's snapshot, see ``_capture/fresh.py``.)

So every torch graph bcg makes is a :class:`TorchGraph`: its ``capture_begin``,
``capture_end``, ``reset`` and destruction hold one process-wide lock. Replay takes no lock
(it reads the generator's tensors, which a registered graph keeps alive). torch graphs that
user code makes in other threads are outside this lock, and torch's generator keeps one
capture flag per process: an eager CUDA random op in one thread while another thread captures
fails in torch ("Offset increment outside graph capture").
"""

from __future__ import annotations

import threading
from typing import Any

import torch

# Re-entrant: a graph collected by a garbage collection that code inside the lock triggers is
# destroyed by the thread that already holds it.
_lock = threading.RLock()


class TorchGraph:
    """One ``torch.cuda.CUDAGraph`` whose registry-touching calls are serialised (module
    docstring). The torch graph is referenced only from here, so it is destroyed exactly when
    this object is, under the lock."""

    __slots__ = ("_graph",)

    def __init__(self) -> None:
        self._graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        assert self._graph is not None
        with _lock:
            self._graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)

    def capture_end(self) -> None:
        assert self._graph is not None
        with _lock:
            self._graph.capture_end()

    def replay(self) -> None:
        # A method, not the torch graph's bound replay: a plan holding that would keep the
        # torch graph alive past this object, and it would be destroyed outside the lock.
        self._graph.replay()  # type: ignore[union-attr]

    def reset(self) -> None:
        assert self._graph is not None
        with _lock:
            self._graph.reset()

    def __del__(self, _lock: Any = _lock) -> None:  # bound early: module globals go at exit
        graph, self._graph = self._graph, None
        if graph is None:
            return
        with _lock:
            del graph
