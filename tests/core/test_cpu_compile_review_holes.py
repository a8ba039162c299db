"""Compiled breaks that failed a review of torch.compile with breaks, on the CPU backend: each was
a raw internal error or a result that differed from the same function run eagerly. Every
compiled result is compared with the function uncompiled.

Backend ``aot_eager`` (dynamo and AOTAutograd, which make the op opaque); inductor would spend
minutes of C++ compilation on this 2-core box.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakOutputError,
    break_graph,
    eager_on_graph,
    enable_breakable_cuda_graph,
)


@eager_on_graph(name="cr.scale_into")
def _scale_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(x * 2)  # writes an argument: the layout's dry run reads version counters
    return x + 1


def _uses_scale_into_in_inference_mode(x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = torch.zeros_like(x)
        y = _scale_into(x.cos(), out)
        return y * out


def test_a_compiled_break_called_in_inference_mode_compiles() -> None:
    # The dry run's fake copies were inference tensors, which have no version counter: the
    # compile failed with torch's raw "Inference tensors do not track version counter".
    torch._dynamo.reset()
    compiled = torch.compile(_uses_scale_into_in_inference_mode, backend="aot_eager")
    for _ in range(2):
        x = torch.randn(5)
        assert torch.equal(compiled(x), _uses_scale_into_in_inference_mode(x))


@eager_on_graph(name="cr.described")
def _described(x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    # plain values of the kinds a break may return: a string, a dtype, a device, nested
    return x * 2, ("mean", torch.float64, x.device, {"tag": "a", "n": 3})


def _uses_described(x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    y, (reduction, dtype, device, extra) = _described(x.cos())
    out = (y.mean() if reduction == "mean" else y.sum()).to(dtype).to(device) * extra["n"]
    return out, (reduction, dtype, device, extra)


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_a_compiled_break_returning_strings_dtypes_and_devices_compiles_with_fullgraph(
    backend: str,
) -> None:
    # Dynamo refuses such values as the nonstrict call's output: fullgraph=True failed with its
    # raw "Unsupported output type for nonstrict_trace-ed function".
    torch._dynamo.reset()
    compiled = torch.compile(_uses_described, backend=backend, fullgraph=True)
    for _ in range(2):
        x = torch.randn(4)
        got, want = compiled(x), _uses_described(x)
        assert torch.equal(got[0], want[0]) and got[0].dtype == torch.float64
        assert got[1] == want[1]


_WEIGHT = torch.nn.Parameter(torch.randn(4, 4))


@eager_on_graph(name="cr.project")
def _project(x: torch.Tensor) -> torch.Tensor:
    return x @ _WEIGHT  # a parameter it does not take as an argument


def _loss(x: torch.Tensor) -> torch.Tensor:
    return (_project(x.relu()) * 2).sum()


def test_a_compiled_break_using_a_parameter_it_does_not_take_trains() -> None:
    # The opaque op has no backward: compiled, its output required no grad, so backward()
    # failed ("does not require grad"), or with another trained tensor in the loss, the
    # parameter silently got no gradient.
    torch._dynamo.reset()
    compiled = torch.compile(_loss, backend="aot_eager")
    x = torch.randn(2, 4)
    _WEIGHT.grad = None
    _loss(x).backward()
    want, _WEIGHT.grad = _WEIGHT.grad, None
    compiled(x).backward()
    assert want is not None and _WEIGHT.grad is not None
    assert torch.equal(_WEIGHT.grad, want)
    with torch.no_grad():  # inference still compiles the break as one op
        assert torch.equal(torch.compile(_loss, backend="aot_eager", fullgraph=True)(x), _loss(x))


_MIX = torch.randn(4, 4)


@eager_on_graph(name="cr.mix")
def _mix(x: torch.Tensor) -> torch.Tensor:
    return x @ _MIX  # autocast makes this a bfloat16 matmul


def _mixed_inside(x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _mix(x.sin()) + 1


def _mixed(x: torch.Tensor) -> torch.Tensor:
    return _mix(x.sin()) + 1


@pytest.mark.parametrize("where", ["inside", "around"])
def test_a_compiled_break_runs_under_the_callers_autocast(where: str) -> None:
    # The compiled code runs without autocast's state (its casts are in the graph), so the
    # break ran its matmul in float32: another dtype and other values than eager's.
    torch._dynamo.reset()
    fn = _mixed_inside if where == "inside" else _mixed
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "around"):
        got, want = compiled(x), fn(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)


@eager_on_graph(name="cr.inner")
def _inner(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@eager_on_graph(name="cr.outer")
def _outer(x: torch.Tensor) -> torch.Tensor:
    return _inner(x) * 2  # a break that calls another: one break, the inner a plain call


def _calls_outer(x: torch.Tensor) -> torch.Tensor:
    y = _outer(x.sin()) + 1
    break_graph()
    return y.cos()


def test_a_compiled_break_calling_a_break_is_captured_and_replays_right() -> None:
    # Under the CPU recorder dynamo skips the compiled frame, but it compiled the frames
    # entered inside the break (bcg's own and the break's body), deferring the capture's
    # "in a break" mark past the inner call: the capture failed an internal assertion
    # ("end_segment() outside a segment").
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_calls_outer, backend=counter)
    x = torch.randn(3)
    assert torch.equal(compiled(x), _calls_outer(x))  # warm-up: compiles
    compiled_frames = counter.frame_count
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        static = compiled(x)
    assert graph.break_names == ("cr.outer",) and graph.num_segments == 3
    assert counter.frame_count == compiled_frames  # nothing of bcg's (63 frames) compiled
    for _ in range(2):
        x.copy_(torch.randn(3))
        graph.replay()
        assert torch.equal(static, _calls_outer(x))


def _float_stub(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.float32)


@eager_on_graph(name="cr.widened", capture_stub=_float_stub)
def _widened(x: torch.Tensor) -> torch.Tensor:
    return x.double() * 3  # the stub says float32


@eager_on_graph(name="cr.positives", capture_stub=lambda x: torch.empty_like(x))
def _positives(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0] * 3  # the stub says the input's shape


@pytest.mark.parametrize("brk", [_widened, _positives], ids=["dtype", "shape"])
@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_a_compiled_break_output_unlike_its_stub_is_refused_by_name(brk: Any, backend: str) -> None:
    # The compiled code after the op is built for the stub's dtype and shape: inductor read
    # the float64 output's memory as float32 (4, 7, -2, 10 came back as 48, 96, -3, 9), and
    # the other backends computed with an output of another dtype or shape than traced.
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: brk(x) + 1, backend=backend, fullgraph=True)
    name = "cr.widened" if brk is _widened else "cr.positives"
    with pytest.raises(BreakOutputError, match=rf"{name}.*capture_stub"):
        compiled(torch.tensor([1.0, 2.0, -1.0, 3.0]))
