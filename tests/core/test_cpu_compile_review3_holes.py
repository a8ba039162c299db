"""Compiled breaks that failed a third review of torch.compile with breaks, on the CPU backend:
each compiled result is compared with the same function run eagerly.

Backends ``eager`` and ``aot_eager`` (dynamo and AOTAutograd, which make the op opaque).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from bcg_core import eager_on_graph


def _collect_fn(x: torch.Tensor, store: list[torch.Tensor]) -> torch.Tensor:
    store.append(x * 2)  # changes the caller's list
    return x + 1


def _count_fn(x: torch.Tensor, stats: dict[str, Any]) -> torch.Tensor:
    stats["n"] = stats.get("n", 0) + 1
    stats["last"] = x.sum()
    return x + 1


def _uses_collect(brk: Any) -> Any:
    def step(x: torch.Tensor, store: list[torch.Tensor]) -> torch.Tensor:
        return brk(x.sin(), store) * len(store)  # reads the changed list

    return step


def _assert_appends_as_eager(compiled: Callable[..., Any], step: Callable[..., Any]) -> None:
    """Twice: the compiled step returns what the step does and appends the same to its list."""
    for _ in range(2):
        x = torch.randn(3)
        got_store: list[torch.Tensor] = []
        want_store: list[torch.Tensor] = []
        assert torch.equal(compiled(x, got_store), step(x, want_store))
        assert len(got_store) == len(want_store) == 1
        assert torch.equal(got_store[0], want_store[0])


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_break_changing_a_list_or_dict_argument_changes_the_callers(
    backend: str,
) -> None:
    # A compiled break is an op that gets copies of its containers: the append and the item
    # set never reached the caller's, and the code after it read the traced, empty list
    # (len(store) was 0: the step returned zeros), silently.
    torch._dynamo.reset()
    collect = eager_on_graph(_collect_fn, name="c3.collect")
    count = eager_on_graph(_count_fn, name="c3.count")
    step = _uses_collect(collect)
    compiled = torch.compile(step, backend=backend)
    _assert_appends_as_eager(compiled, step)
    compiled_count = torch.compile(lambda x, s: count(x.cos(), s) + 1, backend=backend)
    x = torch.randn(3)
    got: dict[str, Any] = {}
    compiled_count(x, got)
    compiled_count(x, got)
    assert got["n"] == 2 and torch.equal(got["last"], x.cos().sum())


def test_fullgraph_refuses_a_break_changing_a_container_by_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch._dynamo.reset()
    collect = eager_on_graph(_collect_fn, name="c3.collect_full")
    compiled = torch.compile(_uses_collect(collect), backend="aot_eager", fullgraph=True)
    with caplog.at_level("WARNING", logger="bcg_core"), pytest.raises(Exception):  # noqa: B017
        compiled(torch.randn(3), [])
    said = [r.getMessage() for r in caplog.records if "c3.collect_full" in r.getMessage()]
    assert said and "changes a list or dict" in said[0]


@eager_on_graph(name="c3.read_list")
def _read_list(xs: list[torch.Tensor], scale: float) -> torch.Tensor:
    return torch.stack(xs).sum(0) * scale  # takes a list, changes nothing


def test_a_break_taking_a_list_it_does_not_change_stays_one_op_with_fullgraph() -> None:
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def step(x: torch.Tensor) -> torch.Tensor:
        return _read_list([x, x.cos()], 2.0) + 1

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    x = torch.randn(3)
    assert torch.equal(compiled(x), step(x))
    assert counter.frame_count == 1


@eager_on_graph(name="c3.collect_values")
def _collect_values(x: torch.Tensor, store: list[torch.Tensor]) -> torch.Tensor:
    if x.sum().item() > -1e9:  # reads a value: cannot run on fake tensors
        store.append(x * 2)
    return x + 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_break_that_reads_values_and_changes_a_list_changes_the_callers(backend: str) -> None:
    # Such a break is a dynamo graph break, but its fallback got dynamo's rebuilt copies of
    # the containers: the append was lost and len(store) read 0, silently.
    torch._dynamo.reset()
    step = _uses_collect(_collect_values)
    compiled = torch.compile(step, backend=backend)
    _assert_appends_as_eager(compiled, step)
