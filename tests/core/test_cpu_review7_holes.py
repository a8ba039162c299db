"""Holes in the runner's call signatures and structure walker, on the CPU backend: each was
two calls that eager tells apart sharing one signature (a silently wrong replay) or a call that
crashed the runner; each is now keyed apart, or walked as eager reads it."""

from __future__ import annotations

import cmath
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bcg_core import BreakableGraphRunner
from bcg_core._signature import FlatGuard, signature_of  # noqa: PLC2701

Call = tuple[tuple[Any, ...], dict[str, Any]]


def _alternate(step: Callable[..., Any], calls: list[Callable[[], Call]]) -> BreakableGraphRunner:
    """Capture every call, then alternate them (the last hit's guard meets each kind after
    another) three times, each equal to eager."""
    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0, max_entries=len(calls))
    for make in calls:
        args, kwargs = make()
        runner.capture(*args, **kwargs)
    for _ in range(3):
        for make in calls:
            args, kwargs = make()
            want_args, want_kwargs = make()
            got, want = runner(*args, **kwargs), step(*want_args, **want_kwargs)
            assert torch.equal(got, want), (args, kwargs, got, want)
    return runner


def test_dict_keys_equal_but_of_another_type_or_zero_sign_are_other_signatures() -> None:
    # 1, True and 1.0 (0.0 and -0.0) are equal dict keys that hash alike: the walk's context
    # held them as a plain tuple, so {1: v} and {True: v} shared a signature and the graph
    # captured for one was replayed for the other.
    def step(x: torch.Tensor, d: dict[Any, float]) -> torch.Tensor:
        for k, v in d.items():
            x = x + v * (100 if type(k) is bool else 10 if type(k) is float else 1)
            x = x * math.copysign(1.0, k[-1] if isinstance(k, tuple) else k)
        return x

    x = torch.arange(6.0)
    keys: list[Any] = [1, True, 1.0, 0.0, -0.0, (1, 0.0), (True, 0.0), (1, -0.0)]
    runner = _alternate(step, [lambda k=k: ((x, {k: 1.0}), {}) for k in keys])
    assert runner.stats.captures == len(keys) and runner.stats.hits == 3 * len(keys)
    # Equal keys of one type are still one signature.
    assert signature_of((x, {1: 2, "a": x}), {}) == signature_of((x, {1: 2, "a": x}), {})
    assert signature_of((x, {-0.0: 1}), {}) == signature_of((x, {-0.0: 1}), {})


def test_a_complex_with_a_negative_zero_part_is_another_signature() -> None:
    # complex(-1, -0.0) == complex(-1, 0.0) and hashes alike, but its phase is -pi, not pi
    # (and cmath.sqrt takes the other branch): keyed as one constant, the first call's graph
    # was replayed for the other, through the walk and through the last hit's guard.
    def step(x: torch.Tensor, c: complex) -> torch.Tensor:
        return x * cmath.phase(c)

    x = torch.ones(3)
    zs = [complex(-1, 0.0), complex(-1, -0.0), complex(0.0, 0.0), complex(-0.0, 0.0)]
    runner = _alternate(step, [lambda c=c: ((x, c), {}) for c in zs])
    assert runner.stats.captures == len(zs) and runner.stats.hits == 3 * len(zs)
    runner = _alternate(
        lambda x, t: x * cmath.phase(t[0]), [lambda c=c: ((x, (c,)), {}) for c in zs]
    )
    assert runner.stats.captures == len(zs)
    for a in zs:
        guard = FlatGuard.of((x, a), {})
        assert guard is not None
        for b in zs:
            assert (guard.match((x, b), {}) is not None) == (repr(a) == repr(b))


@dataclasses.dataclass
class _Meta:
    n: int
    cached: int = dataclasses.field(init=False)  # set only by some code paths


def test_a_dataclass_is_walked_by_its_set_fields_and_its_other_attributes() -> None:
    # A field declared init=False and never set made the walk raise AttributeError out of the
    # runner's call (eager runs fine); an attribute that is no field (set in __post_init__ or
    # later) was left out of the signature, so a call whose only difference was there replayed
    # the capture's value, for the capture's object changed in place as for another object.
    def step(x: torch.Tensor, m: _Meta) -> torch.Tensor:
        return x * m.n * getattr(m, "scale", 1.0) + getattr(m, "cached", 0)

    def meta(scale: float | None = None, cached: int | None = None) -> _Meta:
        m = _Meta(2)
        if scale is not None:
            m.scale = scale  # type: ignore[attr-defined]
        if cached is not None:
            m.cached = cached
        return m

    x = torch.arange(3.0)
    runner = _alternate(
        step,
        [
            lambda: ((x, meta()), {}),
            lambda: ((x, meta(scale=3.0)), {}),
            lambda: ((x, meta(scale=5.0)), {}),
            lambda: ((x, meta(cached=7)), {}),
            lambda: ((x, meta(scale=3.0, cached=7)), {}),
        ],
    )
    assert runner.stats.captures == 5 and runner.stats.hits == 15
    # The capture's own object changed in place is not its capture any more.
    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0)
    m = meta(scale=3.0)
    runner.capture(x, m)
    m.scale = 4.0  # type: ignore[attr-defined]
    assert torch.equal(runner(x, m), x * 8.0)
    assert runner.stats.hits == 0


class _List(list[Any]):
    pass


class _Dict(dict[str, Any]):
    pass


class _Int(int):
    pass


class _Str(str):
    pass


def test_builtin_subclasses_and_partials_are_not_empty_objects() -> None:
    # A subclass of list, dict, int, str... (with a __dict__, not registered with pytree) and a
    # functools.partial keep their state in their built-in base: walked as plain objects they
    # had no attributes, so any two were one signature and the capture's graph (its values
    # baked in, or the capture's list read by a break) was replayed for every other one.
    x = torch.arange(3.0)
    cases: list[tuple[Callable[..., Any], list[Callable[[], Call]]]] = [
        (lambda x, v: x * v[0], [lambda: ((x, _List([2])), {}), lambda: ((x, _List([3])), {})]),
        (
            lambda x, v: x * v[0],
            [lambda: ((x, _List([torch.tensor(2.0)])), {}), lambda: ((x, _List([x])), {})],
        ),
        (lambda x, v: x * v["k"], [lambda: ((x, _Dict(k=2)), {}), lambda: ((x, _Dict(k=3)), {})]),
        (lambda x, v: x * v, [lambda: ((x, _Int(2)), {}), lambda: ((x, _Int(3)), {})]),
        (lambda x, v: x * len(v), [lambda: ((x, _Str("a")), {}), lambda: ((x, _Str("ab")), {})]),
        (
            lambda x, g: g(x),
            [
                lambda: ((x, functools.partial(torch.mul, other=2.0)), {}),
                lambda: ((x, functools.partial(torch.add, other=2.0)), {}),
            ],
        ),
    ]
    for step, calls in cases:
        runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0)
        args, kwargs = calls[0]()
        runner.capture(*args, **kwargs)
        for _ in range(2):
            for make in calls:
                args, kwargs = make()
                assert torch.equal(runner(*args, **kwargs), step(*make()[0]))
    # A number or string subclass is a constant by value: equal ones replay one graph.
    runner = _alternate(lambda x, v: x * v, [lambda: ((x, _Int(2)), {}), lambda: ((x, 2), {})])
    assert runner.stats.captures == 2 and runner.stats.hits == 6
    assert signature_of((x, _Int(2)), {}) == signature_of((x, _Int(2)), {})


class _Float(float):
    pass


def test_a_negative_zero_of_a_float_or_complex_subclass_is_another_signature() -> None:
    # numpy's float64 and complex128 (float and complex subclasses, constants of the
    # signature by value) kept -0.0 and 0.0 as one key: x / np.float64(-0.0) replayed +inf.
    x = torch.ones(3)
    for zero, neg in [
        (np.float64(0.0), np.float64(-0.0)),
        (_Float(0.0), _Float(-0.0)),
        (np.complex128(complex(-1, 0.0)), np.complex128(complex(-1, -0.0))),
    ]:
        runner = _alternate(
            lambda x, v: x * cmath.phase(complex(v)) if isinstance(v, complex) else x / float(v),
            [lambda v=zero: ((x, v), {}), lambda v=neg: ((x, v), {})],
        )
        assert runner.stats.captures == 2 and runner.stats.hits == 6
