"""Capture and replay on a real GPU: where breaks sit, what they take and return, stubs,
barriers, reset, shared pools, aliasing of break inputs, and the capture/replay context queries.

Every scenario replays at least three times with fresh random data copied into the static inputs
and compares against eager code run on the same inputs.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any, NamedTuple

import pytest
import torch
from cuda_helpers import assert_idle, randn, refresh

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakOutputError,
    ReplayError,
    break_graph,
    eager_on_graph,
    get_current_stream,
    is_breakable_capture_active,
)

pytestmark = pytest.mark.cuda

REPLAYS = 3


# -- break functions used by several tests -----------------------------------------------------


@eager_on_graph
def affine_break(t: torch.Tensor) -> torch.Tensor:
    return t * 2 + 1


@eager_on_graph(name="plus_one")
def plus_one(t: torch.Tensor) -> torch.Tensor:
    return t + 1


@eager_on_graph(name="times_two")
def times_two(t: torch.Tensor) -> torch.Tensor:
    return t * 2


@eager_on_graph(name="minus_three")
def minus_three(t: torch.Tensor) -> torch.Tensor:
    return t - 3


# -- where breaks sit --------------------------------------------------------------------------


def test_break_at_start() -> None:
    x = randn(16, 16)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        y = affine_break(x)
        out = y.sin() + x
    assert_idle()
    assert graph.step_kinds == ("break", "graph")
    assert graph.num_segments == 1
    assert graph.num_breaks == 1
    assert graph.break_names == ("affine_break",)
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(y, x * 2 + 1)
        torch.testing.assert_close(out, (x * 2 + 1).sin() + x)


def test_break_at_end() -> None:
    x = randn(16, 16)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        y = x.cos() * 3
        out = plus_one(y)
    assert_idle()
    assert graph.step_kinds == ("graph", "break")
    assert graph.num_segments == 1
    assert graph.break_names == ("plus_one",)
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out, x.cos() * 3 + 1)


def test_many_breaks_in_a_row_launch_no_empty_segment() -> None:
    x = randn(32)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        y = x.exp()
        a = plus_one(y)
        b = times_two(a)
        c = minus_three(b)
        out = c.tanh()
    assert graph.step_kinds == ("graph", "break", "break", "break", "graph")
    assert graph.num_segments == 2
    assert graph.num_breaks == 3
    assert graph.break_names == ("plus_one", "times_two", "minus_three")
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        expected = ((x.exp() + 1) * 2 - 3).tanh()
        torch.testing.assert_close(c, (x.exp() + 1) * 2 - 3)
        torch.testing.assert_close(out, expected)


def test_only_breaks_capture_no_segment() -> None:
    x = randn(32)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        a = plus_one(x)
        b = times_two(a)
    assert graph.step_kinds == ("break", "break")
    assert graph.num_segments == 0
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(b, (x + 1) * 2)


def test_break_graph_splits_without_eager_step() -> None:
    x = randn(8, 8)
    break_graph()  # a no-op outside a capture
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        break_graph()  # at the start: the empty first segment is dropped
        y = x * 2
        break_graph()
        z = y + 1
        break_graph()
        break_graph()  # adjacent splits: no empty segment in between
        out = z.relu() - x
        break_graph()  # at the end: the empty last segment is dropped
    assert_idle()
    assert graph.step_kinds == ("graph", "graph", "graph")
    assert graph.num_segments == 3
    assert graph.num_breaks == 0
    assert graph.break_names == ()
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out, (x * 2 + 1).relu() - x)


# -- what breaks take --------------------------------------------------------------------------


class Scaler:
    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.calls = 0

    @eager_on_graph
    def scale(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return t * self.factor

    def shift(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return t + self.factor


def test_bound_methods_as_breaks() -> None:
    scaler = Scaler(1.5)
    shift = eager_on_graph(scaler.shift)  # decorating a bound method
    x = randn(4, 32)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        a = scaler.scale(x.sin())
        b = shift(a * 2)
        out = b.square()
    assert graph.step_kinds == ("graph", "break", "graph", "break", "graph")
    assert graph.break_names == ("Scaler.scale", "Scaler.shift")
    assert scaler.calls == 2
    for i in range(REPLAYS):
        refresh(x)
        graph.replay()
        assert scaler.calls == 2 + 2 * (i + 1)
        torch.testing.assert_close(out, (x.sin() * 1.5 * 2 + 1.5).square())


@eager_on_graph(name="combine")
def combine(*tensors: torch.Tensor, scale: float = 1.0, bias: torch.Tensor | None = None) -> Any:
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    total = total * scale
    return total if bias is None else total + bias


def test_args_and_kwargs() -> None:
    x = randn(64)
    bias = randn(64)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        a = x * 2
        b = x.sin()
        c = bias.cos()
        mixed = combine(a, b, x, scale=0.5, bias=c)
        plain = combine(a, b)
        out = mixed * 3 + plain
    assert graph.step_kinds == ("graph", "break", "break", "graph")
    assert graph.break_names == ("combine", "combine")
    for _ in range(REPLAYS):
        refresh(x, bias)
        graph.replay()
        expected_mixed = (x * 2 + x.sin() + x) * 0.5 + bias.cos()
        torch.testing.assert_close(mixed, expected_mixed)
        torch.testing.assert_close(out, expected_mixed * 3 + (x * 2 + x.sin()))


class Meta(NamedTuple):
    scale: float
    name: str


@eager_on_graph(name="nested_args")
def nested_args(payload: dict[str, Any], extra: list[Any]) -> torch.Tensor:
    first, second = payload["cuda"]
    meta: Meta = payload["meta"]
    assert meta.name == "meta" and payload["count"] == 3 and payload["none"] is None
    cpu = payload["cpu"].to(first.device)
    (inner,) = extra[0]
    return (first + second * meta.scale) * payload["count"] + cpu + inner * extra[1]["w"]


def _nested_eager(
    x: torch.Tensor, y: torch.Tensor, cpu: torch.Tensor, weight: float
) -> torch.Tensor:
    first, second, inner = x.sin(), y * 2, x - y
    return (first + second * 0.25) * 3 + cpu.to("cuda") + inner * weight


def test_nested_containers_of_cuda_cpu_and_non_tensors() -> None:
    x = randn(8, 8)
    y = randn(8, 8)
    cpu = torch.randn(8, 8)  # stored as it is: in-place updates are seen at replay
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        payload = {
            "cuda": [x.sin(), y * 2],
            "cpu": cpu,
            "meta": Meta(0.25, "meta"),
            "count": 3,
            "none": None,
        }
        extra = [(x - y,), {"w": 0.5}]
        got = nested_args(payload, extra)
        out = got.abs()
    assert graph.step_kinds == ("graph", "break", "graph")
    for _ in range(REPLAYS):
        refresh(x, y)
        cpu.copy_(torch.randn(8, 8))
        graph.replay()
        torch.testing.assert_close(got, _nested_eager(x, y, cpu, 0.5))
        torch.testing.assert_close(out, _nested_eager(x, y, cpu, 0.5).abs())


# -- what breaks return ------------------------------------------------------------------------


@dataclasses.dataclass
class Pair:
    p: torch.Tensor
    q: torch.Tensor


class Box:
    def __init__(self, p: torch.Tensor, q: torch.Tensor) -> None:
        self.p = p
        self.q = q
        self.tag = "box"


def _pack(kind: str, p: torch.Tensor, q: torch.Tensor) -> Any:
    if kind == "tensor":
        return p
    if kind == "tuple":
        return (p, q)
    if kind == "list":
        return [p, q]
    if kind == "dict":
        return {"p": p, "q": q}
    if kind == "dataclass":
        return Pair(p, q)
    if kind == "object":
        return Box(p, q)
    assert kind == "nested"
    return {"outer": [(p, 3), {"q": q}], "tag": "nested"}


def _unpack(kind: str, obj: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "tensor":
        return obj, obj
    if kind in ("tuple", "list"):
        return obj[0], obj[1]
    if kind == "dict":
        return obj["p"], obj["q"]
    if kind in ("dataclass", "object"):
        return obj.p, obj.q
    return obj["outer"][0][0], obj["outer"][1]["q"]


@eager_on_graph(name="pack")
def pack_break(kind: str, t: torch.Tensor) -> Any:
    return _pack(kind, t.sin(), t * 3)


KINDS = ["tensor", "tuple", "list", "dict", "dataclass", "object", "nested"]


@pytest.mark.parametrize("kind", KINDS)
def test_outputs_are_bridged_across_replays(kind: str) -> None:
    x = randn(16, 16)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        t = x * 2
        result = pack_break(kind, t)
        p, q = _unpack(kind, result)
        out = p * q + 1
    assert graph.step_kinds == ("graph", "break", "graph")
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        exp_p = (x * 2).sin()
        exp_q = exp_p if kind == "tensor" else x * 2 * 3
        torch.testing.assert_close(out, exp_p * exp_q + 1)
        # the object returned at capture is the bridge: it holds this replay's output
        got_p, got_q = _unpack(kind, result)
        torch.testing.assert_close(got_p, exp_p)
        torch.testing.assert_close(got_q, exp_q)


def test_returned_output_stays_valid_across_replays() -> None:
    x = randn(128)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        returned = affine_break(x.sigmoid())
        out = returned * 2
    kept = returned  # the capture-time object, read after every replay
    ptr = kept.data_ptr()
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        assert kept.data_ptr() == ptr
        torch.testing.assert_close(kept, x.sigmoid() * 2 + 1)
        torch.testing.assert_close(out, (x.sigmoid() * 2 + 1) * 2)


# -- strict breaks -----------------------------------------------------------------------------


def _return_tensor(t: torch.Tensor) -> Any:
    return t + 1


def _return_nested(t: torch.Tensor) -> Any:
    return {"a": [1, (t + 1,)], "b": "x"}


def _return_in_object(t: torch.Tensor) -> Any:
    return Box(t.cpu(), t + 1)


@pytest.mark.parametrize(
    "body", [_return_tensor, _return_nested, _return_in_object], ids=["tensor", "nested", "object"]
)
def test_strict_rejects_cuda_output_at_capture(body: Any) -> None:
    strict_break = eager_on_graph(strict=True, name="strict_break")(body)
    x = randn(8)
    graph = BreakableCUDAGraph()
    with pytest.raises(BreakOutputError, match="strict_break"), BreakableCUDAGraphCapture(graph):
        y = x * 2
        strict_break(y)
    assert_idle()
    assert not graph.is_captured
    with pytest.raises(ReplayError):
        graph.replay()


@eager_on_graph(strict=True, name="write_into")
def write_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    torch.mul(src.cos(), 2, out=dst)


@eager_on_graph(strict=True, name="strict_cpu")
def strict_cpu(src: torch.Tensor) -> Any:
    return {"n": 7, "cpu": torch.ones(2)}  # no CUDA tensor: allowed under strict


def test_strict_break_writing_into_argument_buffer() -> None:
    x = randn(32, 32)
    buf = torch.empty(32, 32, device="cuda")
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        y = x + 1
        write_into(y, buf)
        info = strict_cpu(y)
        out = buf * info["n"]
    assert graph.step_kinds == ("graph", "break", "break", "graph")
    for _ in range(REPLAYS):
        refresh(x)
        buf.zero_()
        graph.replay()
        torch.testing.assert_close(buf, (x + 1).cos() * 2)
        torch.testing.assert_close(out, (x + 1).cos() * 2 * 7)


# -- stubs and barriers ------------------------------------------------------------------------


def test_capture_stub_runs_at_capture_and_real_function_at_replay() -> None:
    calls = {"stub": 0, "real": 0}

    def stub(t: torch.Tensor) -> torch.Tensor:
        calls["stub"] += 1
        return torch.zeros_like(t)

    def real_math(t: torch.Tensor) -> torch.Tensor:
        return t.sin() * 2

    def real_fn(t: torch.Tensor) -> torch.Tensor:
        calls["real"] += 1
        return real_math(t)

    real = eager_on_graph(capture_stub=stub, name="real")(real_fn)
    x = randn(64)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        y = x + 1
        z = real(y)
        out = z + y
    assert calls == {"stub": 1, "real": 0}
    for i in range(REPLAYS):
        refresh(x)
        graph.replay()
        assert calls == {"stub": 1, "real": i + 1}
        expected = real_math(x + 1)  # what the real function computes on the same inputs
        torch.testing.assert_close(z, expected)
        torch.testing.assert_close(out, expected + x + 1)


def test_barrier_runs_before_each_break_at_capture_only() -> None:
    log: list[str] = []

    def barrier() -> None:
        log.append("barrier")

    @eager_on_graph(name="first")
    def first(t: torch.Tensor) -> torch.Tensor:
        log.append("first")
        return t + 1

    @eager_on_graph(name="second")
    def second(t: torch.Tensor) -> torch.Tensor:
        log.append("second")
        return t * 2

    x = randn(16)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph, barrier_fn=barrier):
        a = first(x * 3)
        b = second(a.sin())
        out = b - 1
    assert log == ["barrier", "first", "barrier", "second"]
    for _ in range(REPLAYS):
        log.clear()
        refresh(x)
        graph.replay()
        assert log == ["first", "second"]
        torch.testing.assert_close(out, (x * 3 + 1).sin() * 2 - 1)


# -- reset and shared pools --------------------------------------------------------------------


def test_reset_then_recapture_a_different_function() -> None:
    x = randn(16, 16)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        out1 = plus_one(x * 2).sin()
    assert graph.step_kinds == ("graph", "break", "graph")
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out1, (x * 2 + 1).sin())

    graph.reset()
    assert not graph.is_captured
    assert graph.step_kinds == ()
    with pytest.raises(ReplayError):
        graph.replay()

    with BreakableCUDAGraphCapture(graph):
        h = x.cos()
        h = times_two(h)
        h = minus_three(h + x)
        out2 = h.abs()
    assert_idle()
    assert graph.step_kinds == ("graph", "break", "graph", "break", "graph")
    assert graph.break_names == ("times_two", "minus_three")
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(out2, (x.cos() * 2 + x - 3).abs())


def test_shared_pool_graphs_of_different_shapes_replayed_a_b_a() -> None:
    graph_a = BreakableCUDAGraph()
    graph_b = BreakableCUDAGraph(pool=graph_a.pool())
    assert graph_b.pool() == graph_a.pool()
    xa = randn(16, 32)
    xb = randn(64, 8)
    with BreakableCUDAGraphCapture(graph_a):
        tmp = xa.sin() * 2  # a temporary freed during capture: its block may go to B
        ya = plus_one(tmp).relu() + xa
        del tmp
    with BreakableCUDAGraphCapture(graph_b):
        tmp = xb.exp()
        yb = times_two(tmp) - xb
        del tmp
    assert graph_a.step_kinds == ("graph", "break", "graph")
    assert graph_b.step_kinds == ("graph", "break", "graph")

    def check_a() -> None:
        refresh(xa)
        graph_a.replay()
        torch.testing.assert_close(ya, (xa.sin() * 2 + 1).relu() + xa)

    for _ in range(REPLAYS):
        check_a()
        refresh(xb)
        graph_b.replay()
        torch.testing.assert_close(yb, xb.exp() * 2 - xb)
        check_a()


# -- break inputs are aliases, not references --------------------------------------------------


@eager_on_graph(name="consume")
def consume(t: torch.Tensor) -> torch.Tensor:
    return t.cos() + 1


def test_break_inputs_are_not_retained() -> None:
    x = randn(256)
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        tmp = x * 2 + 1
        probe = weakref.ref(tmp)
        y = consume(tmp)
        out = y * 3
    del tmp
    gc.collect()
    assert probe() is None, "a break kept a strong reference to its CUDA tensor argument"
    for _ in range(REPLAYS):
        refresh(x)
        graph.replay()
        torch.testing.assert_close(y, (x * 2 + 1).cos() + 1)
        torch.testing.assert_close(out, ((x * 2 + 1).cos() + 1) * 3)


# -- context queries ---------------------------------------------------------------------------


def test_capture_active_and_current_stream_during_capture_and_replay() -> None:
    seen: list[tuple[bool, int, int]] = []

    @eager_on_graph(name="probe")
    def probe(t: torch.Tensor) -> torch.Tensor:
        seen.append(
            (
                is_breakable_capture_active(),
                get_current_stream().cuda_stream,
                torch.cuda.current_stream().cuda_stream,
            )
        )
        return t + 1

    capture_stream = torch.cuda.Stream()
    user_stream = torch.cuda.Stream()
    default_handle = torch.cuda.current_stream().cuda_stream
    x = randn(32)
    assert not is_breakable_capture_active()
    assert get_current_stream().cuda_stream == default_handle
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph, stream=capture_stream):
        in_segment = is_breakable_capture_active()
        segment_stream = get_current_stream().cuda_stream
        y = probe(x * 2)
        after_break = is_breakable_capture_active()
        out = y * 3
    assert in_segment and after_break
    assert segment_stream == capture_stream.cuda_stream
    handle = capture_stream.cuda_stream
    assert seen == [(True, handle, handle)]
    assert not is_breakable_capture_active()
    assert get_current_stream().cuda_stream == default_handle

    for _ in range(REPLAYS):
        seen.clear()
        refresh(x)
        user_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(user_stream):
            graph.replay()
        torch.cuda.current_stream().wait_stream(user_stream)
        user = user_stream.cuda_stream
        assert seen == [(False, user, user)]
        torch.testing.assert_close(out, (x * 2 + 1) * 3)

    seen.clear()
    refresh(x)
    graph.replay()  # on the default stream
    assert seen == [(False, default_handle, default_handle)]
    torch.testing.assert_close(out, (x * 2 + 1) * 3)
