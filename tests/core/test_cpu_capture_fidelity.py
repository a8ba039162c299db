"""Capture that is faithful to eager, works under torch.compile, is named in profiles, and catches
tensors a break leaks to later segments.

Scenarios on the shared ``device`` fixture run on the CPU backend here and on CUDA graphs on a
GPU with the same assertions; the others exercise CPU-backend rules.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import bcg_core
from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    CaptureError,
    ReplayError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    keep_alive_ok,
)


def _graph(**kwargs: Any) -> BreakableCUDAGraph:
    return BreakableCUDAGraph(backend=torch.get_default_device().type, **kwargs)


def _capture(fn: Callable[[], Any], graph: BreakableCUDAGraph, **kwargs: Any) -> Any:
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph, **kwargs):
        return fn()


# -- faithful capture ----------------------------------------------------------------------------


@eager_on_graph(name="take_top")
def _take_top(scores: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # Sizes an allocation from a value a segment computed: garbage unless capture is faithful.
    k = int(scores.sum().item())
    out.zero_()
    out[:k] = torch.arange(k, dtype=out.dtype, device=out.device) + scores[0]
    return out * 2


@pytest.mark.usefixtures("device")
def test_break_sizes_an_allocation_from_a_segment_output_without_a_stub() -> None:
    x = torch.full((4,), 0.5)
    buf = torch.zeros(8)

    def step() -> torch.Tensor:
        scores = x + 1.25  # sum 7.0: the break takes .item() of it at capture
        return _take_top(scores, buf) + 1

    expected = step().clone()  # one eager step
    buf.zero_()
    graph = _graph()
    out = _capture(step, graph)
    # The capture block leaves every output (and the in-place buffer) equal to one eager step.
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert float(buf[6]) == 7.75 and float(buf[7]) == 0.0
    x.fill_(0.25)  # replay: the break re-reads the new sum (1.5 + 4 * 0.25 ... = 6)
    graph.replay()
    buf_eager = torch.zeros(8)
    want = _take_top.__wrapped__(x + 1.25, buf_eager) + 1  # type: ignore[attr-defined]
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.usefixtures("device")
def test_capture_block_leaves_a_kv_style_update_applied_once() -> None:
    cache = torch.zeros(4)
    x = torch.ones(4)

    @eager_on_graph(name="scale")
    def scale(t: torch.Tensor) -> torch.Tensor:
        return t * float(t[0].item())

    def step() -> torch.Tensor:
        cache.add_(x)  # in place: applied exactly once by the capture block, as by eager
        return scale(cache + 1)

    graph = _graph()
    out = _capture(step, graph)
    assert cache.tolist() == [1.0] * 4
    assert out.tolist() == [4.0] * 4
    graph.replay()
    assert cache.tolist() == [2.0] * 4 and out.tolist() == [9.0] * 4


def test_faithful_is_validated_and_off_changes_nothing_on_cpu() -> None:
    graph = BreakableCUDAGraph(backend="cpu")
    with pytest.raises(TypeError, match="faithful must be a bool"):
        BreakableCUDAGraphCapture(graph, faithful="yes")  # type: ignore[arg-type]
    x = torch.ones(3)
    # The CPU recorder runs every op to record it: a capture is faithful either way.
    out = _capture(lambda: _take_top(x + 1, torch.zeros(8)), graph, faithful=False)
    assert out.tolist()[:6] == [4.0, 6.0, 8.0, 10.0, 12.0, 14.0]


# -- CPU backend: 0-dim operands from outside the graph ------------------------------------------


def test_cpu_host_scalar_that_changes_refuses_replay_naming_the_op() -> None:
    sigma = torch.tensor(0.5)  # a scheduler's sigma kept on the host
    x = torch.ones(4)
    graph = BreakableCUDAGraph(backend="cpu")
    out = _capture(lambda: x * sigma, graph)
    graph.replay()  # unchanged: fine
    assert out.tolist() == [0.5] * 4
    sigma.fill_(0.25)
    with pytest.raises(ReplayError, match=r"aten\.mul\.Tensor.*0-dim tensor.*0\.5 -> 0\.25"):
        graph.replay()


def test_cpu_zero_dim_values_made_by_the_graph_or_a_break_replay_freely() -> None:
    x = torch.ones(4)

    @eager_on_graph(name="norm")
    def norm(t: torch.Tensor) -> torch.Tensor:
        return t.sum()  # a 0-dim break output, bridged

    def step() -> torch.Tensor:
        total = (x * 2).sum()  # 0-dim, made by a segment
        return x * total + x * norm(x)

    graph = BreakableCUDAGraph(backend="cpu")
    out = _capture(step, graph)
    for value in (2.0, 3.0):
        x.fill_(value)
        graph.replay()
        assert out.tolist() == [value * (8 * value) + value * (4 * value)] * 4


# -- torch.compile -------------------------------------------------------------------------------

# backend="eager": dynamo's graph breaks are what is tested, and inductor would spend seconds of
# C++ compilation on this 2-core CI box for nothing the test looks at.
_calls: list[int] = []


@eager_on_graph(name="compiled.brk")
def _counted(t: torch.Tensor) -> torch.Tensor:
    _calls.append(1)
    return t * 2


def _compiled_step(x: torch.Tensor) -> torch.Tensor:
    return _counted(x + 1).sin() + 3


def test_break_inside_a_compiled_function_stays_a_break() -> None:
    compiled = torch.compile(_compiled_step, backend="eager")
    x = torch.randn(6)
    compiled(x)  # warm up (compiles)
    graph = BreakableCUDAGraph(backend="cpu")
    _calls.clear()
    out = _capture(lambda: compiled(x), graph)
    assert graph.num_breaks == 1 and graph.break_names == ("compiled.brk",)
    assert graph.num_segments == 2 and len(_calls) == 1
    for _ in range(3):
        x.copy_(torch.randn(6))
        graph.replay()
        torch.testing.assert_close(out, _compiled_step(x), rtol=0, atol=0)
    assert len(_calls) == 1 + 3 + 3  # capture, replays, eager references


def test_capturing_a_compiled_function_without_breaks_on_cpu() -> None:
    compiled = torch.compile(lambda t: torch.tanh(t @ t.T) + 1, backend="aot_eager")
    x = torch.randn(3, 3)
    graph = BreakableCUDAGraph(backend="cpu")
    out = _capture(lambda: compiled(x), graph)
    x.copy_(torch.randn(3, 3))
    graph.replay()
    torch.testing.assert_close(out, torch.tanh(x @ x.T) + 1)


# -- profiler names ------------------------------------------------------------------------------


def _names(graph: BreakableCUDAGraph) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        graph.replay()
    return [e.name for e in prof.events() if e.name.startswith("bcg.")]


def test_profile_names_every_segment_and_break(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.ones(4)

    def step() -> torch.Tensor:
        return _counted(x + 1) + 1

    graph = BreakableCUDAGraph(backend="cpu", profile=True)
    _capture(step, graph)
    assert _names(graph) == ["bcg.segment[0]", "bcg.break:compiled.brk", "bcg.segment[1]"]
    quiet = BreakableCUDAGraph(backend="cpu")
    _capture(step, quiet)
    assert _names(quiet) == []
    monkeypatch.setenv("BCG_PROFILE", "1")
    by_env = BreakableCUDAGraph(backend="cpu")
    _capture(step, by_env)
    assert _names(by_env)[1] == "bcg.break:compiled.brk"
    with pytest.raises(TypeError, match="profile must be a bool"):
        BreakableCUDAGraph(backend="cpu", profile="on")  # type: ignore[arg-type]


# -- debug: tensors a break leaves alive ---------------------------------------------------------


class _Meta:
    cached: torch.Tensor | None = None


@eager_on_graph(name="caches_on_meta")
def _caches(meta: _Meta, x: torch.Tensor) -> None:
    meta.cached = x * 3  # a fresh tensor a later segment reads: stale at every replay


@eager_on_graph(name="well_behaved")
def _well_behaved(meta: _Meta, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(x * 3)  # in place into an argument
    meta.cached = keep_alive_ok(torch.ones(2))  # marked: allocated once on purpose
    return x + 1  # returned: bridged


@pytest.mark.usefixtures("device")
def test_debug_reports_a_break_caching_a_fresh_tensor_on_an_object() -> None:
    meta, x = _Meta(), torch.ones(16)

    def step() -> torch.Tensor:
        _caches(meta, x)
        assert meta.cached is not None
        return meta.cached + 1

    with pytest.raises(CaptureError, match=r"'caches_on_meta' created 1 .* \(64 bytes\)"):
        _capture(step, _graph(), debug="strict")
    with pytest.warns(RuntimeWarning, match="caches_on_meta"):
        _capture(step, _graph(), debug=True)


@pytest.mark.usefixtures("device")
def test_debug_accepts_in_place_writes_returned_and_marked_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BCG_DEBUG", "strict")
    meta, x, out = _Meta(), torch.ones(16), torch.zeros(16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = _capture(lambda: _well_behaved(meta, x, out) * 2, _graph())
    assert y.tolist() == [4.0] * 16 and out.tolist() == [3.0] * 16
    with pytest.raises(ValueError, match="debug must be"):
        BreakableCUDAGraphCapture(_graph(), debug="loud")


def test_keep_alive_ok_outside_a_checked_break_is_a_no_op() -> None:
    t = torch.ones(1)
    assert keep_alive_ok(t) is t
    assert "keep_alive_ok" in bcg_core.__all__


# -- capture cost ------------------------------------------------------------------------------


def test_capture_collects_garbage_only_when_torch_is_told_to() -> None:
    collections: list[int] = []

    def observe(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    step = lambda: torch.ones(2) + 1  # noqa: E731
    gc.disable()  # no automatic collections: any one seen was asked for
    gc.callbacks.append(observe)
    try:
        _capture(step, BreakableCUDAGraph(backend="cpu"))
        assert collections == []
        with torch.compiler.config.patch(force_cudagraph_gc=True):
            _capture(step, BreakableCUDAGraph(backend="cpu"))
        assert collections == [2]
    finally:
        gc.callbacks.remove(observe)
        gc.enable()
