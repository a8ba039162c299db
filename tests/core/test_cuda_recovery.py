"""After a failed capture, torch itself is usable again: eager CUDA random numbers work and the
same graph captures and replays (the library, not a test fixture, repairs torch's state)."""

from __future__ import annotations

import gc

import pytest
import torch

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, is_breakable_capture_active

pytestmark = pytest.mark.cuda


def test_eager_rng_and_recapture_work_after_a_failed_capture() -> None:
    x = torch.ones(64, device="cuda")
    graph = BreakableCUDAGraph()
    with pytest.raises(RuntimeError), BreakableCUDAGraphCapture(graph):
        y = x * 2
        y.sum().item()  # a host sync inside a segment invalidates the capture
    assert not is_breakable_capture_active()
    assert not torch.cuda.is_current_stream_capturing()
    noise = torch.randn(1024, device="cuda")  # fails if the generator were left capturing
    assert noise.std().item() > 0.5
    graph.reset()
    with BreakableCUDAGraphCapture(graph):
        out = x * 3 + torch.rand(64, device="cuda") * 0
    for value in (1.0, 2.0, 5.0):
        x.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full((64,), 3 * value, device="cuda"))


def _reserved_after_collect() -> int:
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def _fail_capture(graph: BreakableCUDAGraph, x: torch.Tensor) -> None:
    with pytest.raises(RuntimeError), BreakableCUDAGraphCapture(graph):
        held = [x * 2 for _ in range(4)]  # 16 MiB in the pool before the failure
        held[0].sum().item()  # a host sync invalidates the capture
    graph.reset()


def test_failed_captures_give_their_pool_memory_back() -> None:
    # torch's failed capture_end keeps the pool reference its capture_begin took, and the
    # graph moves to a fresh pool id; each failure used to keep its 16 MiB for the process.
    x = torch.ones(1 << 20, device="cuda")
    graph = BreakableCUDAGraph()
    _fail_capture(graph, x)  # lane, workspace and caches made once
    before = _reserved_after_collect()
    for _ in range(40):
        _fail_capture(graph, x)
    after = _reserved_after_collect()
    assert after - before <= 64 << 20, f"40 failed captures kept {(after - before) >> 20} MiB"
    with BreakableCUDAGraphCapture(graph):
        out = x * 3
    x.fill_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 6.0))


def test_failed_captures_into_a_shared_pool_keep_the_other_graph_working() -> None:
    x = torch.ones(1 << 20, device="cuda")
    keeper = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(keeper):
        kept = x + 1
    failing = BreakableCUDAGraph(pool=keeper.pool())
    _fail_capture(failing, x)
    before = _reserved_after_collect()
    for _ in range(20):
        _fail_capture(failing, x)
        x.fill_(4.0)
        keeper.replay()  # its segment lives in the pool's old id, which it still holds
        torch.cuda.synchronize()
        assert torch.equal(kept, torch.full_like(x, 5.0))
    assert _reserved_after_collect() - before <= 64 << 20
    with BreakableCUDAGraphCapture(failing):
        doubled = x * 2
    x.fill_(1.5)
    failing.replay()
    keeper.replay()
    torch.cuda.synchronize()
    assert torch.equal(doubled, torch.full_like(x, 3.0))
    assert torch.equal(kept, torch.full_like(x, 2.5))
    del keeper, kept, failing, doubled
    assert _reserved_after_collect() <= before
