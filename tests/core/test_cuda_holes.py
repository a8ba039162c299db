"""The holes an adversarial review found on the CPU backend (2026-12-04), on CUDA: break
arguments are aliases there (their own version counters), bridges live in the graph's pool,
and autocast picks other kernels."""

from __future__ import annotations

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    BreakOutputError,
    CaptureError,
    eager_on_graph,
    enable_breakable_cuda_graph,
)

pytestmark = pytest.mark.cuda

_writes = {"on": False}


@eager_on_graph(name="ch.update")
def _update(cache: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    if _writes["on"]:
        cache.add_(h)
    return cache * 1.0


def _cache_step(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    return _update(cache, x * 2) + 1


def test_a_break_writing_an_argument_only_after_the_capture_is_copied_back() -> None:
    _writes["on"] = False
    runner = BreakableGraphRunner(_cache_step)
    runner.capture(torch.ones(3, device="cuda"), torch.zeros(3, device="cuda"))
    _writes["on"] = True
    try:
        x = torch.ones(3, device="cuda")
        eager_cache, cache = torch.zeros(3, device="cuda"), torch.zeros(3, device="cuda")
        for _ in range(3):
            assert torch.equal(runner(x, cache), _cache_step(x, eager_cache))
            assert torch.equal(cache, eager_cache)
        assert torch.equal(cache, torch.full((3,), 6.0, device="cuda"))
        assert runner.stats.hits == 3
    finally:
        _writes["on"] = False


_views = {"same": True}


@eager_on_graph(name="ch.views")
def _views_of_one(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = t * 2
    return (y, y[1:]) if _views["same"] else (y, (t * 3)[1:])


def test_outputs_that_view_one_tensor_replay_and_a_changed_relation_is_refused() -> None:
    x = torch.arange(5.0, device="cuda")
    graph = BreakableCUDAGraph()
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = tuple(v + 0 for v in _views_of_one(x))
    x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], x * 2) and torch.equal(out[1], (x * 2)[1:])
    _views["same"] = False
    try:
        with pytest.raises(BreakOutputError, match="views of one tensor"):
            graph.replay()
    finally:
        _views["same"] = True
    torch.cuda.synchronize()


@eager_on_graph(name="ch.transpose")
def _transpose_in_place(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h.t_()
    return h @ w


def test_a_break_changing_an_argument_layout_is_refused_and_the_graph_recaptures() -> None:
    x, w = torch.randn(3, 3, device="cuda"), torch.randn(3, 3, device="cuda")
    graph = BreakableCUDAGraph()
    with (
        pytest.raises(CaptureError, match="changed the layout"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        _transpose_in_place(x + 1, w)
    assert not torch.cuda.is_current_stream_capturing()
    graph.reset()
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = (x + 1) @ w
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, (x + 1) @ w)


@eager_on_graph(name="ch.fast")
def _fast_path(t: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("no fast kernel for this shape")


def test_code_catching_a_break_error_at_capture_goes_on_in_a_new_segment() -> None:
    x = torch.randn(64, device="cuda")
    graph = BreakableCUDAGraph()
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        try:
            y = _fast_path(x)
        except NotImplementedError:
            y = x.softmax(-1)
        out = y * 2
    x.copy_(torch.randn(64, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x.softmax(-1) * 2)


@eager_on_graph(name="ch.scores")
def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return (q @ k.T).softmax(-1).float()


def test_breaks_replay_under_their_capture_autocast_and_inference_mode() -> None:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(8, 64, generator=gen).cuda()
    k = torch.randn(8, 64, generator=gen).cuda()
    w = torch.randn(64, 64, generator=gen).cuda()

    def step() -> torch.Tensor:
        return _scores((x @ w).float(), k) * 2

    graph = BreakableCUDAGraph()
    with (
        torch.inference_mode(),
        torch.autocast("cuda", dtype=torch.bfloat16),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        out = step()
    x.copy_(torch.randn(8, 64, generator=gen).cuda())
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        want = step()
    graph.replay()  # neither mode here
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_a_pool_that_is_no_pool_is_refused_and_a_pool_handle_is_taken() -> None:
    for bad in ("pool", 3, (1,), (1.0, 2.0), object()):
        with pytest.raises(TypeError, match="must be a graph memory pool"):
            BreakableCUDAGraph(pool=bad)
        with pytest.raises(TypeError, match="must be a graph memory pool"):
            BreakableGraphRunner(torch.nn.Identity(), pool=bad)
        with pytest.raises(TypeError, match="must be a graph memory pool"):
            BreakableCUDAGraphCapture(BreakableCUDAGraph(), pool=bad)
    handle = torch.cuda.graph_pool_handle()
    graph = BreakableCUDAGraph(pool=handle)
    x = torch.ones(3, device="cuda")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = x + 1
    x.fill_(4)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full((3,), 5.0, device="cuda"))


def test_a_host_tensor_copied_in_a_segment_is_refused_with_what_to_do() -> None:
    """A tensor built on the host and moved to the GPU inside the step (diffusers' rotary
    tables in QwenImage, LTX-2...): torch refuses the pageable copy in a capture; bcg's note and
    the runner's reason say what to do, and the runner serves the step eagerly, equal."""

    def step(x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(4, dtype=x.dtype).to("cuda")

    graph = BreakableCUDAGraph()
    x = torch.ones(4, device="cuda")
    refused = pytest.raises(RuntimeError, match="Cannot copy between CPU and CUDA")
    with refused as caught, enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        step(x)
    assert any("Build that tensor on the device" in note for note in caught.value.__notes__)
    runner = BreakableGraphRunner(step, warmup_iters=1)
    assert torch.equal(runner.capture(x), step(x))
    (why,) = runner.blocked_signatures.values()
    assert "Cannot copy between CPU and CUDA" in why and "@eager_on_graph" in why
    assert torch.equal(runner(x), step(x))


def test_a_break_calling_a_runner_of_the_same_pool_leaves_the_running_graph_intact() -> None:
    # The outer graph keeps h alive across its break; a runner captured later in the same pool
    # may be given h's block for its own intermediates. Its replay inside the outer replay (the
    # break calls it) overwrote h before the outer graph read it again; it now runs eagerly.
    n = 1 << 18
    inner = BreakableGraphRunner(lambda t: (t * 5).sin() * 7, warmup_iters=1)

    @eager_on_graph(name="cuda_holes.calls_inner")
    def calls_inner(t: torch.Tensor) -> torch.Tensor:
        return inner(t)

    def outer_step(x: torch.Tensor) -> torch.Tensor:
        h = (x * 3).cos()  # read again after the break
        return calls_inner(x + 1) + h

    outer = BreakableGraphRunner(outer_step, warmup_iters=1, pool=inner.pool)
    x = torch.randn(n, device="cuda")
    outer.capture(x)
    inner.capture(x + 1)
    for _ in range(3):
        y = torch.randn(n, device="cuda")
        want = ((y + 1) * 5).sin() * 7 + (y * 3).cos()
        torch.testing.assert_close(outer(y), want, rtol=0, atol=1e-5)
    assert outer.stats.hits == 3
