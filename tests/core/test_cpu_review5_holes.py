"""Holes a fifth adversarial review found in the hand-written capture API, break semantics and
compiled breaks, on the CPU backend: each was a raw internal error, a silently wrong result or
state left behind, and is now right or a clear error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from graph_helpers import cpu_capture

from bcg_core import (
    BreakableCUDAGraph,
    BreakOutputError,
    ReplayError,
    eager_on_graph,
)

_ADJACENCY = torch.tensor([[0.0, 1, 0], [0, 0, 2], [3, 0, 0]]).to_sparse()


@eager_on_graph(name="r5.spmm")
def _spmm(x: torch.Tensor, adjacency: torch.Tensor) -> torch.Tensor:
    return torch.sparse.mm(adjacency, x.unsqueeze(1)).squeeze(1)


_calls: list[str] = []


@eager_on_graph(name="r5.count")
def _count(x: torch.Tensor) -> torch.Tensor:
    _calls.append("count")
    return x * 2


def test_a_sparse_argument_is_taken_and_the_capture_goes_on_breaking() -> None:
    # Reading a sparse argument's layout raised torch's raw "Cannot access storage of
    # SparseTensorImpl", after the capture had marked itself inside a break: code that caught
    # the error went on capturing with every later break a plain call, never replayed.
    x = torch.arange(3.0)

    def step() -> torch.Tensor:
        y = _spmm(x * 1, _ADJACENCY) + 1
        return _count(y) + 0

    graph, out = cpu_capture(step)
    assert graph.num_breaks == 2
    x.copy_(torch.tensor([4.0, 5, 6]))
    _calls.clear()
    graph.replay()
    assert _calls == ["count"]
    assert torch.equal(out, (torch.sparse.mm(_ADJACENCY, x.unsqueeze(1)).squeeze(1) + 1) * 2)


@eager_on_graph(name="r5.layout_reader")
def _reads_nested(x: torch.Tensor, nested: torch.Tensor) -> torch.Tensor:
    return x + nested.unbind()[0].sum()


def test_a_nested_argument_is_taken_as_it_is() -> None:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    x = torch.arange(3.0)
    graph, out = cpu_capture(lambda: _reads_nested(x * 1, nested) + 1)
    x.copy_(torch.tensor([4.0, 5, 6]))
    graph.replay()
    assert torch.equal(out, x + 3)


@eager_on_graph(name="r5.sparse_out")
def _sparse_out(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).to_sparse()


@eager_on_graph(name="r5.nested_out")
def _nested_out(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + 1, torch.nested.nested_tensor([x * 2, x[:2] * 3])


@pytest.mark.parametrize(
    ("call", "where"),
    [(_sparse_out, r"output \(a sparse"), (_nested_out, r"output\[1\] \(a nested")],
    ids=["sparse", "nested"],
)
def test_a_sparse_or_nested_output_is_refused_by_name_and_the_capture_goes_on(
    call: Callable[[torch.Tensor], Any], where: str
) -> None:
    # Both raised torch's raw "Cannot access data pointer" / "NestedTensorImpl doesn't support
    # sizes. Please file an issue." at capture.
    x = torch.arange(3.0)
    _calls.clear()

    def step() -> torch.Tensor:
        with pytest.raises(BreakOutputError, match=where):
            call(x * 1)
        return _count(x + 1) + 0

    graph, out = cpu_capture(step)
    assert graph.break_names == ("r5.count",)  # the refused call is no step
    x.copy_(torch.tensor([4.0, 5, 6]))
    _calls.clear()
    graph.replay()
    assert _calls == ["count"]
    assert torch.equal(out, (x + 1) * 2)


_graphs: dict[str, BreakableCUDAGraph] = {}


@eager_on_graph(name="r5.resetter")
def _resets_its_graph(x: torch.Tensor) -> torch.Tensor:
    if "graph" in _graphs:
        _graphs["graph"].reset()
    return x + 1


def test_reset_from_a_break_of_the_graphs_own_replay_is_refused() -> None:
    # The replay went on over the reset graph: on CUDA the next segment raised torch's raw
    # "replay without a preceding successful capture"; on the CPU backend it replayed silently
    # and left the graph empty.
    x = torch.arange(3.0)
    _graphs.clear()
    graph, out = cpu_capture(lambda: _resets_its_graph(x * 2) * 3)
    _graphs["graph"] = graph
    try:
        with pytest.raises(ReplayError, match="from a break of its own replay"):
            graph.replay()
    finally:
        del _graphs["graph"]
    assert graph.is_captured
    x.copy_(torch.tensor([4.0, 5, 6]))
    graph.replay()
    assert torch.equal(out, (x * 2 + 1) * 3)
    graph.reset()  # after the replay: allowed
    assert not graph.is_captured


@eager_on_graph(name="r5.scale")
def _scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


def _scaled_loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (_scale(x.sin(), w) + 1).sum()


def test_a_compiled_break_taking_a_tensor_that_requires_grad_trains() -> None:
    # The opaque op has no autograd formula: AOTAutograd failed the compile with torch's raw
    # "Trying to backward through bcg.opaque.default but no autograd formula was registered".
    torch._dynamo.reset()
    compiled = torch.compile(_scaled_loss, backend="aot_eager")
    x = torch.randn(4)
    w = torch.randn(4, requires_grad=True)
    compiled(x, w).backward()
    got = w.grad
    w.grad = None
    _scaled_loss(x, w).backward()
    assert got is not None and torch.allclose(got, w.grad)
    with torch.no_grad():  # inference still compiles the break as one op
        assert torch.allclose(compiled(x, w), _scaled_loss(x, w))


@eager_on_graph(name="r5.twins")
def _twins(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x * 2
    return y, y[1:]


def _writes_one_reads_the_other(x: torch.Tensor) -> torch.Tensor:
    a, b = _twins(x)
    a.add_(1)
    return b * 1


def test_a_compiled_break_returning_views_of_one_tensor_warns_that_they_are_copies() -> None:
    # Compiled, the outputs are separate copies, so the write through one no longer shows in
    # the other: the result differed from eager without a word.
    torch._dynamo.reset()
    compiled = torch.compile(_writes_one_reads_the_other, backend="aot_eager", fullgraph=True)
    x = torch.randn(4)
    with pytest.warns(UserWarning, match=r"r5.twins.*separate copies"):
        got = compiled(x)
    assert torch.equal(got, x[1:] * 2)  # the documented difference: eager gives x[1:] * 2 + 1
    assert torch.equal(_writes_one_reads_the_other(x), x[1:] * 2 + 1)
