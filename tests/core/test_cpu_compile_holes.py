"""Compiled breaks that went wrong before (an adversarial review's repros): a break returning a
tensor it keeps elsewhere, a changed output under ``backend="eager"``, a break passed into the
compiled frame under ``dynamic=True``, a ``capture_stub``'s strides under dynamic shapes, and a
named tuple returned under ``fullgraph=True``. Every compiled result is compared with the same
function uncompiled.

Backend ``aot_eager`` where it shows the bug; inductor where only inductor's generated code does
(it reuses an op's output buffer in place, and asserts the strides it was built for).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch._dynamo

from bcg_core import BreakOutputError, eager_on_graph

_TABLE = torch.arange(4.0)  # a table a break hands out as it is, never to be written


@eager_on_graph(name="ch.table", capture_stub=lambda x: torch.empty(4))
def _table_stubbed(x: torch.Tensor) -> torch.Tensor:
    return _TABLE


@eager_on_graph(name="ch.table_plain")
def _table(x: torch.Tensor) -> torch.Tensor:
    return _TABLE


def _uses_table_stubbed(x: torch.Tensor) -> torch.Tensor:
    return (_table_stubbed(x) + x) * 2


def test_a_kept_tensor_a_break_returns_is_not_overwritten_by_inductor() -> None:
    torch._dynamo.reset()
    cf = torch.compile(_uses_table_stubbed, fullgraph=True)
    x = torch.ones(4)
    want = _uses_table_stubbed(x)
    for _ in range(3):  # inductor reused the op's output (the table) for its result
        assert torch.equal(cf(x), want)
    assert torch.equal(_TABLE, torch.arange(4.0))


def test_a_kept_tensor_returned_without_a_stub_compiles() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return _table(x) + x

    torch._dynamo.reset()
    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.ones(4)
    # the fake run handed dynamo the real table ("source must be provided in options")
    assert torch.equal(cf(x), f(x))
    assert torch.equal(cf(x + 1), f(x + 1))
    assert torch.equal(_TABLE, torch.arange(4.0))


_state = {"n": 2, "extra": False}


@eager_on_graph(name="ch.counted")
def _counted(x: torch.Tensor) -> Any:
    if _state["extra"]:
        return x * 2, _state["n"], 0
    return x * 2, _state["n"]


def _uses_counted(x: torch.Tensor) -> torch.Tensor:
    y, n, *_ = _counted(x)
    return y + n


@pytest.mark.parametrize("change", ["value", "structure"])
def test_the_eager_backend_checks_a_break_output_against_the_trace(change: str) -> None:
    torch._dynamo.reset()
    _state.update(n=2, extra=False)
    cf = torch.compile(_uses_counted, backend="eager", fullgraph=True)
    x = torch.ones(3)
    assert torch.equal(cf(x), _uses_counted(x))
    assert torch.equal(cf(x + 1), _uses_counted(x + 1))
    if change == "value":
        _state["n"] = 5
    else:
        _state["extra"] = True
    try:
        # the graph after the break used the traced 2, silently
        with pytest.raises(BreakOutputError, match=r"ch\.counted"):
            cf(x)
    finally:
        _state.update(n=2, extra=False)


@eager_on_graph(name="ch.double")
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@eager_on_graph(name="ch.triple")
def _triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def test_a_break_closed_over_compiles_under_dynamic_shapes() -> None:
    def make_step(attention: Any) -> Any:
        return lambda x: attention(x.cos()) + 1

    step = make_step(_double)
    torch._dynamo.reset()
    cf = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for n in (4, 7):
        x = torch.randn(n)
        assert torch.equal(cf(x), step(x))


def test_breaks_passed_as_arguments_compile_when_automatic_dynamic() -> None:
    def step(x: torch.Tensor, attention: Any) -> torch.Tensor:
        return attention(x.cos()) + 1

    torch._dynamo.reset()
    cf = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = torch.randn(4)
    # the second break recompiles with its id dynamic; each call must run its own break
    for attention in (_double, _triple, _double, _triple):
        assert torch.equal(cf(x, attention), step(x, attention))


def _rows_stub(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape[0], 3)  # contiguous


@eager_on_graph(name="ch.colmajor", capture_stub=_rows_stub)
def _colmajor(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(3, x.shape[0]).t()  # the kernel returns a transposed layout
    return y.copy_(x[:, :3] * 2)


def _uses_colmajor(x: torch.Tensor) -> torch.Tensor:
    return _colmajor(x).cumsum(1) + x[:, :3]


def test_a_stub_strides_are_given_under_dynamic_shapes() -> None:
    torch._dynamo.reset()
    cf = torch.compile(_uses_colmajor, fullgraph=True, dynamic=True)
    for n in (5, 9):
        x = torch.randn(n, 4)
        # inductor asserted the traced strides ("expected size 5==5, stride 1==3")
        torch.testing.assert_close(cf(x), _uses_colmajor(x))


_Out = collections.namedtuple("_Out", "out lse")
_Inner = collections.namedtuple("_Inner", "scale none")


@eager_on_graph(name="ch.attn")
def _attn(x: torch.Tensor) -> _Out:
    return _Out(x * 2, {"sum": x.sum(), "inner": _Inner(x + 1, None)})


def _uses_attn(x: torch.Tensor) -> tuple[Any, ...]:
    r = _attn(x.cos())
    inner = r.lse["inner"]
    return r.out + r.lse["sum"] * inner.scale, type(r), type(inner), inner.none


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_a_named_tuple_output_compiles_with_fullgraph(backend: str) -> None:
    torch._dynamo.reset()
    cf = torch.compile(_uses_attn, backend=backend, fullgraph=True)
    for _ in range(2):
        x = torch.randn(3)
        got, want = cf(x), _uses_attn(x)
        assert got[1:] == want[1:] == (_Out, _Inner, None)
        assert torch.equal(got[0], want[0])
