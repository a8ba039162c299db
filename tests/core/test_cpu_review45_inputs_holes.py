"""Holes found by the second input-zoo review (session 45), on the CPU graph backend: unusual
but legal inputs and outputs (dtypes, layouts, lazy bits, non-tensor values), every replay
compared with eager."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    BreakOutputError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_in_breakable_cuda_graph,
)


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="bcg_core")


def _complex() -> torch.Tensor:
    return torch.randn(4, dtype=torch.complex64)


def _conjugated_argument() -> torch.Tensor:
    return torch.randn(4, dtype=torch.complex64).conj()


@pytest.mark.parametrize(
    ("step", "make"),
    [
        (lambda x: x.conj(), _complex),
        (lambda x: x[1:].conj(), _complex),
        (lambda x: torch._neg_view(x), lambda: torch.randn(4)),
        (lambda x: x.conj().imag, _complex),
        (lambda x: x.imag, _conjugated_argument),
    ],
    ids=["conj", "conj-of-a-slice", "neg-view", "imag-of-conj", "imag-of-a-conjugated-argument"],
)
@pytest.mark.parametrize("views", [False, True])
def test_a_returned_lazily_conjugated_or_negated_view_of_an_argument_keeps_its_bit(
    step: Callable[[torch.Tensor], torch.Tensor],
    make: Callable[[], torch.Tensor],
    views: bool,
) -> None:
    # A step returning a view of its argument gets the same view of the caller's tensor back,
    # rebuilt from sizes, strides and offset alone: the lazy conjugate and negative bits were
    # dropped, so x.conj() replayed x itself (silently wrong values), and x.imag of a
    # conjugated argument raised torch's raw "view is not supported for conjugate view" error.
    runner = BreakableGraphRunner(step, device="cpu", return_views=views)
    for i in range(3):
        x = make()
        want = step(x.clone()).resolve_conj().resolve_neg()
        got = runner.capture(x) if i == 0 else runner(x)
        assert torch.equal(got.resolve_conj().resolve_neg(), want), i
    assert runner.stats.hits == 2


def test_a_returned_conjugate_view_still_writes_through_to_the_argument() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x.conj()

    runner = BreakableGraphRunner(step, device="cpu")
    runner.capture(_complex())
    x = _complex()
    want = x.clone()
    got = runner(x)
    got.add_(1j)  # eager: x.conj() += 1j is x -= 1j
    assert torch.equal(x, want - 1j)


def _scaled_by_keys(x: torch.Tensor, d: dict[torch.Tensor, float]) -> torch.Tensor:
    return x * sum(k.sum() * v for k, v in d.items())


def test_a_dict_keyed_by_tensors_is_keyed_by_the_key_objects_without_raising() -> None:
    # Dict keys that are not all strings are compared with ==; a tensor key's == is
    # elementwise, so the miss log comparing a call's dict keyed by another tensor with the
    # captured one raised torch's raw "Boolean value of Tensor with more than one value is
    # ambiguous" out of the runner's call.
    runner = BreakableGraphRunner(_scaled_by_keys, device="cpu")
    key = torch.ones(3)
    runner.capture(torch.ones(2), {key: 2.0})
    assert torch.equal(runner(torch.ones(2), {key: 2.0}), torch.full((2,), 6.0))
    assert runner.stats.hits == 1
    for other in (torch.full((3,), 2.0), torch.ones(3), torch.ones(1)):
        d = {other: 2.0}
        assert torch.equal(runner(torch.ones(2), d), _scaled_by_keys(torch.ones(2), d))
    assert runner.stats.hits == 1
    assert runner.stats.misses == 3


class _Tensors(list[torch.Tensor]):
    """A list subclass pytree does not register: the tree walker leaves it whole."""


@pytest.mark.parametrize(
    ("step", "first"),
    [
        (lambda x: {x * 2}, lambda out: next(iter(out))),
        (lambda x: (x, frozenset([x * 2])), lambda out: next(iter(out[1]))),
        (lambda x: _Tensors([x * 2]), lambda out: out[0]),
    ],
    ids=["set", "frozenset-in-a-tuple", "list-subclass"],
)
def test_an_output_holding_tensors_in_an_unwalked_container_runs_eagerly(
    step: Callable[[torch.Tensor], Any], first: Callable[[Any], torch.Tensor]
) -> None:
    # The runner clones its output by walking it; a set or an unregistered list subclass is a
    # leaf of the walk, so each call returned the static output's tensors themselves and the
    # next replay overwrote an earlier result (silently: 4.0 became 6.0). Such a step's capture
    # is refused now, and its calls run eagerly.
    runner = BreakableGraphRunner(step, device="cpu")
    runner.capture(torch.ones(2))
    assert runner.stats.failed_captures == 1
    earlier = runner(torch.full((2,), 2.0))
    later = runner(torch.full((2,), 3.0))
    assert torch.equal(first(earlier), torch.full((2,), 4.0))
    assert torch.equal(first(later), torch.full((2,), 6.0))
    assert runner.stats.hits == 0


def _plus_first(x: torch.Tensor, held: Any) -> torch.Tensor:
    return x + next(iter(held))


@pytest.mark.parametrize("kind", ["list-subclass", "set"])
def test_a_tensor_put_into_a_container_argument_the_walk_leaves_whole_is_not_replayed_stale(
    kind: str,
) -> None:
    # A set or an unregistered list subclass is a leaf keyed by identity: the same container
    # given another tensor (l[0] = t) had the capture's signature, and the replay read the
    # old tensor's memory (1.0 where eager gives 5.0; freed memory on a GPU). Its tensors'
    # addresses are keyed now: such a call misses and runs eagerly.
    runner = BreakableGraphRunner(_plus_first, device="cpu")
    held: Any = _Tensors([torch.ones(2)]) if kind == "list-subclass" else {torch.ones(2)}
    runner.capture(torch.zeros(2), held)
    assert torch.equal(runner(torch.zeros(2), held), torch.ones(2))
    assert runner.stats.hits == 1
    if kind == "list-subclass":
        held[0] = torch.full((2,), 5.0)
    else:
        held.clear()
        held.add(torch.full((2,), 5.0))
    assert torch.equal(runner(torch.zeros(2), held), torch.full((2,), 5.0))
    assert runner.stats.hits == 1


def _times_total(x: torch.Tensor, held: Any) -> torch.Tensor:
    return x * sum(held)


@pytest.mark.parametrize(
    ("make", "change"),
    [
        (lambda: {1}, lambda s: s.add(2)),
        (lambda: _Numbers([1]), lambda ns: ns.append(2)),
        (lambda: bytearray(b"\x01"), lambda b: b.append(2)),
    ],
    ids=["set", "list-subclass", "bytearray"],
)
def test_a_container_argument_the_walk_leaves_whole_changed_in_place_is_not_replayed_stale(
    make: Callable[[], Any], change: Callable[[Any], None]
) -> None:
    # Keyed by identity alone, the same set changed in place (s.add(2)) hit the capture's
    # graph, which computed with its old contents: 1.0 where eager gives 3.0.
    runner = BreakableGraphRunner(_times_total, device="cpu")
    held = make()
    runner.capture(torch.ones(2), held)
    assert torch.equal(runner(torch.ones(2), held), torch.ones(2))
    assert runner.stats.hits == 1
    change(held)
    assert torch.equal(runner(torch.ones(2), held), torch.full((2,), 3.0))
    assert runner.stats.hits == 1


class _Numbers(list[int]):
    """A list subclass pytree does not register: the tree walker leaves it whole."""


def _mode_class() -> type[enum.IntEnum]:
    class Mode(enum.IntEnum):  # one name, two classes (two modules, or made by a factory)
        A = 1

    return Mode


def test_equal_members_of_two_int_enums_of_one_name_are_two_signatures() -> None:
    # Int enum members compare by value, and the key held the type's name: Mode.A of another
    # class named Mode replayed the graph captured for the first (2.0 where eager gives 3.0).
    first, second = _mode_class(), _mode_class()

    def step(x: torch.Tensor, mode: enum.IntEnum) -> torch.Tensor:
        return x * (2 if type(mode) is first else 3)

    runner = BreakableGraphRunner(step, device="cpu")
    runner.capture(torch.ones(2), first.A)
    assert torch.equal(runner(torch.ones(2), first.A), torch.full((2,), 2.0))
    assert torch.equal(runner(torch.ones(2), second.A), torch.full((2,), 3.0))
    assert runner.stats.hits == 1


@pytest.mark.parametrize(
    "wrap", [set, frozenset, _Tensors], ids=["set", "frozenset", "list-subclass"]
)
def test_a_break_returning_tensors_in_an_unwalked_container_is_refused_at_capture(
    wrap: Callable[[list[torch.Tensor]], Any],
) -> None:
    # Tensors in a container the walk leaves whole are not bridged: the code after the break
    # read the capture's tensor at every replay (a list subclass: 2.0 where eager gives 6.0,
    # silently; a set raised BreakOutputError only at the first replay).
    @eager_on_graph
    def make(x: torch.Tensor) -> Any:
        return wrap([x * 2])

    def step(x: torch.Tensor) -> torch.Tensor:
        return next(iter(make(x * 1))) * 1

    graph = BreakableCUDAGraph(backend="cpu")
    x = torch.ones(2)
    with (
        pytest.raises(BreakOutputError, match="holding tensors"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        step(x)
    assert not is_in_breakable_cuda_graph()
    runner = BreakableGraphRunner(step, device="cpu")
    runner.capture(torch.ones(2))
    assert runner.stats.failed_captures == 1
    assert torch.equal(runner(torch.full((2,), 3.0)), torch.full((2,), 6.0))


@pytest.mark.parametrize(
    "wrap",
    [_Numbers, lambda ns: torch.Size(ns)],
    ids=["list-subclass", "torch-size"],
)
def test_a_break_returning_another_value_in_an_unwalked_container_is_named_at_replay(
    wrap: Callable[[list[int]], Any],
) -> None:
    # Plain values a break returns are judged at every replay (the code after it computed
    # with the capture's); in a list subclass or a torch.Size they were not: the replay
    # computed with the capture's count silently (6.0 where eager gives 18.0).
    @eager_on_graph
    def count(x: torch.Tensor) -> Any:
        return wrap([int(x.sum().item())])

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * sum(count(x * 1))

    runner = BreakableGraphRunner(step, device="cpu")
    runner.capture(torch.ones(2))
    assert torch.equal(runner(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(BreakOutputError, match="stale"):
        runner(torch.full((2,), 3.0))
