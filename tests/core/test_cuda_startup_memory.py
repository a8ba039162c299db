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
        # Besides the graph memory, only the break's own allocation at batch 8192 (256 MiB:
        # breaks run outside the pool, their outputs copied in) stays cached, on the capture
        # lane, where every later capture reuses it. Static buffers of 8 and 2 MiB share a
        # 20 MiB allocator segment: a little slack.
        assert grown <= memory.total_bytes + (256 + 24) * MIB, (grown / MIB, memory)
        settled = _settled_reserved() - before
        assert settled <= memory.total_bytes + 24 * MIB, (settled / MIB, memory)
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
        # and the break's own 256 MiB, allocated outside the pool, cached on the lane
        assert grown <= pool + (256 + 2) * MIB, (grown / MIB, pool / MIB)
        settled = _settled_reserved() - before
        assert settled <= pool + 2 * MIB, (settled / MIB, pool / MIB)
        x.copy_(x.flip(0))
        graph.replay()
        assert torch.equal(out, model(x))


def test_a_breaks_temporaries_are_not_graph_memory() -> None:
    """A break's temporaries (at warm-up and at capture) are allocated outside the pool: a
    replay allocates them outside too, and a pool never gives memory back. Only its output is
    copied into the pool (the bridge). Engines hit this with attention over a maximal KV read
    at warm-up (transformers' continuous batching: about 1.9 GB at 8B dims)."""
    scratch_elems = 64 * MIB  # 256 MiB of float32

    @eager_on_graph(name="big scratch")
    def wide(h: torch.Tensor) -> torch.Tensor:
        scratch = torch.ones(scratch_elems, device=h.device)  # freed before the break returns
        return h * scratch[: h.numel()].view_as(h) + 1

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=gen).cuda()

    def model(x: torch.Tensor) -> torch.Tensor:
        return wide(x @ w) @ w

    x = torch.randn(64, 256, generator=gen).cuda()
    with torch.no_grad():
        runner = BreakableGraphRunner(model, device="cuda", warmup_iters=2)
        runner.capture(x)
        memory = runner.graph_memory()
        assert memory.pool_bytes is not None and memory.pool_bytes < 64 * MIB, memory
        assert memory.bridge_bytes == 0  # the output was copied into the pool
        for _ in range(3):
            x.copy_(torch.randn(64, 256, generator=gen).cuda())
            assert torch.equal(runner(x), model(x))
        runner.reset()
