"""Which outputs of a break nothing else holds (``owned.py``): the ones a capture copies into
the pool. Read from reference counts right after the break returns; anything else any object
still reaches (an argument, a buffer or a view of one, a stash, a tensor autograd saved) must
be held as it is, or the code after the break would read or write a copy.

Unit checks on CPU tensors, then breaks captured on the CPU backend with CUDA's rules for
breaks switched on (outputs copied into the "pool"): which bridges are pooled, and replays
equal to eager where the code after the break writes into what the break returned.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from graph_helpers import capture

from bcg_core import BreakableCUDAGraph, eager_on_graph
from bcg_core._capture import owned  # noqa: PLC2701
from bcg_core._capture.graph import BreakStep  # noqa: PLC2701

CPU = torch.device("cpu")


class _State:
    buffer = torch.zeros(8)
    kept: list[torch.Tensor] = []  # noqa: RUF012


def _verdicts(make: Callable[[], Any]) -> list[bool]:
    box = [make()]  # held by the box alone, as in a capture
    made = owned.sole_owned(box, CPU)
    assert made is not None
    return [made(t) for t in _leaves(box)]


def _leaves(obj: Any) -> list[torch.Tensor]:
    from bcg_core import _trees  # noqa: PLC2701

    return _trees.tensor_leaves(obj)


def test_counts_tell_on_this_interpreter() -> None:
    # If a new CPython or torch changes how references are counted, the probes notice and
    # captures record the break's ops instead: correct, but slower. This test says so.
    assert owned.counts_tell()


x = torch.arange(8.0)
w = torch.ones(8, requires_grad=True)

CASES: dict[str, tuple[Callable[[], Any], list[bool]]] = {
    "fresh, bare": (lambda: x * 2, [True]),
    "fresh, in a tuple": (lambda: (x * 2, x + 1), [True, True]),
    "a view of a dead temporary": (lambda: (x * 2).view(2, 4).t(), [True]),
    "chunks of one fresh tensor": (lambda: list((x * 2).chunk(4)), [True] * 4),
    "a fresh tensor and its view": (lambda: (lambda t: (t, t[2:]))(x * 2), [True, True]),
    "the same tensor twice": (lambda: (lambda t: {"a": t, "b": [t]})(x * 2), [True, True]),
    "the argument, returned": (lambda: (x,), [False]),
    "a view of the argument": (lambda: x[1:], [False]),
    "a buffer of its own": (lambda: (_State.buffer, x * 2), [False, True]),
    "a view of its buffer": (lambda: _State.buffer[2:], [False]),
    "stashed and returned": (lambda: _stash(x * 2), [False]),
    "a view stashed, the base returned": (lambda: _stash_view(x * 2), [False]),
    "empty": (lambda: (torch.empty(0),), [False]),
    "saved by autograd": (lambda: w.exp(), [False]),
    "made under grad, nothing saved": (lambda: w * 2, [True]),
}


def _stash(t: torch.Tensor) -> torch.Tensor:
    _State.kept.append(t)
    return t


def _stash_view(t: torch.Tensor) -> tuple[torch.Tensor]:
    _State.kept.append(t[1:])
    return (t,)


@pytest.mark.parametrize("case", list(CASES))
def test_what_nothing_else_holds(case: str) -> None:
    make, want = CASES[case]
    assert _verdicts(make) == want


def test_in_inference_mode_views_of_temporaries_are_sole() -> None:
    with torch.inference_mode():
        assert _verdicts(lambda: (torch.ones(4, 2) * 2).t()) == [True]
        assert _verdicts(lambda: (_State.buffer, torch.ones(3) + 1)) == [False, True]


def test_another_device_is_never_pooled() -> None:
    box = [x * 2]
    made = owned.sole_owned(box, torch.device("meta"))
    assert made is not None and not made(box[0])


def test_the_counts_hold_after_torch_compile_ran() -> None:
    # Once torch.compile has run, dynamo's frame evaluation hook stays installed and CPython
    # stops inlining Python calls: a call chain then holds one more reference per level. The
    # box keeps frames out of the counts, so the rule measured before still holds.
    assert _verdicts(lambda: x * 2) == [True]
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: t * 3 + 1, backend="eager")
    assert torch.equal(compiled(x), x * 3 + 1)
    assert _verdicts(lambda: x * 2) == [True]
    assert _verdicts(lambda: (x, x * 2)) == [False, True]


@pytest.fixture
def cuda_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CPU backend with CUDA's rules for breaks: outputs copied into the "pool".
    from bcg_core._backends.cpu import CpuBackend  # noqa: PLC2701

    monkeypatch.setattr(CpuBackend, "alias_device_types", frozenset({"cpu"}))
    monkeypatch.setattr(
        CpuBackend, "allocate_to_pool", lambda self, pool, device: contextlib.nullcontext(True)
    )


def _pooled(graph: BreakableCUDAGraph) -> list[int]:
    return [len(s.bridge.pooled) for s in graph._steps if isinstance(s, BreakStep)]


@pytest.mark.usefixtures("cuda_rules")
def test_breaks_outputs_are_pooled_only_when_nothing_else_holds_them() -> None:
    cache = torch.zeros(4, 8)

    @eager_on_graph(name="fresh")
    def fresh(h: torch.Tensor) -> torch.Tensor:
        return (h * 2).view(2, 16).t()  # a view of a temporary: pooled

    @eager_on_graph(name="cache_write")
    def cache_write(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache[0].copy_(h.flatten()[:8])
        return cache[:1], h.sum(0)  # a view of the cache: held; the sum: pooled

    x = torch.randn(4, 8)

    def step() -> tuple[torch.Tensor, ...]:
        h = fresh(x + 1)
        view, total = cache_write(h)
        view.mul_(3)  # the code after the break writes into the cache through the view
        # The pooled copies are returned too: on the CPU their memory is no pool's, and a
        # bridge's alias must not outlive the copy it points to.
        return view.sum() + total.sum(), h, total

    graph, out = capture(step, BreakableCUDAGraph(backend="cpu"))
    assert _pooled(graph) == [1, 1]
    for _ in range(3):
        x.copy_(torch.randn(4, 8))
        graph.replay()
        replayed = (out[0].clone(), cache.clone())
        cache.zero_()
        assert torch.equal(replayed[0], step()[0])
        assert torch.equal(replayed[1], cache)  # the write reached the cache, not a copy


@pytest.mark.usefixtures("cuda_rules")
def test_a_break_that_keeps_what_it_returns_is_held() -> None:
    kept: list[torch.Tensor] = []

    @eager_on_graph(name="keeps")
    def keeps(h: torch.Tensor) -> torch.Tensor:
        out = h * 2
        kept[:] = [out]  # the break reads it again later: a copy would split the two
        return out

    x = torch.randn(8)

    def step() -> torch.Tensor:
        return keeps(x) + 1

    graph, out = capture(step, BreakableCUDAGraph(backend="cpu"))
    assert _pooled(graph) == [0]
    (held,) = [s.bridge.output for s in graph._steps if isinstance(s, BreakStep)]
    assert held is kept[0]
    x.copy_(torch.randn(8))
    graph.replay()
    assert torch.equal(out, step())
