"""Holes found in session 25 that only a GPU shows (capture lanes exist only on CUDA)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from cuda_helpers import randn, refresh

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, eager_on_graph
from bcg_core._backends import cuda_lanes  # noqa: PLC2701

pytestmark = pytest.mark.cuda


@eager_on_graph(name="double25")
def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _captured_graph(x: torch.Tensor) -> tuple[BreakableCUDAGraph, torch.Tensor]:
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        out = _double(x + 1) - 1
    return graph, out


def test_a_pool_collected_while_another_thread_leases_a_lane_does_not_wait_for_it() -> None:
    # A pool's finalizer gives its lane back. It ran wherever a garbage collection did, possibly
    # in a thread holding the graph lock while another thread held the lanes lock inside
    # lease_lane, waiting for the graph lock to make a lane: both waited for good. The
    # finalizer now never waits for the lanes lock; the next lease takes the lane back.
    x = randn(16)
    graph, _ = _captured_graph(x)
    holding, release = threading.Event(), threading.Event()

    def hold_the_lanes_lock() -> None:
        with cuda_lanes._lock:
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold_the_lanes_lock)
    holder.start()
    try:
        assert holding.wait(30)
        finished = threading.Event()

        def drop() -> None:
            nonlocal graph
            del graph  # the last reference to its pool: the finalizer runs here
            finished.set()

        dropper = threading.Thread(target=drop)
        dropper.start()
        assert finished.wait(10), "a pool's finalizer waited for the lanes lock"
        dropper.join()
    finally:
        release.set()
        holder.join()
    leased = len(cuda_lanes._leased)
    again, out = _captured_graph(x)  # the next lease gives the queued lane back first
    assert len(cuda_lanes._leased) <= leased
    refreshed = randn(16)
    x.copy_(refreshed)
    again.replay()
    torch.testing.assert_close(out, (refreshed + 1) * 2 - 1)


_marks: list[torch.cuda.Event] = []


@eager_on_graph(name="mark25")
def _mark(t: torch.Tensor) -> torch.Tensor:
    out = t + 1
    _marks[0].record()  # on the caller's stream: the capturing stream, between segments
    return out


def test_waits_on_events_of_an_earlier_segment_and_of_a_break_capture_and_replay() -> None:
    # Both waits reached CUDA, which refused them (a raw capture error): the tracker forgot the
    # first segment's records at the break, and checked the break's record on the capturing
    # stream as a capturing stream's. Both are ordered before the waiting segment already.
    x = randn(32)
    early = torch.cuda.Event()
    _marks[:] = [torch.cuda.Event()]
    graph = BreakableCUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with BreakableCUDAGraphCapture(graph):
            cap = torch.cuda.current_stream()
            h = x * 2
            early.record(cap)
            y = _mark(h)
            cap.wait_event(early)
            cap.wait_event(_marks[0])
            out = y * 3
    assert (graph.num_segments, graph.num_breaks) == (2, 1)
    for _ in range(2):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out, (x * 2 + 1) * 3)
