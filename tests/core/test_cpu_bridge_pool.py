"""Bridges in a shared pool: eight graphs of different shapes captured largest first into one
pool, each with breaks whose outputs feed the next segment (one of them is also the graph's
output), replayed in several orders.

Shared scenario (``device`` fixture): on CUDA a break's capture-time output lives in the pool and
is held by a non-owning alias, so its block is handed to later captures once the code after the
break drops it; every graph must still be right right after its own replay, whatever ran before,
and every output the caller holds must keep its last replay's values. On the CPU backend bridges
are held strongly (its pool is a token), so the same assertions check the shared logic.

Also on CPU tensors: how a capture tells pooled tensors from others (``fresh.py``: the ones the
break's ops made) and how a bridge holds each kind.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable, Iterator
from typing import NamedTuple

import pytest
import torch
from graph_helpers import capture, device_graph

from bcg_core import BreakableCUDAGraph, eager_on_graph
from bcg_core._capture.bridges import Bridge, copy_into_pool  # noqa: PLC2701
from bcg_core._capture.fresh import FreshTensorTracker  # noqa: PLC2701

HIDDEN = 32
ROWS = [64, 56, 48, 40, 32, 24, 16, 8]  # largest first, as serving engines capture


@eager_on_graph(name="gelu")
def gelu_break(h: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(h)


@eager_on_graph(name="norm")
def norm_break(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = h.square().mean(-1, keepdim=True).add(1e-5).rsqrt()
    return h * scale, scale


@eager_on_graph(name="tail")
def tail_break(h: torch.Tensor) -> torch.Tensor:
    return h.tanh() + 1


def _block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    tmp = x @ w1  # freed once the break has consumed it: later captures may get its block
    h = gelu_break(tmp)
    del tmp
    normed, scale = norm_break(h @ w2)
    del h
    return tail_break(normed * scale + x)  # the graph's output is itself a bridge


def _capture_all(
    w1: torch.Tensor, w2: torch.Tensor
) -> list[tuple[torch.Tensor, BreakableCUDAGraph, torch.Tensor]]:
    first = device_graph()
    backend = torch.get_default_device().type
    graphs = []
    for i, rows in enumerate(ROWS):
        x = torch.randn(rows, HIDDEN)
        graph = first if i == 0 else BreakableCUDAGraph(pool=first.pool(), backend=backend)
        graph, out = capture(functools.partial(_block, x, w1, w2), graph)
        assert graph.step_kinds == ("graph", "break", "graph", "break", "graph", "break")
        graphs.append((x, graph, out))
    return graphs


ORDERS: dict[str, Callable[[int], list[int]]] = {
    "forward": lambda n: list(range(n)),
    "reversed": lambda n: list(reversed(range(n))),
    "random": lambda n: random.Random(7).sample(list(range(n)) * 2, 2 * n),
}


@pytest.mark.usefixtures("device")
@pytest.mark.parametrize("order", list(ORDERS))
def test_eight_graphs_sharing_a_pool_in_any_replay_order(order: str) -> None:
    w1 = torch.randn(HIDDEN, HIDDEN) / HIDDEN**0.5
    w2 = torch.randn(HIDDEN, HIDDEN) / HIDDEN**0.5
    graphs = _capture_all(w1, w2)
    expected: dict[int, torch.Tensor] = {}
    for i in ORDERS[order](len(graphs)):
        x, graph, out = graphs[i]
        x.copy_(torch.randn_like(x))
        graph.replay()
        expected[i] = _block(x, w1, w2)
        assert torch.equal(out, expected[i]), f"graph {i} ({ROWS[i]} rows) after its replay"


# -- the pieces, on CPU tensors ----------------------------------------------------------------


def test_the_tensors_a_block_made_are_told_from_the_ones_it_was_given() -> None:
    # At capture a break's outputs made by its own ops lie in the pool (its allocations are
    # routed there) and are held by alias; everything else is held strongly.
    given, buffer = torch.ones(64), torch.zeros(64)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        made = x * 2
        return made, made[10:], x, x[5:], buffer, torch.empty(0), x.add_(0)

    with FreshTensorTracker("cpu") as tracker:
        outputs = step(given)
        dropped = given + 1  # made, then dead before the test is asked
        del dropped
    made = tracker.made_on(torch.device("cpu"))
    assert [made(t) for t in outputs] == [True, True, False, False, False, False, False]
    assert len(tracker.alive()) == 1  # the dead one is not kept, nor keeps anything alive
    assert not tracker.made_on(torch.device("meta"))(outputs[0])  # another device: not pooled


def test_fresh_returns_follow_the_schema_and_check_other_libraries_ops() -> None:
    # ATen's schemas say which returns alias an input (views, in-place and out= writes); an op
    # of another library has its outputs compared with its inputs' storages instead.
    lib = torch.library.Library("bcg_test_fresh", "FRAGMENT")
    lib.define("same(Tensor x) -> Tensor")
    lib.impl("same", lambda x: x.detach(), "CompositeExplicitAutograd")  # unannotated alias
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
    x, out = torch.arange(6.0), torch.empty(6)
    with FreshTensorTracker("cpu") as tracker:
        values, indices = torch.max(x.view(2, 3), dim=1)  # two fresh returns
        parts = torch.split(x, 2)  # views
        summed = torch._foreach_add([x, x], 1.0)  # a fresh list
        written = torch.add(x, 1, out=out)  # out=: the argument
        same = torch.ops.bcg_test_fresh.same(x)  # another library's alias: told by storage
        twice = torch.ops.bcg_test_fresh.twice(x)
    made = tracker.made_on(torch.device("cpu"))
    assert [made(t) for t in (values, indices, *summed, twice)] == [True] * 5
    assert not any(made(t) for t in (*parts, written, same, x, out))


class Pair(NamedTuple):
    pooled: torch.Tensor
    static: torch.Tensor


def test_bridge_aliases_pooled_tensors_and_holds_the_rest() -> None:
    pooled, static = torch.zeros(8), torch.zeros(8)
    output = {"pair": Pair(pooled, static), "n": 3}
    bridge = Bridge("b", output, in_pool=lambda t: t is pooled)
    held = bridge.output
    assert type(held["pair"]) is Pair and held["n"] == 3
    assert held["pair"].pooled is not pooled  # an alias: same memory, does not own it
    assert held["pair"].pooled.data_ptr() == pooled.data_ptr()
    assert held["pair"].static is static  # outside the pool: held as it is
    assert bridge.pooled == (held["pair"].pooled,)  # memory accounting counts it in the pool
    bridge.update({"pair": Pair(torch.full((8,), 2.0), torch.full((8,), 5.0)), "n": 3})
    assert torch.equal(pooled, torch.full((8,), 2.0))  # written through the alias
    assert torch.equal(static, torch.full((8,), 5.0))


def test_outputs_a_break_made_are_copied_whole_and_keep_their_views() -> None:
    # At capture a break runs outside the pool; the outputs its ops made are copied into the
    # pool (here: plain CPU allocations) and every view of one storage stays a view of its copy.
    given = torch.arange(8.0)
    made = given * 2
    first, second = made[:3], made[2:].view(2, 3)
    out = {"a": first, "b": second, "given": given, "n": 1}
    moved, pooled = copy_into_pool(
        out, lambda t: t.untyped_storage().data_ptr() != given.data_ptr()
    )
    assert moved["given"] is given and moved["n"] == 1 and not pooled(given)
    a, b = moved["a"], moved["b"]
    assert a.data_ptr() != first.data_ptr() and pooled(a) and pooled(b)
    assert torch.equal(a, first) and torch.equal(b, second)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # still one storage
    b[0, 0] = -1.0  # element 2 of the copy, shared as it was by the originals
    assert a[2].item() == -1.0 and first[2].item() == 4.0


def test_a_made_output_that_requires_grad_stays_in_the_autograd_graph() -> None:
    w = torch.ones(4, requires_grad=True)
    made = w * 3
    (moved,), pooled = copy_into_pool((made,), lambda t: t is made)
    assert pooled(moved) and moved.data_ptr() != made.data_ptr()
    moved.sum().backward()
    assert torch.equal(w.grad, torch.full((4,), 3.0))


def test_a_break_in_a_routed_warmup_runs_outside_the_pool_once() -> None:
    # graph.warmup() routes the thread's allocations to the pool and marks the block; a break
    # called there suspends the routing around its call (breaks nested in it are outside
    # already), a disabled break is segment code and stays in the pool, and nothing is left
    # marked once the block exits, however it exits.
    from bcg_core._capture import context  # noqa: PLC2701

    entered: list[str] = []

    @contextlib.contextmanager
    def outside() -> Iterator[None]:
        entered.append("out")
        yield

    @eager_on_graph(name="inner")
    def inner(t: torch.Tensor) -> torch.Tensor:
        return t + 1

    @eager_on_graph(name="outer")
    def outer(t: torch.Tensor) -> torch.Tensor:
        return inner(t) * 2

    plain = eager_on_graph(enable=False)(lambda t: t - 1)
    x = torch.ones(4)
    with context.routed_warmup(outside):
        assert torch.equal(outer(x), torch.full((4,), 4.0))
        assert entered == ["out"]
        plain(x)
        assert entered == ["out"]
    outer(x)
    assert entered == ["out"] and context.warmup_outside_pool() is None
    with pytest.raises(RuntimeError), context.routed_warmup(outside):
        raise RuntimeError("a warm-up that fails")
    assert context.warmup_outside_pool() is None and context._routed_warmups == 0


def test_lazy_conjugate_and_negative_views_are_copied_as_their_values() -> None:
    # A view of the copied bytes would drop the bit, and the code after the break (and the
    # bridge a replay writes) would read the other values; sparse tensors are held as they are.
    z = torch.randn(6, dtype=torch.complex64)
    conj = (z * 2).conj()
    neg = (z * 3).conj().imag  # a negative view
    sparse = torch.eye(3).to_sparse()
    out = (conj, neg, sparse)
    moved, pooled = copy_into_pool(out, lambda t: t.layout is torch.strided)
    assert not moved[0].is_conj() and torch.equal(moved[0], conj)
    assert not moved[1].is_neg() and torch.equal(moved[1], neg)
    assert moved[2] is sparse and not pooled(sparse)
    assert pooled(moved[0]) and pooled(moved[1])


def test_argument_aliases_keep_the_conjugate_and_negative_bits() -> None:
    from bcg_core._capture.aliases import alias_tensor  # noqa: PLC2701

    z = torch.randn(6, dtype=torch.complex64)
    for view in (z.conj(), z.conj().imag, z[1:4]):
        alias = alias_tensor(view)
        assert alias.data_ptr() == view.data_ptr()
        assert (alias.is_conj(), alias.is_neg()) == (view.is_conj(), view.is_neg())
        assert torch.equal(alias, view)


def test_conjugate_views_through_a_break_with_cuda_rules_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The CPU backend with CUDA's rules for breaks (arguments held by alias, outputs copied
    # into the "pool"): a conjugate view as a break's argument and as its output replays as
    # eager (before, both lost the bit and read the conjugate; the CUDA test is the same step).
    from bcg_core._backends.cpu import CpuBackend  # noqa: PLC2701

    monkeypatch.setattr(CpuBackend, "alias_device_types", frozenset({"cpu"}))
    monkeypatch.setattr(
        CpuBackend, "allocate_to_pool", lambda self, pool, device: contextlib.nullcontext(True)
    )

    @eager_on_graph(name="conj")
    def flip(z: torch.Tensor) -> torch.Tensor:
        return (z * 2).conj()

    x = torch.randn(64, dtype=torch.complex64)

    def step() -> torch.Tensor:
        return flip((x + 1).conj()) * 3

    graph, out = capture(step, BreakableCUDAGraph(backend="cpu"))
    for _ in range(3):
        x.copy_(torch.randn(64, dtype=torch.complex64))
        graph.replay()
        assert torch.equal(out, step())
