"""Bridges in the graph's pool, on a real GPU.

A break runs at capture outside the graph's pool, its outputs are copied into the pool, and
its bridge holds the pooled copy through a non-owning alias: the memory costs what a graph
intermediate costs. These tests check where the memory lives (read from the allocator's own
snapshot, not through bcg), that it costs no more than plain CUDA graphs of the same code, and
the two use-after-free shapes reported against other breakable-graph implementations: a bridge
held weakly outside any pool (the general allocator hands its block out again) and break inputs
whose blocks later captures into the same pool reuse.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from cuda_helpers import randn, refresh

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, eager_on_graph

pytestmark = pytest.mark.cuda

MiB = 1 << 20
HIDDEN = 1024
REPLAYS = 3


@eager_on_graph(name="gelu")
def gelu_break(h: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(h)


def _block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = x @ w1
    h = gelu_break(h)  # the capture-time input is dropped here, the output after the matmul
    return h @ w2


def _pool_usage(pool_id: Any) -> tuple[int, int]:
    """(bytes reserved, bytes allocated) in one pool, from torch's allocator snapshot."""
    want = tuple(pool_id)
    segments = [
        s
        for s in torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
        if tuple(s.get("segment_pool_id", ())) == want
    ]
    return sum(s["total_size"] for s in segments), sum(s["allocated_size"] for s in segments)


def _in_pool(ptr: int, pool_id: Any) -> bool:
    want = tuple(pool_id)
    return any(
        s["address"] <= ptr < s["address"] + s["total_size"]
        for s in torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
        if tuple(s.get("segment_pool_id", ())) == want
    )


@pytest.fixture
def weights() -> tuple[torch.Tensor, torch.Tensor]:
    return randn(HIDDEN, HIDDEN) / HIDDEN**0.5, randn(HIDDEN, HIDDEN) / HIDDEN**0.5


@pytest.fixture
def stream(weights: tuple[torch.Tensor, torch.Tensor]) -> Iterator[torch.cuda.Stream]:
    """One capture stream for plain and breakable graphs, warmed up so that its cuBLAS
    workspace exists before any capture (else it would land in whichever pool came first)."""
    s = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _block(randn(64, HIDDEN), *weights)
    torch.cuda.synchronize()
    yield s
    torch.cuda.synchronize()


def _graph_memory(
    kind: str,
    rows: list[int],
    weights: tuple[torch.Tensor, torch.Tensor],
    stream: torch.cuda.Stream,
) -> tuple[int, int, list[Callable[[], None]]]:
    """Capture ``_block`` for each row count into one pool, largest first. Returns the pool's
    reserved bytes, the bytes left allocated outside the pool by the captures, and one check
    per graph (replay it with fresh input, compare with eager)."""
    xs = [randn(n, HIDDEN) for n in rows]
    bcg_first = BreakableCUDAGraph()
    pool = torch.cuda.graph_pool_handle() if kind == "plain" else bcg_first.pool().id
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    checks: list[Callable[[], None]] = []
    for i, x in enumerate(xs):
        if kind == "plain":
            plain = torch.cuda.CUDAGraph()
            with torch.cuda.graph(plain, pool=pool, stream=stream):
                out = _block(x, *weights)
            replay = plain.replay
        else:
            graph = bcg_first if i == 0 else BreakableCUDAGraph(pool=bcg_first.pool())
            with BreakableCUDAGraphCapture(graph, stream=stream):
                out = _block(x, *weights)
            replay = graph.replay

        def check(
            x: torch.Tensor = x, out: torch.Tensor = out, replay: Callable[[], None] = replay
        ) -> None:
            refresh(x)
            replay()
            assert torch.equal(out, _block(x, *weights))

        checks.append(check)
    torch.cuda.synchronize()
    gc.collect()
    reserved, allocated = _pool_usage(pool)
    outside = torch.cuda.memory_allocated() - before - allocated
    return reserved, outside, checks


def test_bridge_lives_in_the_pool_and_is_held_like_an_intermediate(
    weights: tuple[torch.Tensor, torch.Tensor], stream: torch.cuda.Stream
) -> None:
    seen: list[weakref.ref[torch.Tensor]] = []
    ptrs: list[int] = []
    graph = BreakableCUDAGraph()
    x = randn(512, HIDDEN)
    with BreakableCUDAGraphCapture(graph, stream=stream):
        h = gelu_break(x @ weights[0])
        seen.append(weakref.ref(h))
        ptrs.append(h.untyped_storage().data_ptr())  # looked up after the capture
        out = h @ weights[1]
        del h
    gc.collect()
    # A pool keeps its segments while a graph uses it, so the freed block is still there.
    assert _in_pool(ptrs[0], graph.pool().id), "the break's output is not in the graph's pool"
    assert seen[0]() is None, "the bridge holds its pooled tensor strongly"
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        assert torch.equal(out, _block(x, *weights))


def test_memory_matches_plain_cuda_graphs_in_one_pool(
    weights: tuple[torch.Tensor, torch.Tensor], stream: torch.cuda.Stream
) -> None:
    # 16 and 10 MiB tensors: each is its own allocator segment, so the totals compare exactly.
    rows = [4096, 2560]
    plain_reserved, plain_outside, plain_checks = _graph_memory("plain", rows, weights, stream)
    bcg_reserved, bcg_outside, bcg_checks = _graph_memory("bcg", rows, weights, stream)
    assert bcg_outside <= plain_outside + MiB, (
        f"bcg left {bcg_outside / MiB:.1f} MiB allocated outside the pool "
        f"(plain graphs: {plain_outside / MiB:.1f} MiB)"
    )
    assert bcg_reserved <= plain_reserved + 2 * MiB, (
        f"bcg pool {bcg_reserved / MiB:.1f} MiB, plain graphs {plain_reserved / MiB:.1f} MiB"
    )
    for check in [*plain_checks, *bcg_checks, *reversed(bcg_checks)]:
        check()


def test_graphs_sharing_a_pool_share_bridge_memory(
    weights: tuple[torch.Tensor, torch.Tensor], stream: torch.cuda.Stream
) -> None:
    # Eight graphs of one shape: plain graphs need one more output block per graph and share
    # every intermediate; so must bcg, bridges included (strong bridges: one more per graph).
    rows = [1024] * 8
    plain_reserved, _, _ = _graph_memory("plain", rows, weights, stream)
    bcg_reserved, bcg_outside, checks = _graph_memory("bcg", rows, weights, stream)
    block = 1024 * HIDDEN * 4
    assert bcg_outside < block
    assert bcg_reserved <= plain_reserved + 2 * MiB, (
        f"bcg pool {bcg_reserved / MiB:.1f} MiB, plain graphs {plain_reserved / MiB:.1f} MiB"
    )
    for check in [*checks, *reversed(checks), *checks[::3]]:
        check()


# -- use-after-free shapes ---------------------------------------------------------------------


def _churn(*shape: int) -> None:
    """Allocate and overwrite blocks of the general allocator (what freed memory goes to)."""
    junk = [torch.full(shape, float("nan"), device="cuda") for _ in range(8)]
    del junk


def test_pooled_bridge_survives_allocator_churn_and_later_captures(
    weights: tuple[torch.Tensor, torch.Tensor], stream: torch.cuda.Stream
) -> None:
    # A weakly held bridge outside any pool is handed out again by the general allocator (the
    # eager-output use-after-free); a pooled one can only go to captures into the same pool,
    # whose replays are serialised with this graph's and write before they read.
    x = randn(256, HIDDEN)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph, stream=stream):
        out = _block(x, *weights)
    y = randn(256, HIDDEN)
    other = BreakableCUDAGraph(pool=graph.pool())
    with BreakableCUDAGraphCapture(other, stream=stream):
        # eager at capture, writing into blocks the first graph freed; NaN at every replay
        nan = gelu_break(y * float("nan"))
        out_other = nan + y
    for _ in range(REPLAYS):
        _churn(256, HIDDEN)
        refresh(x)
        graph.replay()
        _churn(256, HIDDEN)
        assert torch.equal(out, _block(x, *weights))
        other.replay()
        assert torch.isnan(out_other).all()
        graph.replay()
        assert torch.equal(out, _block(x, *weights))


def test_output_outside_the_pool_is_held_strongly(stream: torch.cuda.Stream) -> None:
    premade = [randn(256)]  # allocated before the capture: outside the pool
    probe: list[weakref.ref[torch.Tensor]] = []

    @eager_on_graph(name="premade")
    def take(t: torch.Tensor) -> torch.Tensor:
        if premade:
            out = premade[0]  # still held by the list: not the output's alone, so not pooled
            probe.append(weakref.ref(out))
            return torch.add(t * 2, 1, out=out)
        return t * 2 + 1

    x = randn(256)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph, stream=stream):
        out = take(x.sin()).cos()
    premade.clear()  # now only the graph can keep it
    gc.collect()
    assert probe[0]() is not None, "a bridge outside the pool must be held by the graph"
    for _ in range(REPLAYS):
        _churn(256)
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out, (x.sin() * 2 + 1).cos())


def test_break_inputs_reused_by_a_later_capture_stay_correct(
    weights: tuple[torch.Tensor, torch.Tensor], stream: torch.cuda.Stream
) -> None:
    # Capture A, replay it, capture B (smaller, same pool: it is given A's freed break inputs
    # and bridges), then replay in A, B, A order: every replay writes before it reads. As with
    # torch.cuda.graph, B's output may live in memory A's replay rewrites: read it before.
    xa, xb = randn(1024, HIDDEN), randn(512, HIDDEN)
    graph_a = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph_a, stream=stream):
        out_a = _block(xa, *weights)
    graph_a.replay()
    graph_b = BreakableCUDAGraph(pool=graph_a.pool())
    with BreakableCUDAGraphCapture(graph_b, stream=stream):
        out_b = _block(xb, *weights)
    for _ in range(REPLAYS):
        refresh(xa, xb)
        graph_a.replay()
        assert torch.equal(out_a, _block(xa, *weights))
        graph_b.replay()
        assert torch.equal(out_b, _block(xb, *weights))
        graph_a.replay()
        assert torch.equal(out_a, _block(xa, *weights))


def test_conjugate_views_through_a_break_replay_as_eager(stream: torch.cuda.Stream) -> None:
    # A lazily conjugated view as a break's argument and as its output: the argument alias and
    # the pooled copy of the output keep the values the views read (a view of the same bytes
    # without the bit reads the conjugate).
    @eager_on_graph(name="conj")
    def flip(z: torch.Tensor) -> torch.Tensor:
        return (z * 2).conj()

    x = torch.randn(64, dtype=torch.complex64).cuda()

    def step() -> torch.Tensor:
        return flip((x + 1).conj()) * 3

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph, stream=stream):
        out = step()
    for _ in range(REPLAYS):
        x.copy_(torch.randn(64, dtype=torch.complex64).cuda())
        graph.replay()
        assert torch.equal(out, step())


def test_expanded_break_output_replays_as_eager(stream: torch.cuda.Stream) -> None:
    # A broadcast (stride-0) view as a break's output, copied into the pool with its layout:
    # each replay writes its first elements along the repeated dimension.
    @eager_on_graph(name="expand")
    def spread(h: torch.Tensor) -> torch.Tensor:
        return (h * 2).expand(8, 256)

    x = randn(256)

    def step() -> torch.Tensor:
        return spread(x.sin()) + 1

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph, stream=stream):
        out = step()
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        assert torch.equal(out, step())


def test_only_outputs_nothing_else_holds_are_pooled(stream: torch.cuda.Stream) -> None:
    # A view of the break's cache is held as it is (the code after the break writes into the
    # cache through it); the fresh sum and a view of a dead temporary go to the pool.
    cache = torch.zeros(4, HIDDEN, device="cuda")
    kept: list[torch.Tensor] = []

    @eager_on_graph(name="cache_write")
    def cache_write(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache[0].copy_(h[0])
        out = h.sum(0)
        kept[:] = [h * 3]
        return cache[:1], out, (h * 2).t()

    x = randn(8, HIDDEN)

    def step() -> torch.Tensor:
        view, total, flipped = cache_write(x + 1)
        view.mul_(3)
        return view.sum(1) + total.sum() + flipped.sum()

    graph = BreakableCUDAGraph()
    ptrs: list[int] = []
    with BreakableCUDAGraphCapture(graph, stream=stream):
        view, total, flipped = cache_write(x + 1)
        ptrs += [view.data_ptr(), total.data_ptr(), flipped.untyped_storage().data_ptr()]
        view.mul_(3)
        out = view.sum(1) + total.sum() + flipped.sum()
        del view, total, flipped
    gc.collect()
    pool = graph.pool().id
    assert ptrs[0] == cache.data_ptr()
    assert [_in_pool(p, pool) for p in ptrs] == [False, True, True]
    for _ in range(REPLAYS):
        refresh(x)
        cache.zero_()
        graph.replay()
        replayed, written = out.clone(), cache.clone()
        cache.zero_()
        assert torch.equal(replayed, step())
        assert torch.equal(written, cache)
