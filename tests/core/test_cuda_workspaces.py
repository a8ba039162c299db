"""A captured graph keeps working when torch clears cuBLAS's cached workspaces.

cuBLAS kernels captured in a segment bake the address of their stream's workspace. torch frees
those workspaces whenever anyone clears them: torch.compile's cudagraph trees around every
recording, a torch graph's destructor for its own capture stream. A workspace created by eager
work before the capture (warm-ups on the capturing stream) is then freed memory the graph still
writes at every replay: an illegal address once the allocator returns it to the driver, or
silent writes into whatever tensor reuses it. Each test frees the memory, refills it with NaN
and checks the replay's output and the refilled memory.
"""

from __future__ import annotations

import gc

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    eager_on_graph,
    enable_breakable_cuda_graph,
    get_current_stream,
)

pytestmark = pytest.mark.cuda

HIDDEN = 4096


@eager_on_graph
def _eager_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


def _weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5).to("cuda", torch.bfloat16)
        for _ in range(3)
    ]


def _forward(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    # Small M, large K: the shapes of decode GEMMs, where cuBLAS uses its workspace (split-K).
    h = torch.relu(x @ w[0])
    h = _eager_matmul(h, w[1])
    return torch.tanh(h @ w[2])


def _free_and_refill() -> list[torch.Tensor]:
    """Clear every cuBLAS workspace (what cudagraph trees do), then :func:`_refill`."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    return _refill()


def _refill() -> list[torch.Tensor]:
    """Hand freed memory back to the driver, then take 512 MiB again, filled with NaN."""
    gc.collect()
    torch.cuda.empty_cache()
    return [torch.full((16 << 20,), float("nan"), device="cuda") for _ in range(8)]


def _untouched(junk: list[torch.Tensor]) -> bool:
    torch.cuda.synchronize()
    return all(bool(t.isnan().all()) for t in junk)


def _inputs(batch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(batch)
    return torch.randn(batch, HIDDEN, generator=gen).to("cuda", torch.bfloat16)


def test_graph_survives_a_workspace_clear_after_warmups() -> None:
    w = _weights()
    x = _inputs(8)
    with torch.no_grad(), enable_breakable_cuda_graph():
        expected = _forward(x, w).clone()
        for _ in range(2):  # warm-ups on the caller's stream, as a user writes them
            _forward(x, w)
        graph = BreakableCUDAGraph()
        with BreakableCUDAGraphCapture(graph):
            out = _forward(x, w)
        junk = _free_and_refill()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        assert _untouched(junk), "a replay wrote into memory the graph no longer owns"


def test_a_capture_leaves_other_graphs_workspaces_alone() -> None:
    """A plain torch graph whose workspace lies outside any pool (warmed up on its own capture
    stream) keeps it across a breakable capture: bcg clears no workspace."""
    w = _weights()
    x = _inputs(8)
    with torch.no_grad():
        expected = _forward(x, w).clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _forward(x, w)
        plain = torch.cuda.CUDAGraph()
        with torch.cuda.graph(plain, stream=stream):
            plain_out = _forward(x, w)
        with enable_breakable_cuda_graph():
            graph = BreakableCUDAGraph()
            with BreakableCUDAGraphCapture(graph):
                out = _forward(x, w)
        junk = _refill()
        plain.replay()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(plain_out, expected)
        assert torch.equal(out, expected)
        assert _untouched(junk)


def test_runner_entries_survive_workspace_clears_and_a_reset_runner() -> None:
    """Two runners capture on the same per-thread stream; one is reset (its graphs destroyed),
    the workspaces are cleared; the other still replays right and writes nothing foreign."""
    w = _weights()
    with torch.no_grad(), enable_breakable_cuda_graph():
        first = BreakableGraphRunner(lambda x: _forward(x, w), device="cuda")
        second = BreakableGraphRunner(lambda x: _forward(x, w), device="cuda")
        inputs = {b: _inputs(b) for b in (1, 8)}
        expected = {b: _forward(x, w).clone() for b, x in inputs.items()}
        for x in inputs.values():
            first.capture(x)
            second.capture(x)
        first.reset()
        junk = _free_and_refill()
        for _ in range(2):
            for b, x in inputs.items():
                assert torch.equal(second(x), expected[b]), f"batch {b}"
        assert _untouched(junk), "a replay wrote into memory the graph no longer owns"
        second.reset()


def test_live_pools_capture_on_their_own_lanes_and_a_dead_pools_lane_is_reused() -> None:
    """Graphs of two live pools may replay at once on different streams, so they must not
    share a workspace: each pool captures on its own stream. A pool's lane returns when the
    pool is gone, and the next pool reuses it (no new stream, no new workspace)."""
    w = _weights()
    x = _inputs(8)

    def capture_on() -> tuple[BreakableCUDAGraph, int]:
        graph = BreakableCUDAGraph()
        with BreakableCUDAGraphCapture(graph):
            stream = get_current_stream().cuda_stream
            _forward(x, w)
        return graph, stream

    with torch.no_grad(), enable_breakable_cuda_graph():
        _forward(x, w)
        first, first_stream = capture_on()
        second, second_stream = capture_on()
        assert first_stream != second_stream
        assert torch.cuda.current_stream().cuda_stream not in (first_stream, second_stream)
        del first
        gc.collect()
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        third, third_stream = capture_on()
        assert third_stream == first_stream
        del third
        gc.collect()
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - allocated
        assert grown < 4 << 20, f"{grown} bytes more: a reused lane made a new workspace"
        second.reset()
