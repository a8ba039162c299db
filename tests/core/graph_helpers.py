"""Helpers for the scenarios shared by the CPU graph backend and CUDA (the ``device`` fixture
of tests/conftest.py makes the parametrised device torch's default device)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, enable_breakable_cuda_graph


def device_graph() -> BreakableCUDAGraph:
    """A graph for the device tensors are created on (see the ``device`` fixture)."""
    return BreakableCUDAGraph(backend=torch.get_default_device().type)


def capture(fn: Callable[[], Any], graph: BreakableCUDAGraph | None = None) -> tuple[Any, Any]:
    """Capture ``fn()`` with the runtime flag on; return the graph and the capture-time output."""
    graph = graph if graph is not None else device_graph()
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = fn()
    return graph, out


def cpu_capture(fn: Callable[[], Any]) -> tuple[BreakableCUDAGraph, Any]:
    """Capture ``fn()`` into a new graph of the CPU backend, with the runtime flag on; return
    the graph and the capture-time output."""
    graph, out = capture(fn, BreakableCUDAGraph(backend="cpu"))
    return graph, out


def left_to_the_collector(run: Callable[[], Any], runs: int = 3) -> list[str]:
    """The bcg types and tensor types that ``run()`` (called ``runs`` times after a warm-up
    call, whose lazily made caches are not its garbage) left in reference cycles; the
    collector is always restored."""
    run()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(runs):
            run()
        gc.collect()
    finally:
        gc.set_debug(0)
        gc.enable()
    garbage = [type(o) for o in gc.garbage]
    gc.garbage.clear()
    return sorted(
        {t.__qualname__ for t in garbage if t.__module__.startswith(("bcg_core", "bcg_diffusion"))}
        | {t.__qualname__ for t in garbage if issubclass(t, torch.Tensor)}
    )
