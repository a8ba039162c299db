"""What the break decorator accepts as a target, and breaks meeting torch's custom-op machinery,
on the CPU graph backend: ops of ``torch.ops`` are named as torch prints them, a decorated
``nn.Module.forward`` under ``fullgraph=True`` says why it is refused and what to do, and a
break inside a custom op's implementation is refused clearly and leaves no capture state.
Every accepted target replays as eager does (values asserted)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack  # noqa: PLC2701

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    CaptureError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
)


@torch.library.custom_op("bcg_review45::triple", mutates_args=())
def _triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@_triple.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("bcg_review45::bump", mutates_args=["x"])
def _bump(x: torch.Tensor) -> None:
    x.add_(1)


@_bump.register_fake
def _(x: torch.Tensor) -> None:
    return None


class _Scale:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * 5

    def method(self, x: torch.Tensor) -> torch.Tensor:
        return x * 6


class _Methods:
    @eager_on_graph
    @staticmethod
    def static_over(x: torch.Tensor) -> torch.Tensor:
        return x * 7

    @classmethod
    @eager_on_graph
    def class_under(cls, x: torch.Tensor) -> torch.Tensor:
        return x * 8


_inner = eager_on_graph(lambda x: x * 2, name="r45.inner")


def _bumped(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    _bump(y)  # a custom op that writes its argument, inside a segment
    return y


def _sdpa(sdpa: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def call(x: torch.Tensor) -> torch.Tensor:
        q = x.view(1, 1, 4, 1)
        return sdpa(q, q, q).view(4)

    return call


_TARGETS: dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]] = {
    "custom_op": lambda: eager_on_graph(_triple),
    "custom_op_packet": lambda: eager_on_graph(torch.ops.bcg_review45.triple),
    "custom_op_overload": lambda: eager_on_graph(torch.ops.bcg_review45.triple.default),
    "aten_packet": lambda: functools.partial(eager_on_graph(torch.ops.aten.cumsum), dim=0),
    "aten_overload": lambda: functools.partial(
        eager_on_graph(torch.ops.aten.cumsum.default), dim=0
    ),
    "builtin": lambda: functools.partial(eager_on_graph(torch.cumsum), dim=0),
    "sdpa": lambda: _sdpa(eager_on_graph(torch.nn.functional.scaled_dot_product_attention)),
    "partial": lambda: eager_on_graph(functools.partial(torch.mul, other=3)),
    "callable_instance": lambda: eager_on_graph(_Scale()),
    "bound_method": lambda: eager_on_graph(_Scale().method),
    "lambda": lambda: eager_on_graph(lambda x: x * 4),
    "twice": lambda: eager_on_graph(eager_on_graph(lambda x: x * 4)),
    "staticmethod": lambda: _Methods().static_over,
    "classmethod": lambda: _Methods.class_under,
    "nested": lambda: eager_on_graph(lambda x: _inner(x) + 1, name="r45.outer"),
    "mutating_custom_op_in_segment": lambda: _bumped,
}


@pytest.mark.parametrize("target", list(_TARGETS), ids=list(_TARGETS))
def test_every_accepted_target_replays_as_eager(target: str) -> None:
    brk = _TARGETS[target]()

    def body(x: torch.Tensor) -> torch.Tensor:
        return brk(x * 2) + 1

    x = torch.arange(4.0)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = body(x)
    assert torch.equal(out, body(x.clone()))
    for shift in (10.0, -3.0):
        x.copy_(torch.arange(4.0) + shift)
        graph.replay()
        assert torch.equal(out, body(x.clone())), target
    assert not is_breakable_capture_active()


@pytest.mark.parametrize(
    ("op", "name"),
    [
        (torch.ops.aten.cumsum, "aten.cumsum"),
        (torch.ops.aten.cumsum.default, "aten.cumsum.default"),
    ],
    ids=["packet", "overload"],
)
def test_a_break_on_a_torch_op_is_named_as_torch_prints_it(op: Any, name: str) -> None:
    # The default name is the __qualname__: a packet's is pybind11's internal class name
    # ("pybind11_detail_function_record_v1_..._abi_1.cumsum"), an overload's drops the overload
    # ("aten::cumsum"), in break_names, logs and error messages.
    brk = eager_on_graph(op)
    x = torch.arange(4.0)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = brk(x * 2, 0) + 1
    assert graph.break_names == (name,)
    x.fill_(1.0)
    graph.replay()
    assert torch.equal(out, torch.tensor([3.0, 5.0, 7.0, 9.0]))


class _Forward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((4,), 3.0))

    @eager_on_graph
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_a_decorated_forward_under_fullgraph_says_why_and_what_to_do() -> None:
    # The module (forward's self) cannot be an opaque op's argument, so the call is a dynamo
    # graph break; fullgraph=True failed with dynamo's "function marked as skipped", hinting
    # to apply dont_skip_tracing to bcg's wrapper and to file an issue with PyTorch.
    torch._dynamo.reset()
    module = _Forward()
    strict = torch.compile(lambda x: module(x) + 1, backend="aot_eager", fullgraph=True)
    with torch.no_grad(), pytest.raises(torch._dynamo.exc.Unsupported) as raised:
        strict(torch.ones(4))
    said = str(raised.value)
    assert "_Forward.forward is a dynamo graph break" in said
    assert "decorate a function (or staticmethod) that takes only tensors" in said
    # Without fullgraph it compiles around the break and stays a break.
    torch._dynamo.reset()
    loose = torch.compile(lambda x: module(x) + 1, backend="aot_eager")
    x = torch.arange(4.0)
    with torch.no_grad():
        assert torch.equal(loose(x), x * 3 + 1)
        graph = BreakableCUDAGraph(backend="cpu")
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            out = loose(x)
        assert graph.break_names == ("_Forward.forward",)
        x.fill_(2.0)
        graph.replay()
    assert torch.equal(out, torch.full((4,), 7.0))


@eager_on_graph(name="r45.double")
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_break_given_a_grad_tensor_under_fullgraph_says_to_use_no_grad() -> None:
    torch._dynamo.reset()
    strict = torch.compile(lambda x: _double(x) + 1, backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"r45\.double .*torch\.no_grad"):
        strict(torch.ones(4, requires_grad=True))


@eager_on_graph(name="r45.in_op")
def _in_op(x: torch.Tensor) -> torch.Tensor:
    return x * 9


@torch.library.custom_op("bcg_review45::calls_break", mutates_args=())
def _calls_break(x: torch.Tensor) -> torch.Tensor:
    return _in_op(x) + 0


def test_a_break_inside_a_custom_op_implementation_is_refused_clearly() -> None:
    # The recorder handling the custom op saw its segment end inside the op's kernel; the new
    # segment's recorder sat below it on the mode stack, and the capture failed with a
    # HostSyncError about torch.equal, an op bcg's recorder issued, at the user's line.
    x = torch.arange(4.0)
    assert torch.equal(_calls_break(x), x * 9)  # eagerly, it works
    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.raises(CaptureError, match=r"inside the implementation of bcg_review45\.calls_"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        _calls_break(x * 2) + 1
    assert _get_current_dispatch_mode_stack() == []
    assert not is_breakable_capture_active()
    # Called next to the op instead, the break works, and captures still do.
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = _triple(_in_op(x * 2)) + 1
    x.fill_(1.0)
    graph.replay()
    assert torch.equal(out, torch.full((4,), 55.0))


class _AsyncCall:
    async def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("wrap", [lambda f: f, functools.partial], ids=["instance", "partial"])
def test_a_callable_with_an_async_call_is_refused_also_through_a_partial(wrap: Any) -> None:
    # A partial of a callable object whose __call__ is async was accepted: each replay made a
    # coroutine never awaited, and the break did none of its work.
    with pytest.raises(TypeError, match="async def function"):
        eager_on_graph(wrap(_AsyncCall()))
    with pytest.raises(TypeError, match=r"capture_stub .* async def function"):
        eager_on_graph(capture_stub=wrap(_AsyncCall()))


@torch.library.custom_op("bcg_review45::op_over_break", mutates_args=())
@eager_on_graph(name="r45.under_op")
def _op_over_break(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_custom_op_over_a_break_is_refused_saying_to_decorate_the_op() -> None:
    x = torch.arange(4.0)
    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.raises(CaptureError, match=r"decorate the op instead: eager_on_graph\(op\)"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        _op_over_break(x) + 1
    assert _get_current_dispatch_mode_stack() == []
    assert not is_breakable_capture_active()
    brk = eager_on_graph(torch.ops.bcg_review45.op_over_break)  # what the error says to do
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = brk(x) + 1
    assert graph.break_names == ("bcg_review45.op_over_break",)
    x.fill_(3.0)
    graph.replay()
    assert torch.equal(out, torch.full((4,), 7.0))


def test_a_classmethod_break_under_fullgraph_says_to_make_it_a_staticmethod() -> None:
    # cls is no graph constant: the call is a dynamo graph break (an opaque op only with
    # tensors and constants), which fullgraph=True refuses; a staticmethod is one op.
    torch._dynamo.reset()
    strict = torch.compile(
        lambda x: _Methods.class_under(x) + 1, backend="aot_eager", fullgraph=True
    )
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"_Methods\.class_under is a dyn"):
        strict(torch.ones(4))
    strict = torch.compile(
        lambda x: _Methods.static_over(x) + 1, backend="aot_eager", fullgraph=True
    )
    assert torch.equal(strict(torch.ones(4)), torch.full((4,), 8.0))
