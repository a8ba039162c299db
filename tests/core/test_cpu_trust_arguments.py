"""Arguments a replay cannot serve as it was captured, on the shared ``device`` fixture (the
CPU graph backend, and CUDA where a GPU is): each was a silently wrong result or an unclear
crash, and is now an eager run, a separate signature or an output without autograd history."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import warnings
from typing import Any

import pytest
import torch

from bcg_core import BreakableGraphRunner, disable_breakable_graphs, eager_on_graph, signature_of
from bcg_core._runner.overlap import Layout, may_overlap  # noqa: PLC2701


def _bump_then_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a.add_(1)
    return a + b


# -- a written argument sharing memory with another ----------------------------------------------


def test_one_tensor_passed_twice_to_a_step_that_writes_it_runs_eagerly(
    device: str, caplog: pytest.LogCaptureFixture
) -> None:
    runner = BreakableGraphRunner(_bump_then_add, device=device, warmup_iters=0)
    x, y = torch.ones(3, device=device), torch.ones(3, device=device)
    assert torch.equal(runner.capture(x, y), torch.full((3,), 3.0, device=device))
    x = torch.ones(3, device=device)
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        out = runner(x, x)
    # Eager: x becomes 2, then 2 + 2. Two static buffers would give 2 + 1.
    assert torch.equal(out, torch.full((3,), 4.0, device=device))
    assert torch.equal(x, torch.full((3,), 2.0, device=device))
    assert "args[0] and args[1] of this call share memory" in caplog.text
    assert runner.stats.misses == 1 and runner.stats.hits == 0
    x, y = torch.ones(3, device=device), torch.ones(3, device=device)
    assert torch.equal(runner(x, y), torch.full((3,), 3.0, device=device))  # still replays
    assert runner.stats.hits == 1


def test_a_capture_with_overlapping_written_arguments_keeps_no_graph(device: str) -> None:
    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.mul_(2)
        return b.clone()

    runner = BreakableGraphRunner(step, device=device, warmup_iters=1)
    z = torch.arange(4.0, device=device)
    # Eager: z[:3] doubled in place, then z[1:] read: [2, 4, 3].
    assert torch.equal(runner.capture(z[:3], z[1:]), torch.tensor([2.0, 4.0, 3.0], device=device))
    assert torch.equal(z, torch.tensor([0.0, 2.0, 4.0, 3.0], device=device))
    assert runner.stats.captures == 0 and runner.stats.failed_captures == 0
    assert runner.blocked_signatures == {}  # separate tensors of this signature still capture
    a, b = torch.ones(3, device=device), torch.ones(3, device=device)
    assert torch.equal(runner.capture(a, b), torch.ones(3, device=device))
    assert runner.stats.captures == 1


def test_disjoint_slices_of_one_tensor_replay(device: str) -> None:
    # A KV cache passed as per-layer slices of one allocation: no overlap, no eager run.
    def step(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k.add_(1)
        v.add_(2)
        return k + v

    runner = BreakableGraphRunner(step, device=device, warmup_iters=0)
    cache = torch.zeros(2, 3, device=device)
    runner.capture(cache[0], cache[1])
    cache = torch.zeros(2, 3, device=device)
    assert torch.equal(runner(cache[0], cache[1]), torch.full((3,), 3.0, device=device))
    assert torch.equal(cache, torch.tensor([[1.0] * 3, [2.0] * 3], device=device))
    assert runner.stats.hits == 1 and runner.stats.misses == 0


def test_a_tensor_passed_twice_to_a_step_that_only_reads_it_replays(device: str) -> None:
    runner = BreakableGraphRunner(lambda a, b: a * b, device=device, warmup_iters=0)
    runner.capture(torch.ones(3, device=device), torch.ones(3, device=device))
    x = torch.arange(3.0, device=device)
    assert torch.equal(runner(x, x), x * x)
    assert runner.stats.hits == 1


# -- tensors that are not plain dense tensors -----------------------------------------------------


class _Tagged(torch.Tensor):
    pass


def test_sparse_nested_and_subclass_tensors_are_objects_of_the_signature() -> None:
    dense = torch.ones(2, 2)
    sparse = torch.eye(2).to_sparse()
    tagged = torch.ones(2, 2).as_subclass(_Tagged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    plain = signature_of((dense,), {})
    for other in (sparse, tagged, nested):
        sig = signature_of((other,), {})
        assert sig != plain
        assert sig[1][0][0] == "object"
    assert "sparse_coo" in signature_of((sparse,), {})[1][0][1]


def test_a_sparse_tensor_of_the_captured_shape_runs_eagerly() -> None:
    runner = BreakableGraphRunner(lambda x: x * 2, device="cpu", warmup_iters=0)
    runner.capture(torch.ones(2, 2))
    sparse = torch.eye(2).to_sparse()
    for _ in range(2):  # the second call would meet the last hit's guard
        out = runner(sparse)
        assert out.layout == torch.sparse_coo
        assert torch.equal(out.to_dense(), torch.eye(2) * 2)
    tagged = runner(torch.ones(2, 2).as_subclass(_Tagged))
    assert type(tagged) is _Tagged
    assert runner.stats.misses == 3
    assert torch.equal(runner(torch.ones(2, 2)), torch.full((2, 2), 2.0))
    assert runner.stats.hits == 1


def test_a_failed_sparse_capture_does_not_block_the_dense_signature() -> None:
    runner = BreakableGraphRunner(lambda x: x * 2, device="cpu", warmup_iters=0)
    with runner.warmup():
        runner(torch.eye(2).to_sparse())  # cannot be captured: eager, its own signature blocked
        assert torch.equal(runner(torch.ones(2, 2)), torch.full((2, 2), 2.0))
    assert runner.stats.captures == 1
    assert torch.equal(runner(torch.ones(2, 2)), torch.full((2, 2), 2.0))
    assert runner.stats.hits == 1


# -- autograd and inference mode ------------------------------------------------------------------


def test_replay_outputs_carry_no_autograd_history(device: str) -> None:
    lin = torch.nn.Linear(2, 2).to(device)
    runner = BreakableGraphRunner(lin, device=device, warmup_iters=1)
    captured = runner.capture(torch.ones(1, 2, device=device))
    x = torch.randn(1, 2, device=device, requires_grad=True)
    out = runner(x)
    for t in (captured, out):
        assert t.grad_fn is None and not t.requires_grad
    assert torch.allclose(out, lin(x).detach())
    # A backward through the capture's graph would read overwritten memory; now it is refused.
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()
    assert lin.weight.grad is None


@eager_on_graph(name="trust_args.double")
def _double(y: torch.Tensor) -> torch.Tensor:
    return y * 2


def _step(x: torch.Tensor) -> torch.Tensor:
    return _double(x + 1) + 1


@pytest.mark.parametrize("captured_in_inference", [True, False])
def test_a_graph_replays_in_either_inference_mode(device: str, captured_in_inference: bool) -> None:
    runner = BreakableGraphRunner(_step, device=device, warmup_iters=1)
    with torch.inference_mode(captured_in_inference):
        runner.capture(torch.ones(2, device=device))
    for mode in (not captured_in_inference, captured_in_inference):
        with torch.inference_mode(mode):
            out = runner(torch.full((2,), 2.0, device=device))
            assert out.is_inference() is mode  # what eager gives in that mode
        assert torch.equal(out, torch.full((2,), 7.0, device=device))
        if not mode:
            out.add_(1)  # a normal tensor: writable outside inference mode
    assert runner.stats.hits == 2


# -- capture_many's report ------------------------------------------------------------------------


@eager_on_graph(name="trust_args.inc")
def _inc(y: torch.Tensor) -> torch.Tensor:
    return y + 1


def test_capture_many_reports_the_calls_a_disabled_runner_did_not_capture() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return _inc(x * 2) * 3

    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0, max_segments=1)
    report = runner.capture_many([((torch.ones(n),), {}) for n in (3, 2, 1)])
    assert report.captured == ()
    assert len(report.failed) == 3  # used to report nothing captured and nothing failed
    assert "more than max_segments=1" in report.failed[0][1]
    assert all(why.startswith("the runner is disabled") for _, why in report.failed)


def test_capture_many_reports_calls_under_disabled_graphs() -> None:
    runner = BreakableGraphRunner(lambda x: x * 2, device="cpu", warmup_iters=0)
    with disable_breakable_graphs():
        report = runner.capture_many([((torch.ones(n),), {}) for n in (1, 2)])
    assert report.captured == () and len(report.failed) == 2
    assert all("breakable graphs are disabled" in why for _, why in report.failed)
    again = runner.capture_many([((torch.ones(n),), {}) for n in (1, 2)])
    assert len(again.captured) == 2 and again.failed == ()
    replayed = runner.capture_many([((torch.ones(n),), {}) for n in (1, 2)])
    assert replayed.captured == () and replayed.failed == ()  # replays are not reported


@eager_on_graph(name="trust_args.tanh")
def _tanh_noting_grad(h: torch.Tensor) -> torch.Tensor:
    _GRAD_SEEN.append(torch.is_grad_enabled())
    return h.tanh()


_GRAD_SEEN: list[bool] = []


def test_a_no_grad_capture_serves_inference_mode_callers_with_their_state(device: str) -> None:
    w = torch.randn(16, 16, device=device)

    def step(x: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        h = _tanh_noting_grad(x @ w)
        kv.index_copy_(0, pos, h)
        pos.add_(1)
        return h.sum(0) + kv.sum(0)

    def state() -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.zeros(1, dtype=torch.long, device=device),
            torch.zeros(8, 16, device=device),
        )

    runner = BreakableGraphRunner(step, device=device)
    with torch.no_grad():
        runner.capture(torch.randn(1, 16, device=device), *state())
    with torch.inference_mode():  # per-request state made in inference mode, written back
        x = torch.randn(1, 16, device=device)
        pos, kv = state()
        want_pos, want_kv = state()
        want = step(x, want_pos, want_kv)
        _GRAD_SEEN.clear()
        got = runner(x, pos, kv)
    assert torch.equal(got, want) and torch.equal(pos, want_pos) and torch.equal(kv, want_kv)
    assert _GRAD_SEEN == [False]  # the break runs with the caller's grad mode
    assert runner.stats.hits == 1


# -- objects the call passed in come back as themselves ------------------------------------------


class _Cache:
    def __init__(self, device: str) -> None:
        self.k = torch.zeros(4, device=device)


def test_an_object_the_call_passed_in_comes_back_as_itself(device: str) -> None:
    def step(x: torch.Tensor, cache: _Cache) -> dict[str, Any]:
        cache.k.add_(x)
        return {"y": x * 2, "cache": cache}

    cache = _Cache(device)
    runner = BreakableGraphRunner(step, device=device, warmup_iters=0)
    first = runner.capture(torch.ones(4, device=device), cache)
    out = runner(torch.ones(4, device=device), first["cache"])  # the loop `cache = out.cache`
    assert out["cache"] is cache  # was a copy with cloned tensors: a new address, a miss
    assert torch.equal(out["y"], torch.full((4,), 2.0, device=device))
    assert torch.equal(cache.k, torch.full((4,), 2.0, device=device))
    assert runner.stats.hits == 1 and runner.stats.misses == 0
    y = out["y"]
    runner(torch.full((4,), 3.0, device=device), cache)
    assert torch.equal(y, torch.full((4,), 2.0, device=device))  # fresh tensors still cloned


def test_interleaved_views_of_one_cache_replay(device: str) -> None:
    # A paged K/V cache [layers, 2, ...]: cache[:, 0] and cache[:, 1] interleave without
    # sharing an element. Comparing byte ranges alone sent every call eagerly.
    def step(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k.add_(1)
        v.add_(2)
        return k.sum() + v.sum()

    cache = torch.zeros(3, 2, 4, device=device)
    runner = BreakableGraphRunner(step, device=device, warmup_iters=0)
    runner.capture(cache[:, 0], cache[:, 1])
    for _ in range(2):
        runner(cache[:, 0], cache[:, 1])
    assert runner.stats.captures == 1 and runner.stats.hits == 2 and runner.stats.misses == 0
    assert torch.equal(cache[:, 0], torch.full((3, 4), 3.0, device=device))
    assert torch.equal(cache[:, 1], torch.full((3, 4), 6.0, device=device))


@dataclasses.dataclass
class _Meta:
    view: torch.Tensor


def test_a_written_argument_viewed_by_an_object_argument_runs_eagerly(device: str) -> None:
    def step(x: torch.Tensor, meta: _Meta) -> torch.Tensor:
        x.fill_(5.0)
        return meta.view * 2

    x = torch.zeros(3, device=device)
    runner = BreakableGraphRunner(step, device=device, warmup_iters=0)
    out = runner.capture(x, _Meta(x))
    assert torch.equal(out, torch.full((3,), 10.0, device=device))  # was the stale 0
    assert runner.stats.captures == 0


def _elements(t: torch.Tensor, base: int) -> set[int]:
    idx = [
        sum(i * s for i, s in zip(ix, t.stride(), strict=True))
        for ix in itertools.product(*(range(n) for n in t.shape))
    ]
    return {(t.data_ptr() - base) // t.element_size() + i for i in idx}


def test_the_exact_overlap_test_agrees_with_counting_elements() -> None:
    gen = torch.Generator().manual_seed(0)
    storage = torch.zeros(4096)
    base = storage.data_ptr()
    for _ in range(400):
        views = []
        for _ in range(2):
            dims = int(torch.randint(1, 4, (), generator=gen))
            shape = [int(torch.randint(1, 5, (), generator=gen)) for _ in range(dims)]
            stride = [int(torch.randint(0, 40, (), generator=gen)) for _ in range(dims)]
            offset = int(torch.randint(0, 200, (), generator=gen))
            views.append(storage.as_strided(shape, stride, offset))
        a, b = views
        truth = bool(_elements(a, base) & _elements(b, base))
        assert may_overlap(Layout.of(a), Layout.of(b)) == truth, (a.shape, a.stride(), b.stride())


# -- layouts --------------------------------------------------------------------------------------


def test_a_transposed_input_is_another_signature_than_a_row_major_one(device: str) -> None:
    runner = BreakableGraphRunner(lambda x: x.sum(0), device=device, warmup_iters=0)
    gen = torch.Generator().manual_seed(0)
    transposed = torch.randn(1000, 7, generator=gen, device="cpu").to(device).t()
    runner.capture(transposed)
    row_major = torch.randn(7, 1000, generator=gen, device="cpu").to(device)
    for _ in range(2):  # the second call would meet the last hit's guard
        assert torch.equal(runner(row_major), row_major.sum(0))  # eager: a miss, bitwise
    assert runner.stats.misses == 2 and runner.stats.hits == 0
    other = torch.randn(1000, 7, generator=gen, device="cpu").to(device).t()
    assert torch.equal(runner(other), other.sum(0))
    assert runner.stats.hits == 1


def test_a_slice_of_a_row_major_tensor_shares_the_contiguous_signature(device: str) -> None:
    # prompt[:, -1:] at capture, argmax outputs at decode: both give a row-major buffer.
    runner = BreakableGraphRunner(lambda ids: ids * 2, device=device, warmup_iters=0)
    prompt = torch.arange(12, device=device).reshape(2, 6)
    runner.capture(prompt[:, -1:])
    nxt = torch.tensor([[1], [2]], device=device)
    assert torch.equal(runner(nxt), nxt * 2)
    assert runner.stats.hits == 1


def test_one_output_tensor_returned_twice_stays_one_after_detaching() -> None:
    lin = torch.nn.Linear(2, 2)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = lin(x)
        return y, y

    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0, return_views=True)
    a, b = runner.capture(torch.ones(1, 2))
    assert a is b and not a.requires_grad
