# ruff: noqa: PLC2701  (a probe times the runner's private pieces one by one)
"""Where a runner call's host time goes on this machine (issue 23's per-call cost).

``python3 benchmarks/probe_runner_host.py`` (sources on PYTHONPATH; CUDA when available, else
the CPU backend): a one-segment graph of one small op, replayed by hand and through a runner
(views and clones), and each piece of the runner's call path timed alone over many calls.
Prints microseconds per call, the median of 7 rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, BreakableGraphRunner
from bcg_core._capture.flag import breakable_graphs_disabled, flag_on, flag_reset
from bcg_core._signature import signature_and_tensors

N = 5000  # calls per round (7 rounds per row)


def _us(fn: Callable[[], object]) -> float:
    rounds = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(N):
            fn()
        rounds.append((time.perf_counter() - start) * 1e6 / N)
    return statistics.median(rounds)


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_grad_enabled(False)
    x = torch.ones(16, device=device)

    def step() -> torch.Tensor:
        return x + 1

    graph = BreakableCUDAGraph(backend=device.type)
    with BreakableCUDAGraphCapture(graph):
        step()
    views = BreakableGraphRunner(step, device=device, return_views=True)
    views.capture()
    cloning = BreakableGraphRunner(step, device=device)
    cloning.capture()
    backend = views._graph_backend
    (entry,) = views._entries.values()
    stream = backend.current_stream(device)

    def flag() -> None:
        flag_reset(flag_on())

    rows = {
        "graph.replay() by hand": graph.replay,
        "runner, return_views": views,
        "runner, clone": cloning,
        "  the can-graph tests": lambda: (
            views.disabled_reason is None
            and not breakable_graphs_disabled()
            and backend.is_available()
        ),
        "  breakable_graphs_disabled()": breakable_graphs_disabled,
        "  backend.is_available()": backend.is_available,
        "  signature_and_tensors((), {})": lambda: signature_and_tensors((), {}),
        "  backend.current_stream(device)": lambda: backend.current_stream(device),
        "  torch.cuda.current_stream()": (
            torch.cuda.current_stream if device.type == "cuda" else lambda: None
        ),
        "  turn.wait + record": lambda: (views._turn.wait(stream), views._turn.record(stream)),
        "  flag on/off": flag,
        "  entry.load + store": lambda: (entry.load([], []), entry.store([])),
        "  entry.clone()": entry.clone,
        "  runner's graph replay": entry.graph.replay,
    }
    _print_rows(rows, device)
    _with_arguments(device)


def _print_rows(rows: dict[str, Callable[[], object]], device: torch.device) -> None:
    """Each row's microseconds per call, after 200 calls of warm-up."""
    for name, fn in rows.items():
        for _ in range(200):
            fn()
        _sync(device)
        print(f"{name:36s} {_us(fn):8.2f} us")
        _sync(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _with_arguments(device: torch.device) -> None:
    """The same for a step that takes two small tensors (a decode step's tokens and
    positions): the runner copies them into its static buffers at every call."""
    tokens = torch.zeros(1, dtype=torch.long, device=device)
    positions = torch.zeros(1, dtype=torch.long, device=device)
    statics = [tokens.clone(), positions.clone()]

    def step(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return t + p

    runner = BreakableGraphRunner(step, device=device, return_views=True)
    runner.capture(tokens, positions)
    (entry,) = runner._entries.values()
    _, live = signature_and_tensors((tokens, positions), {})

    def two_copies() -> None:
        statics[0].copy_(tokens)
        statics[1].copy_(positions)

    rows = {
        "runner, return_views, 2 tensor args": lambda: runner(tokens, positions),
        "  runner's graph replay": entry.graph.replay,
        "  signature_and_tensors(2 tensors)": lambda: signature_and_tensors(
            (tokens, positions), {}
        ),
        "  entry.load (one _foreach_copy_)": lambda: entry.load(live, []),
        "  two copy_ calls": two_copies,
        "  _foreach_copy_ of 2": lambda: torch._foreach_copy_(statics, [tokens, positions]),
    }
    _print_rows(rows, device)


if __name__ == "__main__":
    main()
