"""A serving engine's threads on the CPU graph backend: one runner called from several threads,
captures while others replay, resets racing replays, flag blocks in several threads. Every
output is compared bitwise with eager; threads are ordered by barriers and events (never by
sleeps) and joined with a timeout, so a hang fails the test instead of the suite."""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from thread_helpers import run_threads

import bcg_core
from bcg_core import BreakableGraphRunner, eager_on_graph

_TIMEOUT = 20.0


def _run_threads(targets: list[Callable[[], None]]) -> None:
    run_threads(targets, _TIMEOUT)


@eager_on_graph
def _shift(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _step(x: torch.Tensor) -> torch.Tensor:
    return _shift(x * 2) * 3


def _clean() -> None:
    assert not bcg_core.is_breakable_capture_active()
    assert not bcg_core.is_in_breakable_cuda_graph()
    assert not bcg_core.breakable_graphs_disabled()


@pytest.mark.parametrize(
    ("make", "read"),
    [
        (bcg_core.disable_breakable_graphs, bcg_core.breakable_graphs_disabled),
        (bcg_core.enable_breakable_cuda_graph, bcg_core.is_in_breakable_cuda_graph),
    ],
)
def test_one_flag_block_object_entered_in_two_threads_restores_each_thread(
    make: Callable[[], Any], read: Callable[[], bool]
) -> None:
    """A block made once (``NO_BCG = disable_breakable_graphs()``) and entered by two request
    threads whose blocks interleave: each thread's exit must restore its own flag (the second
    thread's exit left the first thread's block: both kept the flag set)."""
    block = make()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with block:
            a_in.set()
            assert b_in.wait(_TIMEOUT)
            seen["a inside"] = read()
        seen["a after"] = read()
        a_out.set()

    def second() -> None:
        assert a_in.wait(_TIMEOUT)
        with block:
            b_in.set()
            assert a_out.wait(_TIMEOUT)
            seen["b inside"] = read()
        seen["b after"] = read()

    _run_threads([first, second])
    assert seen == {"a inside": True, "a after": False, "b inside": True, "b after": False}
    _clean()


def _eager(x: torch.Tensor) -> torch.Tensor:
    return (x * 2 + 1) * 3


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, 4, generator=g) for n in (1, 2, 3)]


def test_many_threads_replaying_one_runner_count_every_call_and_match_eager() -> None:
    """Six request threads on one runner: captured shapes, an uncaptured shape (a miss), and
    calls inside a thread's disable_breakable_graphs() (misses there only)."""
    runner = BreakableGraphRunner(_step, device="cpu")
    shapes = _inputs()
    report = runner.capture_many([((x,), {}) for x in shapes])
    assert len(report.captured) == 3
    odd = torch.randn(5, 4)
    start = threading.Barrier(6)

    def worker(k: int) -> None:
        start.wait(_TIMEOUT)
        for i in range(30):
            x = shapes[(i + k) % 3] + i
            if k == 5 and i % 3 == 0:
                with bcg_core.disable_breakable_graphs():
                    assert torch.equal(runner(x), _eager(x))
                continue
            if k == 4 and i % 5 == 0:
                x = odd + i
            assert torch.equal(runner(x), _eager(x))
            assert not bcg_core.breakable_graphs_disabled()

    _run_threads([lambda k=k: worker(k) for k in range(6)])
    stats = runner.stats
    assert stats.captures == 3 and stats.failed_captures == 0
    assert stats.hits + stats.misses == 6 * 30 + 0  # capture_many's calls were captures
    assert stats.misses == 10 + 6
    assert runner.blocked_signatures == {}
    _clean()


def test_a_capture_in_one_thread_while_others_replay() -> None:
    """Threads replay captured shapes while one opens a warm-up window and captures new ones:
    each result is eager's, each new shape is captured once."""
    runner = BreakableGraphRunner(_step, device="cpu")
    old = _inputs()
    runner.capture_many([((x,), {}) for x in old])
    new = [torch.randn(n, 4) for n in (6, 7)]
    start = threading.Barrier(5)

    def replayer() -> None:
        start.wait(_TIMEOUT)
        for i in range(25):
            x = old[i % 3] - i
            assert torch.equal(runner(x), _eager(x))

    def capturer() -> None:
        start.wait(_TIMEOUT)
        with runner.warmup():
            for x in new:
                assert torch.equal(runner(x), _eager(x))

    _run_threads([replayer] * 4 + [capturer])
    stats = runner.stats
    assert stats.captures == 5 and stats.failed_captures == 0
    assert stats.hits == 100 and stats.misses == 0
    for x in new:
        assert torch.equal(runner(x * 2), _eager(x * 2))
    assert runner.stats.hits == 102
    _clean()


def test_reset_from_another_thread_waits_for_a_replay_in_a_break() -> None:
    """An engine's admin thread resets the runner while a request thread is inside a break of
    a replay: the reset waits for the call, whose result is eager's."""
    inside, go = threading.Event(), threading.Event()
    hold = [False]

    @eager_on_graph
    def gate(x: torch.Tensor) -> torch.Tensor:
        if hold[0] and not bcg_core.is_breakable_capture_active():
            hold[0] = False
            inside.set()
            assert go.wait(_TIMEOUT)
        return x + 1

    def step(x: torch.Tensor) -> torch.Tensor:
        return gate(x * 2) * 3

    runner = BreakableGraphRunner(step, device="cpu")
    x = torch.randn(2, 4)
    runner.capture(x)
    hold[0] = True
    out: list[torch.Tensor] = []

    def request() -> None:
        out.append(runner(x + 5))

    def admin() -> None:
        assert inside.wait(_TIMEOUT)
        go.set()
        runner.reset()

    _run_threads([request, admin])
    assert torch.equal(out[0], _eager(x + 5))
    assert runner.stats.captures == 0 and runner.stats.entries == ()
    assert torch.equal(runner(x), _eager(x))  # no window: eager
    _clean()


def test_two_runners_capturing_at_once_in_two_threads() -> None:
    """Two runners with their own pools capture at the same time (their breaks meet at a
    barrier, so both captures are open together), then replay from both threads."""
    meet = threading.Barrier(2)

    def make(scale: float) -> tuple[BreakableGraphRunner, Callable[[torch.Tensor], torch.Tensor]]:
        @eager_on_graph
        def brk(x: torch.Tensor) -> torch.Tensor:
            if bcg_core.is_breakable_capture_active():
                meet.wait(_TIMEOUT)
            return x.sin()

        def step(x: torch.Tensor) -> torch.Tensor:
            return brk(x * scale) + scale

        return BreakableGraphRunner(step, device="cpu", warmup_iters=0), step

    pairs = [make(2.0), make(3.0)]
    x = torch.randn(3, 4)

    def worker(k: int) -> None:
        runner, step = pairs[k]
        assert torch.equal(runner.capture(x), step(x))
        assert not bcg_core.is_breakable_capture_active()
        for i in range(20):
            assert torch.equal(runner(x + i), step(x + i))

    _run_threads([lambda k=k: worker(k) for k in range(2)])
    for runner, _ in pairs:
        stats = runner.stats
        assert (stats.captures, stats.failed_captures, stats.hits, stats.misses) == (1, 0, 20, 0)
    _clean()


def test_a_capture_failing_in_one_thread_does_not_reach_another_threads_capture() -> None:
    """Thread A's capture fails in a break while thread B's capture of another runner is open;
    meanwhile B's thread and a third one do host reads and reseed eagerly. Only A's signature
    is blocked; every result is eager's."""
    meet, done = threading.Barrier(3), threading.Event()

    @eager_on_graph
    def bad(x: torch.Tensor) -> torch.Tensor:
        if bcg_core.is_breakable_capture_active():
            meet.wait(_TIMEOUT)
            raise ValueError("a break failing at capture")
        return x - 1

    @eager_on_graph
    def good(x: torch.Tensor) -> torch.Tensor:
        if bcg_core.is_breakable_capture_active():
            meet.wait(_TIMEOUT)
            assert done.wait(_TIMEOUT)
        return x + 1

    def step_a(x: torch.Tensor) -> torch.Tensor:
        return bad(x * 2) * 3

    def step_b(x: torch.Tensor) -> torch.Tensor:
        return good(x * 2) * 3

    ra = BreakableGraphRunner(step_a, device="cpu")
    rb = BreakableGraphRunner(step_b, device="cpu")
    x = torch.randn(2, 4)

    def a() -> None:
        assert torch.equal(ra.capture(x), step_a(x))
        done.set()

    def b() -> None:
        assert torch.equal(rb.capture(x), step_b(x))
        for i in range(10):
            assert torch.equal(rb(x + i), step_b(x + i))

    def bystander() -> None:
        meet.wait(_TIMEOUT)
        assert x.tolist() == x.tolist()
        torch.manual_seed(123)

    _run_threads([a, b, bystander])
    assert list(ra.blocked_signatures) != [] and rb.blocked_signatures == {}
    assert (rb.stats.captures, rb.stats.hits) == (1, 10)
    assert (ra.stats.failed_captures, ra.stats.captures) == (1, 0)
    _clean()


def test_runners_sharing_a_pool_called_from_threads_and_from_each_others_breaks() -> None:
    """Two runners on one pool, called from four threads; the first runner's break calls the
    second (same pool: an eager miss there). Every call counted once, every result eager's."""
    inner = BreakableGraphRunner(_step, device="cpu")

    @eager_on_graph
    def via_inner(x: torch.Tensor) -> torch.Tensor:
        return inner(x)

    def outer_step(x: torch.Tensor) -> torch.Tensor:
        return via_inner(x - 1) + 2

    def outer_eager(x: torch.Tensor) -> torch.Tensor:
        return _eager(x - 1) + 2

    outer = BreakableGraphRunner(outer_step, device="cpu", pool=inner.pool)
    shapes = _inputs()
    inner.capture_many([((x,), {}) for x in shapes])
    outer.capture_many([((x,), {}) for x in shapes])
    base = inner.stats
    start = threading.Barrier(4)

    def worker(k: int) -> None:
        start.wait(_TIMEOUT)
        for i in range(20):
            x = shapes[(i + k) % 3] * (i + 1)
            if (i + k) % 2:
                assert torch.equal(outer(x), outer_eager(x))
            else:
                assert torch.equal(inner(x), _eager(x))

    _run_threads([lambda k=k: worker(k) for k in range(4)])
    o, n = outer.stats, inner.stats
    assert (o.hits, o.misses, o.captures) == (40, 0, 3)
    # inner: 40 direct replays, and 40 eager misses from outer's breaks at replay
    assert n.hits - base.hits == 40 and n.misses - base.misses == 40
    _clean()


def test_evictions_while_threads_capture_and_replay_in_one_window() -> None:
    """max_entries=2 with three shapes, four threads in an open window: entries are evicted and
    captured again; each call is a capture or a hit, each result eager's."""
    runner = BreakableGraphRunner(_step, device="cpu", max_entries=2)
    shapes = _inputs()
    start = threading.Barrier(4)

    def worker(k: int) -> None:
        start.wait(_TIMEOUT)
        for i in range(15):
            x = shapes[(i * (k + 1)) % 3] + k
            assert torch.equal(runner(x), _eager(x))

    with runner.warmup():
        _run_threads([lambda k=k: worker(k) for k in range(4)])
    stats = runner.stats
    assert stats.hits + stats.captures == 60 and stats.misses == 0
    assert stats.failed_captures == 0 and stats.evictions == stats.captures - 2
    assert len(stats.entries) == 2
    _clean()


def test_a_graph_reset_on_another_thread_as_a_replay_starts_is_refused() -> None:
    """``BreakableCUDAGraph.reset()`` promises ``ReplayError`` while the graph is replayed on
    another thread. A replay that had checked the graph was captured but not yet counted itself
    as running let the reset drop its segments under it. The replaying thread is stopped right
    there (a trace function on the line that takes the plan) while the other thread resets."""
    graph = bcg_core.BreakableCUDAGraph(backend="cpu")
    x = torch.randn(2, 4)
    with bcg_core.enable_breakable_cuda_graph(), bcg_core.BreakableCUDAGraphCapture(graph):
        out = _step(x)
    replay = bcg_core.BreakableCUDAGraph.replay
    lines, first = inspect.getsourcelines(replay)
    gap = first + next(i for i, line in enumerate(lines) if "plan = self._plan" in line)
    at_gap, reset_tried = threading.Event(), threading.Event()
    refused: list[BaseException] = []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not replay.__code__:
            return None
        if event == "line" and frame.f_lineno == gap and not at_gap.is_set():
            at_gap.set()
            assert reset_tried.wait(_TIMEOUT)
        return trace

    def replayer() -> None:
        sys.settrace(trace)
        try:
            graph.replay()
        finally:
            sys.settrace(None)

    def resetter() -> None:
        assert at_gap.wait(_TIMEOUT)
        try:
            graph.reset()
        except bcg_core.ReplayError as exc:
            refused.append(exc)
        finally:
            reset_tried.set()

    x.add_(1)
    _run_threads([replayer, resetter])
    assert len(refused) == 1, "reset() dropped the segments of a replay running on another thread"
    assert torch.equal(out, _eager(x))
    graph.reset()
    _clean()


def test_one_flag_block_object_entered_by_two_tasks_restores_each_task() -> None:
    """The same for two asyncio tasks of one thread whose blocks interleave."""
    block = bcg_core.disable_breakable_graphs()
    seen: dict[str, bool] = {}

    async def main() -> None:
        a_in, b_in, a_out = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def first() -> None:
            with block:
                a_in.set()
                await b_in.wait()
            seen["a after"] = bcg_core.breakable_graphs_disabled()
            a_out.set()

        async def second() -> None:
            await a_in.wait()
            with block:
                b_in.set()
                await a_out.wait()
                seen["b inside"] = bcg_core.breakable_graphs_disabled()
            seen["b after"] = bcg_core.breakable_graphs_disabled()

        await asyncio.wait_for(asyncio.gather(first(), second()), _TIMEOUT)

    asyncio.run(main())
    assert seen == {"a after": False, "b inside": True, "b after": False}
    _clean()
