"""Helpers for the scenarios shared by the CPU graph backend and CUDA (the ``device`` fixture
of tests/conftest.py makes the parametrised device torch's default device)."""

from __future__ import annotations

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
