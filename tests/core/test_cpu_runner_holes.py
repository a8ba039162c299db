"""Holes an adversarial review found in the runner, on the CPU backend (2026-12-04): each was
a silently wrong value, an argument update lost, or a raw error, and is now right."""

from __future__ import annotations

import pytest
import torch

from bcg_core import BreakableGraphRunner, CaptureCheck, check_capture, eager_on_graph


def test_an_expanded_input_and_a_transposed_one_are_different_signatures() -> None:
    # An expanded tensor's stride-0 dimension sorted as innermost, so it shared a transposed
    # tensor's key while its static buffer (clone's) is row-major: the replay summed in
    # another order.
    def step(x: torch.Tensor) -> torch.Tensor:
        return x.sum(1)

    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0)
    n = 64
    expanded = torch.randn(1, n, generator=torch.Generator().manual_seed(0)).expand(n, n)
    runner.capture(expanded)
    transposed = torch.randn(n, n, generator=torch.Generator().manual_seed(1)).t()
    assert torch.equal(runner(transposed), step(transposed))
    assert runner.stats.misses == 1 and runner.stats.hits == 0
    other = torch.randn(1, n).expand(n, n)
    assert torch.equal(runner(other), step(other))
    assert runner.stats.hits == 1


_writes = {"on": False}


@eager_on_graph(name="rh.update")
def _update(cache: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    if _writes["on"]:  # host state the break re-reads at every replay
        cache.add_(h)
    return cache * 1.0


def _cache_step(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    return _update(cache, x * 2) + 1


def test_a_break_writing_an_argument_only_after_the_capture_is_copied_back() -> None:
    _writes["on"] = False
    runner = BreakableGraphRunner(_cache_step, device="cpu")
    runner.capture(torch.ones(3), torch.zeros(3))
    _writes["on"] = True
    try:
        eager_cache, cache, x = torch.zeros(3), torch.zeros(3), torch.ones(3)
        for _ in range(3):
            assert torch.equal(runner(x, cache), _cache_step(x, eager_cache))
            assert torch.equal(cache, eager_cache)
        assert torch.equal(cache, torch.full((3,), 6.0))
        assert runner.stats.hits == 3
    finally:
        _writes["on"] = False


_fail = {"on": False}


@eager_on_graph(name="rh.fail")
def _maybe_fail(h: torch.Tensor) -> torch.Tensor:
    if _fail["on"]:
        raise RuntimeError("engine error")
    return h.cos()


def test_a_replay_that_raises_still_copies_back_what_ran_before() -> None:
    def step(x: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        counter.add_(1)
        return _maybe_fail(x * 2) + counter

    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0)
    counter = torch.zeros(2)
    runner.capture(torch.ones(2), counter)
    assert torch.equal(counter, torch.ones(2))
    _fail["on"] = True
    try:
        with pytest.raises(RuntimeError, match="engine error"):
            runner(torch.ones(2), counter)
        assert torch.equal(counter, torch.full((2,), 2.0))  # as eager leaves it
    finally:
        _fail["on"] = False
    out = runner(torch.ones(2), counter)
    assert torch.equal(counter, torch.full((2,), 3.0))
    assert torch.equal(out, torch.ones(2).mul(2).cos() + 3)


@eager_on_graph(name="rh.cos")
def _cos(h: torch.Tensor) -> torch.Tensor:
    return h.cos() + 1


def test_check_divergence_of_an_inference_capture_outside_inference_mode() -> None:
    runner = BreakableGraphRunner(lambda x: _cos(x * 2) * 3, device="cpu")
    with torch.inference_mode():
        runner.capture(torch.randn(4))
    assert runner.check_divergence(torch.randn(4)).status == "ok"
    x = torch.randn(4)
    assert torch.equal(runner(x), _cos(x * 2) * 3)


def test_check_divergence_runs_a_break_calling_its_runner_eagerly() -> None:
    holder: dict[str, BreakableGraphRunner | None] = {"runner": None}

    @eager_on_graph(name="rh.reenter")
    def reenter(h: torch.Tensor) -> torch.Tensor:
        runner = holder["runner"]
        if runner is not None:
            holder["runner"] = None  # one level deep
            try:
                side = runner(torch.full((4,), 100.0))
            finally:
                holder["runner"] = runner
            return h.cos() + 0 * side.sum()
        return h.cos()

    def step(x: torch.Tensor) -> torch.Tensor:
        return reenter(x * 2) * 3 + x

    runner = BreakableGraphRunner(step, device="cpu")
    runner.capture(torch.randn(4))
    holder["runner"] = runner
    x = torch.randn(4)
    assert torch.equal(runner(x), step(x))
    assert runner.check_divergence(x).status == "ok"


def test_as_tensor_names_are_found_at_their_position_in_a_compiled_module() -> None:
    class Scale(torch.nn.Module):
        def forward(self, x: torch.Tensor, t: float) -> torch.Tensor:
            return x * t + 1

    module = Scale()
    runner = BreakableGraphRunner(
        torch.compile(module, backend="eager"), device="cpu", as_tensor=("t",)
    )
    x = torch.randn(3)
    runner.capture(x, 0.5)
    for value in (0.25, 2.0, 4.0):
        assert torch.equal(runner(x, value), module(x, value))
    assert runner.stats.hits == 3 and runner.stats.misses == 0


def test_check_capture_returns_the_public_capture_check() -> None:
    report = check_capture(lambda x: _cos(x * 2) * 2, torch.ones(2))
    assert isinstance(report, CaptureCheck)
    assert report == CaptureCheck(ok=True, segments=2, breaks=1)


def test_calls_while_graphs_are_disabled_count_as_misses() -> None:
    # They were counted nowhere: hits 3, misses 0 read as a 100% hit rate while half the calls
    # ran eagerly.
    from bcg_core import disable_breakable_graphs

    runner = BreakableGraphRunner(lambda x: x * 2, device="cpu", warmup_iters=0)
    x = torch.ones(3)
    runner.capture(x)
    for _ in range(3):
        assert torch.equal(runner(x), x * 2)
    assert not runner.serves_eagerly
    with disable_breakable_graphs():
        assert runner.serves_eagerly
        for _ in range(3):
            assert torch.equal(runner(x), x * 2)
    stats = runner.stats
    assert (stats.hits, stats.misses, stats.captures) == (3, 3, 1)


def test_a_raw_capture_refusal_says_what_to_do() -> None:
    # torch's own message for a pageable host-to-device copy in a CUDA capture names no fix;
    # the capture's note and the runner's reason add one (raised here as torch raises it).
    from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, is_breakable_capture_active

    message = (
        "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
        "tensor is pinned."
    )

    def step(x: torch.Tensor) -> torch.Tensor:
        if is_breakable_capture_active():
            raise RuntimeError(message)
        return x + 1

    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.raises(RuntimeError, match="Cannot copy") as caught,
        BreakableCUDAGraphCapture(graph),
    ):
        step(torch.ones(2))
    assert any("Build that tensor on the device" in note for note in caught.value.__notes__)
    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0)
    x = torch.ones(2)
    assert torch.equal(runner.capture(x), x + 1)
    (why,) = runner.blocked_signatures.values()
    assert why.startswith("RuntimeError: Cannot copy") and "@eager_on_graph" in why
    assert torch.equal(runner(x), x + 1)
