"""Compiled breaks that must not go silently wrong (found by adversarial tests): a break that
returns nothing still runs, outputs that depend on shapes follow each trace, an aliasing output
is warned about, a written argument that another argument views is refused, and decorating
breaks in a loop does not pile up registrations.

Backend ``aot_eager`` (AOTAutograd is what makes the op opaque and what eliminated dead code);
inductor runs in test_cuda_compile.py.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensor  # noqa: PLC2701

from bcg_core import eager_on_graph
from bcg_core._capture import opaque  # noqa: PLC2701

_seen: list[torch.Tensor] = []


@eager_on_graph(name="ct.log")
def _log(x: torch.Tensor) -> None:
    if not isinstance(x, FakeTensor):  # run-time calls only
        _seen.append(x.clone())


def test_a_break_that_returns_nothing_runs_at_every_compiled_call() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        _log(y)
        return y + 1

    torch._dynamo.reset()
    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.arange(3.0)
    cf(x)
    _seen.clear()
    for i in range(3):
        assert torch.equal(cf(x + i), f(x + i))
    # each compiled call ran the break once, and so did each eager call beside it
    assert len(_seen) == 6
    assert torch.equal(_seen[0], (x * 2)) and torch.equal(_seen[4], (x + 2) * 2)


@eager_on_graph(name="ct.rows")
def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    return x * 2, x.shape[0]


@eager_on_graph(name="ct.unbind")
def _unbind(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x.unbind(0))


@pytest.mark.parametrize("dynamic", [None, False, True])
def test_outputs_that_depend_on_shapes_follow_each_trace(dynamic: bool | None) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y, n = _rows(x)
        return y + n + sum(_unbind(x))

    def g(x: torch.Tensor) -> torch.Tensor:  # the same break from another compiled function
        y, n = _rows(x)
        return y * n

    torch._dynamo.reset()
    cf = torch.compile(f, backend="aot_eager", fullgraph=dynamic is not None, dynamic=dynamic)
    cg = torch.compile(g, backend="aot_eager", fullgraph=True, dynamic=False)
    for n in (2, 3, 4):
        x = torch.arange(2.0 * n).reshape(n, 2)
        if dynamic is None:  # unbind's structure depends on the shape: one graph per shape
            assert torch.equal(cf(x), f(x))
        assert torch.equal(cg(x), g(x))


def test_a_compiled_break_returning_its_argument_warns_that_it_is_a_copy() -> None:
    @eager_on_graph(name="ct.ident")
    def ident(x: torch.Tensor) -> torch.Tensor:
        return x

    def f(x: torch.Tensor) -> torch.Tensor:
        return ident(x) + 1

    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"ct\.ident.*gets a copy"):
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0))


@eager_on_graph(name="ct.two")
def _write_two(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a.mul_(2)
    return b + 0


def test_a_written_argument_another_argument_views_is_refused_by_fullgraph(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def f(a: torch.Tensor) -> torch.Tensor:
        return _write_two(a, a[1]) + a[0]

    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="bcg_core"), pytest.raises(Exception):  # noqa: B017 (dynamo wraps it)
        torch.compile(f, backend="aot_eager", fullgraph=True)(torch.ones(2, 3))
    assert any(
        "ct.two" in r.getMessage() and "shares its memory" in r.getMessage() for r in caplog.records
    )
    # the default mode graph-breaks there and computes what eager computes
    torch._dynamo.reset()
    eager, compiled = torch.ones(2, 3), torch.ones(2, 3)
    want = f(eager)
    assert torch.equal(torch.compile(f, backend="aot_eager")(compiled), want)
    assert torch.equal(compiled, eager)


def test_breaks_decorated_in_a_loop_do_not_pile_up() -> None:
    def step(x: torch.Tensor) -> tuple[torch.Tensor, weakref.ref[torch.Tensor]]:
        big = torch.ones(1 << 16)

        @eager_on_graph(name="ct.inner")
        def inner(y: torch.Tensor) -> torch.Tensor:
            return y + big[0]

        return inner(x), weakref.ref(big)

    before = len(opaque._functions)
    refs = [step(torch.ones(2))[1] for _ in range(50)]
    gc.collect()
    step(torch.ones(2))  # registering prunes the dead
    assert sum(r() is not None for r in refs) == 0
    assert len(opaque._functions) <= before + 1
