"""What a runner's start-up leaves reserved on the device: its graph memory (the pool and the
static buffers), and nothing cached outside it. An engine sizes its KV cache from the free
memory right after start-up; memory that eager warm-ups freed into the allocator's cache (on
a stream the capture does not use) is lost to it until someone empties the cache."""

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
)

pytestmark = pytest.mark.cuda

MIB = 2**20


@eager_on_graph
def _act(h: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(h)


def _settled_reserved() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def test_capture_many_keeps_reserved_only_what_its_graphs_hold() -> None:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(1024, 8192, generator=gen) / 32).cuda()

    def model(x: torch.Tensor) -> torch.Tensor:
        return _act(x @ w) @ w.T  # batch 8192: two 256 MiB activations, a 32 MiB result

    sizes = (8192, 2048, 512)
    inputs = [torch.randn(b, 1024, generator=gen).cuda() for b in sizes]
    with torch.no_grad():
        expected = [model(x).clone() for x in inputs]
        runner = BreakableGraphRunner(model, device="cuda")
        _ = runner.stream  # the pool and its capture lane (cuBLAS workspace) exist first
        before = _settled_reserved()
        report = runner.capture_many([((x,), {}) for x in inputs])
        torch.cuda.synchronize()
        grown = torch.cuda.memory_reserved() - before  # no empty_cache: what an engine sees
        memory = report.memory
        assert memory.pool_bytes is not None and memory.total_bytes is not None
        assert memory.bridge_bytes == 0  # the break's outputs lie in the pool
        assert memory.static_bytes == sum(x.numel() * 4 for x in inputs)
        # The capture reuses the blocks its warm-ups freed in the pool (same stream): the pool
        # is one step's peak (about 544 MiB), not the warm-ups' and the capture's side by side.
        assert memory.pool_bytes < 800 * MIB, memory
        # Static buffers of 8 and 2 MiB share a 20 MiB allocator segment: a little slack.
        assert grown <= memory.total_bytes + 24 * MIB, (grown / MIB, memory)
        for x, want in zip(inputs, expected, strict=True):
            assert torch.equal(runner(x), want)
        runner.reset()


def test_a_runner_on_a_bare_pool_id_captures_and_replays() -> None:
    """A bare id from torch.cuda.graph_pool_handle() names no allocator pool before its first
    capture: warm-ups are not routed into it (a pool made and released by routing is refused
    by the capture that follows)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=gen).cuda()

    def model(x: torch.Tensor) -> torch.Tensor:
        return _act(x @ w) @ w

    runner = BreakableGraphRunner(model, device="cuda", pool=torch.cuda.graph_pool_handle())
    inputs = [torch.randn(b, 256, generator=gen).cuda() for b in (64, 8)]
    with torch.no_grad():
        report = runner.capture_many([((x,), {}) for x in inputs])
        assert len(report.captured) == 2 and report.failed == ()
        for x in inputs:
            assert torch.equal(runner(x), model(x))
    assert runner.stats.hits == 2


def test_warmups_in_a_graphs_block_stay_in_its_pool() -> None:
    """By hand: warm-ups inside ``graph.warmup()`` allocate in the graph's pool, on the stream
    the capture uses, so the capture reuses their blocks and nothing stays cached outside."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(1024, 8192, generator=gen) / 32).cuda()
    x = torch.randn(8192, 1024, generator=gen).cuda()

    def model(x: torch.Tensor) -> torch.Tensor:
        return _act(x @ w) @ w.T

    graph = BreakableCUDAGraph()
    with torch.no_grad(), enable_breakable_cuda_graph():
        expected = model(x).clone()
        with graph.warmup():  # makes the pool's lane (and its workspace) before the baseline
            pass
        before = _settled_reserved()
        with graph.warmup():
            for _ in range(2):
                model(x)
        with BreakableCUDAGraphCapture(graph):
            out = model(x)
        torch.cuda.synchronize()
        grown = torch.cuda.memory_reserved() - before
        assert torch.equal(out, expected)  # a faithful capture ran the step
        pool = graph.pool_bytes()
        assert pool is not None and pool < 800 * MIB  # one step's peak, not two
        assert grown <= pool + 2 * MIB, (grown / MIB, pool / MIB)
        x.copy_(x.flip(0))
        graph.replay()
        assert torch.equal(out, model(x))
