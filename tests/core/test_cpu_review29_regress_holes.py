"""Regressions found by a second review of one day's merged changes (session 29), on the CPU
graph backend: each test compares with eager or with what held before those changes."""

from __future__ import annotations

import collections
import logging

import pytest
import torch
import torch._dynamo

from bcg_core import BreakableGraphRunner, eager_on_graph


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="bcg_core")


class _Opaque:
    """An argument dynamo cannot hand an opaque op: the break is a dynamo graph break."""


@eager_on_graph
def _untraceable_break(x: torch.Tensor, o: _Opaque) -> torch.Tensor:
    return x * 2


def test_a_fullgraph_error_at_a_break_names_the_break_s_function() -> None:
    # The dynamo-disabled form of a break wrapped an inner function without the break's name
    # (a0b833d), so torch.compile(fullgraph=True) refused it naming
    # `eager_on_graph.<locals>.decorate.<locals>.run` where it named the user's function.
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x: _untraceable_break(x + 1, _Opaque()) + 1, backend="eager", fullgraph=True
    )
    with pytest.raises(Exception, match="_untraceable_break") as info:
        compiled(torch.ones(2))
    assert "<locals>.run" not in str(info.value)


def _set_equal_values(cfg: dict[str, object], x: torch.Tensor) -> torch.Tensor:
    # Sets values equal to those it was given: no change a caller could see but identity.
    cfg["size"] = (2, 3)
    cfg["shape"] = x.shape
    return x * 2


def test_a_step_setting_an_equal_tuple_again_still_replays() -> None:
    # The container check (d652c38) compared a container's children by identity, numbers and
    # strings by value: a step storing an equal tuple again (cfg["size"] = (2, 3), or
    # cfg["shape"] = x.shape) had "changed" its argument, so its capture failed and the
    # signature ran eagerly from then on, where every call replayed before.
    runner = BreakableGraphRunner(_set_equal_values, device="cpu")
    for i in range(4):
        x = torch.full((2, 3), float(i))
        cfg: dict[str, object] = {"size": (2, 3), "shape": torch.Size([2, 3])}
        got = runner.capture(cfg, x) if i == 0 else runner(cfg, x)
        assert torch.equal(got, x * 2)
        assert cfg == {"size": (2, 3), "shape": torch.Size([2, 3])}
    assert runner.stats.hits == 3


def _reshape_by(x: torch.Tensor, size: torch.Size) -> torch.Tensor:
    return x.reshape(size) * size.numel()


def test_a_torch_size_argument_reaches_the_step_as_a_torch_size() -> None:
    # The container copy of a capture (d652c38) rebuilt every container through pytree, which
    # makes a torch.Size a plain tuple: the step's size.numel() raised at capture, so the
    # signature ran eagerly from then on, where every call replayed before.
    runner = BreakableGraphRunner(_reshape_by, device="cpu")
    for i in range(4):
        x = torch.full((6,), float(i))
        got = runner.capture(x, torch.Size([2, 3])) if i == 0 else runner(x, torch.Size([2, 3]))
        assert torch.equal(got, _reshape_by(x, torch.Size([2, 3])))
    assert runner.stats.hits == 3


def _read_missing(d: collections.defaultdict[str, float], x: torch.Tensor) -> torch.Tensor:
    return x * 2 + d["missing"]  # a defaultdict's read of a missing key adds it


def test_a_changed_defaultdict_is_named_by_the_key_added(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The container check (d652c38) read a dict's keys from its pytree context, which for a
    # defaultdict is [factory, keys]: the refusal said "key 'a' added, key 'missing' added,
    # key <class 'float'> removed, key ('a',) removed" for one key added.
    caplog.set_level(logging.WARNING, logger="bcg_core")
    runner = BreakableGraphRunner(_read_missing, device="cpu")
    d = collections.defaultdict(float, {"a": 1.0})
    x = torch.ones(2)
    assert torch.equal(runner.capture(d, x), x * 2)
    assert "key 'missing' added" in caplog.text
    assert "removed" not in caplog.text
    assert "key 'a'" not in caplog.text
