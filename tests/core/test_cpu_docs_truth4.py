"""Fourth pass over what the docs promise (README, DESIGN.md, public docstrings) after the
last sessions' changes, on the CPU backend: each test is a documented behaviour, run."""

from __future__ import annotations

import gc
import timeit

import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    eager_on_graph,
    enable_breakable_cuda_graph,
)


@eager_on_graph
def _timed_double(x: torch.Tensor) -> torch.Tensor:
    # timeit's own pattern: gcold = gc.isenabled(); gc.disable(); ...; if gcold: gc.enable()
    timeit.Timer("1 + 1").timeit(1)
    return x * 2


def test_code_that_saves_and_restores_the_collector_inside_a_capture_leaves_it_enabled() -> None:
    """DESIGN 'gc pause': the collector is left as the user last set it. Inside a capture
    gc.isenabled() said False (bcg's pause), so code saving and restoring the switch around a
    gc.disable() (timeit, here in a break) never re-enabled it: the collector stayed off for
    good after the capture, silently."""
    assert gc.isenabled()
    seen: list[bool] = []
    graph = BreakableCUDAGraph(backend="cpu")
    try:
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            seen.append(gc.isenabled())
            y = _timed_double(torch.ones(3) + 1) + 1
        assert torch.equal(y, torch.full((3,), 5.0))
        assert seen == [True], "inside a capture gc.isenabled() is the user's switch"
        assert gc.isenabled(), "the capture left the collector disabled"
    finally:
        gc.enable()
        graph.reset()


def test_gc_isenabled_inside_a_capture_follows_the_users_switch() -> None:
    seen: list[bool] = []
    graph = BreakableCUDAGraph(backend="cpu")
    try:
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            gc.disable()
            seen.append(gc.isenabled())
            gc.enable()
            seen.append(gc.isenabled())
            torch.ones(2).mul(2)
        assert seen == [False, True]
        assert gc.isenabled()
    finally:
        gc.enable()
        graph.reset()
