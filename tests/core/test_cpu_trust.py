"""No crash, no silent wrong result (issue 21): arguments the graph writes in place, slotted
objects, static buffers under grad mode, the collector's state, errors at replay naming the
break, KeyboardInterrupt during a runner's capture, and failed captures of every kind leaving
earlier graphs right. Scenarios run on the shared ``device`` fixture (the CPU graph backend,
and CUDA graphs where a GPU is present), asserting values."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree  # noqa: PLC2701
from graph_helpers import capture, device_graph

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    ConcurrentCaptureError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
)

# -- arguments the graph writes in place ---------------------------------------------------------


def _append(x: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Writes ``x`` into ``cache[pos]`` and advances ``pos``, in place (a KV-cache step)."""
    cache.index_copy_(0, pos, x * (pos + 1).to(x.dtype) + cache.sum())
    pos.add_(1)
    return cache.sum().reshape(1)


def _steps(fn: Callable[..., torch.Tensor]) -> tuple[Any, ...]:
    cache, pos = torch.zeros(4), torch.zeros(1, dtype=torch.long)
    outs = [fn(torch.full((1,), float(i + 1)), cache, pos).item() for i in range(4)]
    return outs, cache.tolist(), int(pos.item())


def _call(runner: BreakableGraphRunner, *args: Any, **kwargs: Any) -> Any:
    """The first call captures, the later ones replay."""
    return runner(*args, **kwargs) if runner.stats.entries else runner.capture(*args, **kwargs)


@pytest.mark.parametrize("form", ["positional", "keyword", "list", "dict"])
def test_in_place_writes_to_arguments_reach_the_caller(device: str, form: str) -> None:
    # Eager: cache filled and position 4. Before issue 21 the runner kept the writes in its
    # static copies and copied the caller's stale tensors back in: cache zeros, position 0.
    def step(*args: Any, **kwargs: Any) -> torch.Tensor:
        if form == "positional":
            return _append(*args)
        if form == "keyword":
            return _append(args[0], kwargs["cache"], kwargs["pos"])
        if form == "list":
            return _append(args[0], *args[1])
        return _append(args[0], args[1]["cache"], args[1]["pos"])

    def wrap(x: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor) -> Any:
        if form == "positional":
            return (x, cache, pos), {}
        if form == "keyword":
            return (x,), {"cache": cache, "pos": pos}
        if form == "list":
            return (x, [cache, pos]), {}
        return (x, {"cache": cache, "pos": pos}), {}

    expected = _steps(_append)
    runner = BreakableGraphRunner(step, device=device, warmup_iters=0)

    def through_runner(x: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        args, kwargs = wrap(x, cache, pos)
        return _call(runner, *args, **kwargs)  # type: ignore[no-any-return]

    got = _steps(through_runner)
    assert got == expected
    assert got[2] == 4
    assert runner.stats.hits == 3


class _Cache:
    """A cache type that something registered as a pytree node (transformers' export helper
    registers StaticCache), so the runner sees its tensors as arguments in containers."""

    def __init__(self, keys: torch.Tensor, pos: torch.Tensor) -> None:
        self.keys, self.pos = keys, pos


def test_in_place_writes_into_a_registered_pytree_cache_reach_the_caller(device: str) -> None:
    pytree.register_pytree_node(
        _Cache, lambda c: ([c.keys, c.pos], None), lambda xs, _: _Cache(*xs)
    )
    try:

        def step(x: torch.Tensor, cache: _Cache) -> torch.Tensor:
            return _append(x, cache.keys, cache.pos)

        def run(fn: Callable[..., torch.Tensor]) -> tuple[Any, ...]:
            cache = _Cache(torch.zeros(4), torch.zeros(1, dtype=torch.long))
            outs = [fn(torch.full((1,), float(i + 1)), cache).item() for i in range(4)]
            return outs, cache.keys.tolist(), int(cache.pos.item())

        runner = BreakableGraphRunner(step, device=device, warmup_iters=0)
        assert run(lambda *a: _call(runner, *a)) == run(step)
        assert runner.stats.hits == 3
    finally:
        pytree._deregister_pytree_node(_Cache)


def test_capture_leaves_the_written_arguments_as_its_runs_did(device: str) -> None:
    # capture() runs the step warmup_iters + 1 times on the static buffers; what those runs
    # wrote is in the caller's tensors afterwards (documented: stateful inputs advance that often).
    runner = BreakableGraphRunner(_append, device=device, warmup_iters=2)
    cache, pos = torch.zeros(4), torch.zeros(1, dtype=torch.long)
    runner.capture(torch.ones(1), cache, pos)
    assert int(pos.item()) == 3
    ref_cache, ref_pos = torch.zeros(4), torch.zeros(1, dtype=torch.long)
    for _ in range(3):
        _append(torch.ones(1), ref_cache, ref_pos)
    assert torch.equal(cache, ref_cache)


def test_arguments_read_only_are_not_copied_back(device: str) -> None:
    runner = BreakableGraphRunner(lambda x: x * 2, device=device)
    runner.capture(torch.ones(3))
    x = torch.arange(3.0)
    assert torch.equal(runner(x), x * 2)
    (entry,) = runner._entries.values()
    assert entry.written == ()


# -- __slots__ objects ---------------------------------------------------------------------------


class _Slotted:
    __slots__ = ("scale", "weight")

    def __init__(self, scale: int, weight: torch.Tensor) -> None:
        self.scale, self.weight = scale, weight


class _SlottedChild(_Slotted):
    __slots__ = ("__private",)

    def __init__(self, scale: int, weight: torch.Tensor, private: int) -> None:
        super().__init__(scale, weight)
        self.__private = private

    @property
    def private(self) -> int:
        return self.__private


def test_slotted_objects_are_walked_like_dict_ones(device: str) -> None:
    # Before issue 21 a slotted object was a leaf keyed by identity: a changed int or a
    # rebound tensor inside it replayed the capture's values, counted as hits (runner [0, 2],
    # eager [0, 10]).
    def step(x: torch.Tensor, p: _Slotted) -> torch.Tensor:
        return x * p.scale + p.weight

    runner = BreakableGraphRunner(step, device=device)
    params = _Slotted(2, torch.zeros(2))
    x = torch.tensor([0.0, 1.0])
    runner.capture(x, params)
    assert torch.equal(runner(x, params), step(x, params))
    params.scale = 10
    assert torch.equal(runner(x, params), torch.tensor([0.0, 10.0]))
    params.weight = torch.ones(2)  # rebound: another address
    assert torch.equal(runner(x, params), step(x, params))
    assert runner.stats.hits == 1 and runner.stats.misses == 2


def test_slots_of_every_class_and_private_names_are_in_the_signature() -> None:
    from bcg_core import signature_of

    a = _SlottedChild(1, torch.zeros(1), private=5)
    b = _SlottedChild(1, torch.zeros(1), private=6)
    assert signature_of((a,), {}) != signature_of((b,), {})
    from bcg_core._trees import flatten, map_tensors  # noqa: PLC2701

    leaves, _ = flatten(a)
    assert 5 in leaves and 1 in leaves
    copied = map_tensors(a, lambda t: t + 1)
    assert copied is not a and copied.private == 5 and torch.equal(copied.weight, torch.ones(1))
    assert map_tensors(a, lambda t: t) is a


# -- static buffers under grad mode --------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 6])  # one copy_ each, and one batched _foreach_copy_
def test_static_buffers_keep_no_autograd_history(device: str, n: int) -> None:
    # Before issue 21 the buffers were t.clone() and every call's copy extended their autograd
    # history: all callers' graphs stayed alive.
    runner = BreakableGraphRunner(
        lambda *xs: sum(x * (k + 1) for k, x in enumerate(xs)), device=device
    )
    w = torch.ones(4, requires_grad=True)
    runner.capture(*(w * 2 for _ in range(n)))
    inputs = []
    for i in range(20):
        ys = [w * (i + k + 1) for k in range(n)]
        inputs.extend(weakref.ref(y) for y in ys)
        out = runner(*ys)
        assert torch.equal(out, sum(y * (k + 1) for k, y in enumerate(ys)).detach())
        del ys
    gc.collect()
    assert all(r() is None for r in inputs)
    (entry,) = runner._entries.values()
    assert len(entry.statics) == n
    assert all(s.grad_fn is None and not s.requires_grad for s in entry.statics)


# -- the collector's state -----------------------------------------------------------------------

_GC_ENABLE, _GC_DISABLE, _GC_ISENABLED = gc.enable, gc.disable, gc.isenabled


@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("inside", ["disable", "enable"])
def test_the_users_gc_switch_inside_a_capture_stays(before: bool, inside: str) -> None:
    # Before issue 21 a gc.disable() inside a capture was undone when the capture ended.
    gc.enable() if before else gc.disable()
    try:
        seen: list[bool] = []

        def step() -> torch.Tensor:
            getattr(gc, inside)()
            # Still paused: no collection inside a capture (the collector's own answer;
            # gc.isenabled() answers with the user's switch there).
            seen.append(_GC_ISENABLED())
            return torch.ones(2) * 2

        capture(step, BreakableCUDAGraph(backend="cpu"))
        assert seen == [False]
        assert gc.isenabled() is (inside == "enable")
        # the wrappers are gone
        assert (gc.enable, gc.disable, gc.isenabled) == (_GC_ENABLE, _GC_DISABLE, _GC_ISENABLED)
    finally:
        gc.enable()


# -- errors at replay name the break -------------------------------------------------------------


def test_an_error_raised_by_a_break_at_replay_names_it(device: str) -> None:
    fail = [False]

    @eager_on_graph(name="flaky")
    def flaky(h: torch.Tensor) -> torch.Tensor:
        if fail[0]:
            raise ValueError("flaky failed")
        return h + 1

    x = torch.ones(3)
    graph, _ = capture(lambda: flaky(x * 2) * 3)
    graph.replay()
    fail[0] = True
    with pytest.raises(ValueError, match="flaky failed") as info:
        graph.replay()
    notes = getattr(info.value, "__notes__", [])
    assert any("break 'flaky'" in n and "step 2 of 3" in n for n in notes), notes
    fail[0] = False
    graph.replay()  # the graph is unharmed


# -- BaseException during a runner's capture keeps the pool rule ---------------------------------


def test_keyboard_interrupt_in_a_runners_capture_moves_it_to_a_fresh_pool(device: str) -> None:
    interrupt = [False]

    @eager_on_graph
    def maybe_interrupt(h: torch.Tensor) -> torch.Tensor:
        if interrupt[0]:
            raise KeyboardInterrupt
        return h + 1

    def step(x: torch.Tensor) -> torch.Tensor:
        return maybe_interrupt(x * 2) * 3

    runner = BreakableGraphRunner(step, device=device, warmup_iters=0)
    x = torch.ones(4)
    runner.capture(x)
    pool = runner.pool
    interrupt[0] = True
    with pytest.raises(KeyboardInterrupt):
        runner.capture(torch.ones(5))
    interrupt[0] = False
    assert runner.pool is not pool  # a capture stopped half-way never reuses its pool
    assert runner.blocked_signatures == {}  # and the signature is not blamed
    assert torch.equal(runner(x), step(x))  # the earlier graph still replays right
    y = torch.arange(5.0)
    runner.capture(y)  # the interrupted signature captures fine later
    assert torch.equal(runner(y), step(y))
    assert runner.stats.hits == 2


# -- a failed capture of any kind leaves earlier graphs right ------------------------------------


@eager_on_graph
def _raising_break(h: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("break raised")


def _fail_in_break(x: torch.Tensor) -> torch.Tensor:
    return _raising_break(x * 2)


def _fail_host_sync(x: torch.Tensor) -> torch.Tensor:
    return x * float((x * 2).sum().item())


def _fail_refused_op(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0] * 2  # boolean-mask indexing: a data-dependent shape


def _fail_invalidated(x: torch.Tensor) -> torch.Tensor:
    with contextlib.suppress(RuntimeError):
        (x * 2).sum().item()  # refused, the error swallowed: the capture is invalidated anyway
    return x + 1


# CUDA reports the last three as RuntimeError; the CPU backend as CaptureError (a subclass).
FAILURES = {
    "a break raising": _fail_in_break,
    "a host sync": _fail_host_sync,
    "an op refused during capture": _fail_refused_op,
    "an invalidated capture": _fail_invalidated,
}


@pytest.mark.parametrize("kind", sorted(FAILURES))
def test_a_failed_capture_leaves_earlier_graphs_right(device: str, kind: str) -> None:
    fn = FAILURES[kind]

    @eager_on_graph
    def brk(h: torch.Tensor) -> torch.Tensor:
        return h.tanh()

    x = torch.randn(8)
    own = device_graph()
    shared = BreakableCUDAGraph(pool=own.pool(), backend=own.backend)
    out_own = capture(lambda: brk(x * 2) + 1, own)[1]
    out_shared = capture(lambda: brk(x - 1) * 3, shared)[1]
    failing = BreakableCUDAGraph(pool=own.pool(), backend=own.backend)
    with (
        pytest.raises(RuntimeError),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(failing),
    ):
        fn(x)
    for value in (torch.randn(8), torch.randn(8)):
        x.copy_(value)
        own.replay()
        assert torch.equal(out_own, (value * 2).tanh() + 1)
        shared.replay()
        assert torch.equal(out_shared, (value - 1).tanh() * 3)
    failing.reset()
    out_again = capture(lambda: brk(x) * 5, failing)[1]
    failing.replay()
    assert torch.equal(out_again, x.tanh() * 5)


# -- a capture another thread spoiled ------------------------------------------------------------


def test_a_capture_failing_while_another_thread_captures_is_reported_as_spoiled() -> None:
    # What CUDA raises in "global" mode when another thread captures (here raised by hand, on
    # the CPU backend, while a second thread holds a capture open).
    inside, release = threading.Event(), threading.Event()

    @eager_on_graph
    def hold(h: torch.Tensor) -> torch.Tensor:
        inside.set()
        release.wait(timeout=30)
        return h + 1

    def other_thread() -> None:
        graph = BreakableCUDAGraph(backend="cpu")
        capture(lambda: hold(torch.ones(2)) * 2, graph)

    def step(x: torch.Tensor) -> torch.Tensor:
        if is_breakable_capture_active():
            raise RuntimeError("operation not permitted when stream is capturing")
        return x * 2

    runner = BreakableGraphRunner(step, device="cpu", warmup_iters=0)
    worker = threading.Thread(target=other_thread)
    worker.start()
    try:
        assert inside.wait(timeout=30)
        x = torch.ones(3)
        assert torch.equal(runner.capture(x), x * 2)  # served eagerly, right
        assert runner.stats.failed_captures == 1
        assert runner.blocked_signatures == {}  # not blamed on the signature
        graph = BreakableCUDAGraph(backend="cpu")
        with (
            pytest.raises(ConcurrentCaptureError, match="another thread was capturing") as info,
            enable_breakable_cuda_graph(),
            BreakableCUDAGraphCapture(graph),
        ):
            step(x)
        assert isinstance(info.value.__cause__, RuntimeError)
        with (
            pytest.raises(RuntimeError, match="my own bug") as alone,  # still the user's error
            enable_breakable_cuda_graph(),
            BreakableCUDAGraphCapture(BreakableCUDAGraph(backend="cpu")),
        ):
            raise RuntimeError("my own bug")
        assert not isinstance(alone.value, ConcurrentCaptureError)
    finally:
        release.set()
        worker.join()
    assert runner.stats.failed_captures == 1
