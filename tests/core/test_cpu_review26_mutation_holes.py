"""Holes found by the mutation review (session 26), on the CPU graph backend: steps that change
what they are given (containers, leaves that require grad, a returned argument), every call
compared with eager."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bcg_core import BreakableGraphRunner, eager_on_graph


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="bcg_core")


def _set_key(state: dict[str, torch.Tensor]) -> torch.Tensor:
    state["out"] = state["x"] * 2
    return state["x"] + 1


def _append(items: list[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    items.append(t * 2)
    return t + 1


def _set_item(items: list[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    items[0] = t * 2
    return t + 1


def _del_key(d: dict[str, Any]) -> torch.Tensor:
    del d["k"]
    return d["x"] + 1


def _dict_call(i: int) -> tuple[Any, ...]:
    return ({"x": torch.full((2,), float(i))},)


def _list_call(i: int) -> tuple[Any, ...]:
    return ([torch.zeros(2)], torch.full((2,), float(i)))


def _empty_list_call(i: int) -> tuple[Any, ...]:
    return ([], torch.full((2,), float(i)))


def _del_call(i: int) -> tuple[Any, ...]:
    return ({"x": torch.full((2,), float(i)), "k": 1},)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


@pytest.mark.parametrize(
    ("step", "make"),
    [
        (_set_key, _dict_call),
        (_append, _list_call),
        (_append, _empty_list_call),
        (_set_item, _list_call),
        (_del_key, _del_call),
    ],
    ids=["dict-set", "append", "append-to-empty", "list-set", "dict-del"],
)
def test_a_container_the_step_changes_ends_as_eager_leaves_it(
    step: Callable[..., torch.Tensor], make: Callable[[int], tuple[Any, ...]]
) -> None:
    # The runner passes copies of containers (the static call), so a step's `d[k] = v`,
    # `lst.append(t)`, `lst[0] = t` or `del d[k]` never reached the caller's container, at
    # capture or at replay (or, for a container holding no tensor, passed as itself, reached it
    # once per warm-up and never at a replay): silently wrong. Such a signature runs eagerly.
    runner = BreakableGraphRunner(step, device="cpu")
    for i in range(4):
        mine, theirs = make(i), make(i)
        got = runner.capture(*mine) if i == 0 else runner(*mine)
        want = step(*theirs)
        assert torch.equal(got, want), i
        assert _same(mine, theirs), (i, mine, theirs)
    assert runner.stats.hits == 0
    assert len(runner.blocked_signatures) == 1
    why = next(iter(runner.blocked_signatures.values()))
    assert "args[0]" in why and "return the value" in why.lower(), why


def _reads_container(items: list[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    scratch = list(items)
    scratch.append(t)  # a container of the step's own: not the caller's
    return torch.stack(scratch).sum(0)


def test_a_step_that_only_reads_its_containers_still_replays() -> None:
    runner = BreakableGraphRunner(_reads_container, device="cpu")
    runner.capture([torch.zeros(2)], torch.zeros(2))
    for i in range(3):
        items, t = [torch.full((2,), float(i))], torch.full((2,), 2.0 * i)
        assert torch.equal(runner(items, t), _reads_container(items, t))
    assert runner.stats.hits == 3


@dataclasses.dataclass
class _State:
    x: torch.Tensor
    out: Any = None


def _set_attribute(s: _State) -> torch.Tensor:
    s.out = s.x * 2
    return s.x + 1


def test_an_object_attribute_the_step_rebinds_is_seen_as_eager() -> None:
    # Objects are passed as themselves (not copied): the caller sees the rebinding; the
    # object's new contents change its signature, so later calls run eagerly. Right as it is.
    runner = BreakableGraphRunner(_set_attribute, device="cpu")
    s = _State(torch.zeros(2))
    runner.capture(s)
    for i in range(1, 4):
        s.x.fill_(float(i))
        assert torch.equal(runner(s), s.x + 1)
        assert torch.equal(s.out, s.x * 2)


def _bump(x: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    return x * 2


def _eager_outcome(step: Callable[..., Any], x: torch.Tensor) -> tuple[str, torch.Tensor]:
    try:
        step(x)
    except RuntimeError as e:
        return str(e), x.detach().clone()
    return "", x.detach().clone()


def test_a_written_leaf_that_requires_grad_raises_as_eager() -> None:
    # Eager raises (a leaf Variable that requires grad is being used in an in-place
    # operation); the runner wrote the static buffer, which requires no grad, and copied it back
    # under no_grad: silently written, at capture and at every replay.
    runner = BreakableGraphRunner(_bump, device="cpu")
    runner.capture(torch.zeros(2))  # captured on a tensor not requiring grad: replays
    for i in range(3):
        x = torch.full((2,), float(i), requires_grad=True)
        want_error, want = _eager_outcome(_bump, torch.full((2,), float(i), requires_grad=True))
        assert "in-place" in want_error
        with pytest.raises(RuntimeError, match="in-place"):
            runner(x)
        assert torch.equal(x.detach(), want), i
    # Without grad mode eager writes it, and so does a replay.
    with torch.no_grad():
        x = torch.full((2,), 5.0, requires_grad=True)
        assert torch.equal(runner(x), torch.full((2,), 12.0))
        assert torch.equal(x, torch.full((2,), 6.0))
    assert runner.stats.hits == 1


def test_a_written_leaf_that_requires_grad_at_capture_raises_as_eager() -> None:
    runner = BreakableGraphRunner(_bump, device="cpu")
    x = torch.zeros(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="in-place"):
        runner.capture(x)
    assert torch.equal(x.detach(), torch.zeros(2))
    assert runner.stats.captures == 0


def _advance(pos: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return pos.add_(1), h * 2  # add_ returns pos itself, as eager gives it back


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@pytest.mark.parametrize("views", [False, True])
def test_a_returned_argument_is_the_caller_s_tensor(views: bool) -> None:
    # Eager returns the argument itself; a replay returned a clone of its static buffer (or,
    # with return_views, the buffer), so a write through the result missed the caller's tensor.
    runner = BreakableGraphRunner(_advance, device="cpu", return_views=views)
    pos = torch.zeros(1)
    assert runner.capture(pos, torch.zeros(2))[0] is pos  # (the capture ran the step 3 times)
    for i in range(1, 4):
        pos, h = torch.full((1,), float(i)), torch.full((2,), float(i))
        got_pos, got_h = runner(pos, h)
        assert got_pos is pos, i
        assert torch.equal(pos, torch.full((1,), i + 1.0))
        assert torch.equal(got_h, h * 2)
        got_pos.zero_()  # reaches the caller's tensor, as eager
        assert torch.equal(pos, torch.zeros(1))
    assert runner.stats.hits == 3
    plain = BreakableGraphRunner(_identity, device="cpu", return_views=views)
    for i in range(3):
        x = torch.full((2,), float(i))
        assert (plain.capture(x) if i == 0 else plain(x)) is x


@eager_on_graph
def _store_double(state: dict[str, torch.Tensor]) -> None:
    state["out"] = state["x"] * 2


def _step_with_storing_break(state: dict[str, torch.Tensor]) -> torch.Tensor:
    _store_double(state)
    return state["x"] + 1


def test_a_break_that_changes_the_step_s_container_runs_eagerly() -> None:
    runner = BreakableGraphRunner(_step_with_storing_break, device="cpu")
    for i in range(3):
        mine, theirs = _dict_call(i), _dict_call(i)
        got = runner.capture(*mine) if i == 0 else runner(*mine)
        assert torch.equal(got, _step_with_storing_break(*theirs))
        assert _same(mine, theirs), i
    assert runner.stats.hits == 0
