"""The runner for serving: one pool across signatures, capture order, eviction and reset,
Python scalars as device inputs, bounded miss logs, disabled graphs, the runtime flag at replay
and how often capture runs the step. Scenarios run on the shared ``device`` fixture (the CPU
graph backend everywhere, CUDA graphs where a GPU is present), with the same assertions."""

from __future__ import annotations

import logging

import pytest
import torch
from graph_helpers import device_graph

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    CaptureError,
    disable_breakable_graphs,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
    is_in_breakable_cuda_graph,
    signature_of,
)
from bcg_core._backends.cpu import CpuBackend  # noqa: PLC2701
from bcg_core._runner.pool import PoolTurn  # noqa: PLC2701
from bcg_core.bench import BenchContext
from bcg_core.bench._workloads import discover  # noqa: PLC2701


@eager_on_graph
def _squash(h: torch.Tensor) -> torch.Tensor:
    # tanh, not softmax: CPU softmax is parallel even on tiny tensors, slow on a busy machine.
    return h.tanh()


def _model(x: torch.Tensor) -> torch.Tensor:
    return _squash(x * 2) + 1


def _eager(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).tanh() + 1


def _bad_lines(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


# -- one pool -----------------------------------------------------------------------------------


def test_every_signature_captures_into_the_runners_one_pool(device: str) -> None:
    runner = BreakableGraphRunner(_model, device=device)
    for batch in (8, 4, 1):
        runner.capture(torch.randn(batch, 6))
    entries = runner.stats.entries
    assert len(entries) == 3
    assert all(e.pool is runner.pool for e in entries)
    for batch in (1, 8, 4, 8):
        x = torch.randn(batch, 6)
        assert torch.equal(runner(x), _eager(x))
    assert runner.stats.hits == 4


def test_runners_share_a_pool_given_as_pool(device: str) -> None:
    first = BreakableGraphRunner(_model, device=device)
    second = BreakableGraphRunner(lambda x: _model(x) * 3, device=device, pool=first.pool)
    first.capture(torch.randn(4, 6))
    second.capture(torch.randn(2, 6))
    assert second.pool is first.pool
    assert second.stats.entries[0].pool is first.stats.entries[0].pool
    # One lock for both: their replays can never overlap.
    assert second._lock is first._lock
    for _ in range(3):
        x, y = torch.randn(4, 6), torch.randn(2, 6)
        assert torch.equal(first(x), _eager(x))
        assert torch.equal(second(y), _eager(y) * 3)
    with pytest.raises(TypeError, match=r"pass its pool \(runner\.pool"):
        BreakableGraphRunner(_model, device=device, pool=first)


def test_capture_many_captures_largest_first_or_in_the_given_order(device: str) -> None:
    seen: list[int] = []

    def model(x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        seen.append(x.shape[0])
        return _squash(x) * scale

    calls = [((torch.randn(b, 4),), {"scale": 2.0}) for b in (2, 16, 4, 16)]
    runner = BreakableGraphRunner(model, device=device, warmup_iters=0)
    report = runner.capture_many(calls)
    assert [e.signature for e in report.captured] == [e.signature for e in runner.stats.entries]
    assert seen == [16, 4, 2]  # the second batch 16 replays (Python does not run)
    assert runner.stats.captures == 3 and runner.stats.hits == 1
    seen.clear()
    given = BreakableGraphRunner(model, device=device, warmup_iters=0)
    given.capture_many(calls, order="given")
    assert seen == [2, 16, 4]
    with pytest.raises(TypeError, match=r"\(args, kwargs\) pairs.*item 0 is Tensor"):
        runner.capture_many([torch.ones(2)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="order must be"):
        runner.capture_many(calls, order="smallest_first")  # type: ignore[arg-type]


def test_eviction_and_reset_release_graphs(device: str) -> None:
    runner = BreakableGraphRunner(_model, device=device, max_entries=2)
    for batch in (4, 3, 2):
        runner.capture(torch.randn(batch, 6))
    stats = runner.stats
    assert stats.evictions == 1  # the least recently used: batch 4
    assert [e.signature for e in stats.entries] == [
        signature_of((torch.randn(b, 6),), {}) for b in (3, 2)
    ]
    x = torch.randn(4, 6)  # evicted: eager, correct, a miss
    assert torch.equal(runner(x), _eager(x))
    assert runner.stats.misses == 1
    own_pool = runner.pool
    runner.reset()
    assert runner.stats.entries == () and runner.stats.hits == 0
    assert runner.pool is not own_pool  # a pool the runner made is released with its graphs
    shared = BreakableGraphRunner(_model, device=device, pool=own_pool)
    shared.capture(torch.randn(2, 6))
    shared.reset()
    assert shared.pool is own_pool  # a pool given with pool= stays for later captures
    y = torch.randn(2, 6)
    shared.capture(y)
    assert torch.equal(shared(y), _eager(y))


def _mix(x: torch.Tensor, scale: int, *, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _squash(x * scale + a * 2) + b * 3


def _mix_eager(x: torch.Tensor, scale: int, *, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (x * scale + a * 2).tanh() + b * 3


def test_a_repeated_call_skips_its_signature_but_never_replays_another(device: str) -> None:
    # The runner's guard of its last hit (FlatGuard) must send every call that differs in
    # shape, dtype, constant or keyword names to the signature, and must die with its entry.
    runner = BreakableGraphRunner(_mix, device=device, max_entries=2)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def call(
        shape: tuple[int, ...],
        scale: int = 2,
        dtype: torch.dtype = torch.float32,
        flip: bool = False,
    ) -> None:
        x, a, b = (torch.randn(shape, generator=gen, device="cpu").to(device, dtype) for _ in "xab")
        out = runner(x, scale, b=b, a=a) if flip else runner(x, scale, a=a, b=b)
        assert torch.equal(out, _mix_eager(x, scale, a=a, b=b)), (shape, scale, dtype, flip)

    with runner.warmup():
        call((2, 6))
    for flip in (False, True, False, True):
        call((2, 6), flip=flip)  # keywords in either order: one signature, inputs kept apart
    assert runner.stats.hits == 4 and runner.stats.misses == 0
    assert runner._last is not None  # the guard path is the one exercised from here
    others = [((3, 6), 2, torch.float32), ((2, 6), 4, torch.float32)]
    others += [((2, 6), 2, torch.float64), ((2, 6, 1), 2, torch.float32)]
    for shape, scale, dtype in others:
        call(shape, scale, dtype)
        call((2, 6))
    assert runner.stats.misses == 4 and runner.stats.hits == 8
    with runner.warmup():
        call((3, 6), 3)
        call((4, 6))  # evicts the (2, 6) graph: the guard of its last hit goes with it
    assert runner.stats.evictions == 1
    call((2, 6))
    assert runner.stats.misses == 5
    for _ in range(3):
        call((3, 6), 3, flip=True)
        call((4, 6))
    assert runner.stats.hits == 14
    runner.reset()
    call((4, 6))  # after reset nothing replays
    assert runner.stats.misses == 1 and runner.stats.hits == 0


# -- Python scalars -----------------------------------------------------------------------------


def _timestep_model(x: torch.Tensor, t: torch.Tensor, guidance: float = 1.0) -> torch.Tensor:
    return _squash(x * t) * guidance + t


def test_as_tensor_scalars_replay_one_graph_for_every_value(
    device: str, caplog: pytest.LogCaptureFixture
) -> None:
    runner = BreakableGraphRunner(_timestep_model, device=device, as_tensor=("t", "guidance"))
    x = torch.randn(2, 5)
    runner.capture(x, 0.5, guidance=3.0)
    runner.capture(x, t=0.5, guidance=3.0)  # by keyword: another call structure, another graph
    gen = torch.Generator(device="cpu").manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        for i in range(500):
            t, g = float(torch.rand((), generator=gen, device="cpu")), 1.0 + i / 100
            by_keyword = i % 2 == 1  # "t" is lifted either way: it is the 2nd parameter
            out = runner(x, t=t, guidance=g) if by_keyword else runner(x, t, guidance=g)
            tt = torch.tensor(t)
            assert torch.allclose(out, _squash(x * tt) * torch.tensor(g) + tt), i
    stats = runner.stats
    assert stats.misses == 0 and stats.captures == 2 and stats.hits == 500
    assert caplog.records == []


def test_scalars_left_static_are_misses_with_bounded_logs(
    device: str, caplog: pytest.LogCaptureFixture
) -> None:
    runner = BreakableGraphRunner(_timestep_model, device=device)
    x = torch.randn(2, 5)
    runner.capture(x, torch.tensor(0.5), guidance=1.0)
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        for i in range(50):
            out = runner(x, torch.tensor(0.5), guidance=2.0 + i)
            assert torch.equal(out, _timestep_model(x, torch.tensor(0.5), 2.0 + i))
    assert runner.stats.misses == 50
    assert _bad_lines(caplog, "has no graph for this call") == 8
    assert "kwargs['guidance']: 2.0 (captured: 1.0)" in caplog.records[0].getMessage()
    assert _bad_lines(caplog, "further misses are not logged") == 1
    assert len(runner._misses) <= 9


def test_as_tensor_rejects_what_it_cannot_name() -> None:
    with pytest.raises(TypeError, match="collection of positions and names"):
        BreakableGraphRunner(_timestep_model, device="cpu", as_tensor="t")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="positions \\(int\\) or keyword names"):
        BreakableGraphRunner(_timestep_model, device="cpu", as_tensor=(1.5,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        BreakableGraphRunner(_timestep_model, device="cpu", as_tensor=(-1,))


# -- disabled graphs, the runtime flag ---------------------------------------------------------


def test_disabled_graphs_run_the_runner_eagerly_with_live_breaks(
    device: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    flags: list[bool] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        flags.append(is_in_breakable_cuda_graph())
        return _model(x)

    runner = BreakableGraphRunner(model, device=device)
    runner.capture(torch.randn(3, 6))
    monkeypatch.setenv("BCG_DISABLE", "1")
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        for _ in range(4):
            x = torch.randn(3, 6)
            assert torch.equal(runner(x), _eager(x))
            runner.capture(torch.randn(2, 6))
    assert runner.stats.hits == 0 and runner.stats.captures == 1  # nothing replayed or captured
    assert flags[-8:] == [False] * 8  # model code took its eager path every time
    assert _bad_lines(caplog, "breakable graphs are disabled (BCG_DISABLE=1 is set)") == 1
    monkeypatch.delenv("BCG_DISABLE")
    x = torch.randn(3, 6)
    assert torch.equal(runner(x), _eager(x)) and runner.stats.hits == 1
    with disable_breakable_graphs():
        assert torch.equal(runner(x), _eager(x)) and runner.stats.hits == 1
    assert torch.equal(runner(x), _eager(x)) and runner.stats.hits == 2


def test_disabled_graphs_make_a_capture_refuse_and_leave_nothing_behind(device: str) -> None:
    graph = device_graph()
    with (
        disable_breakable_graphs(),
        pytest.raises(CaptureError, match=r"disabled \(the call is inside disable_breakable"),
        BreakableCUDAGraphCapture(graph),
    ):
        pass
    assert not is_breakable_capture_active()
    x = torch.randn(2, 6)
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):  # still usable
        out = _model(x)
    graph.replay()
    assert torch.equal(out, _eager(x))


def test_breaks_see_the_runtime_flag_at_replay_as_at_capture(device: str) -> None:
    seen: list[bool] = []

    @eager_on_graph
    def probe(h: torch.Tensor) -> torch.Tensor:
        seen.append(is_in_breakable_cuda_graph())
        return h + 1

    runner = BreakableGraphRunner(lambda x: probe(x * 2), device=device, warmup_iters=1)
    runner.capture(torch.ones(3))
    for _ in range(3):
        runner(torch.ones(3))
    assert seen == [True] * 5
    assert not is_in_breakable_cuda_graph()


# -- how often capture runs the step -------------------------------------------------------------


@pytest.mark.parametrize("warmup_iters", [0, 2])
def test_capture_runs_the_step_warmups_plus_one_and_returns_its_output(
    device: str, warmup_iters: int
) -> None:
    position = torch.zeros((), dtype=torch.long)  # stateful, like a cache's write position

    def step(x: torch.Tensor) -> torch.Tensor:
        out = _squash(x) + position
        position.add_(1)
        return out

    runner = BreakableGraphRunner(step, device=device, warmup_iters=warmup_iters)
    x = torch.randn(3, 4)
    out = runner.capture(x)
    assert int(position) == warmup_iters + 1
    assert runner.stats.entries[0].capture_runs == warmup_iters + 1
    assert torch.equal(out, x.tanh() + warmup_iters)  # the capture's own run
    position.zero_()  # the recipe for stateful inputs: capture at start-up, then reset
    assert torch.equal(runner(x), x.tanh())
    assert int(position) == 1
    runner.capture(x)  # already captured: one run (a replay)
    assert int(position) == 2


# -- the memory workload ------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")
def test_memory_workload_skips_without_cuda_saying_why() -> None:
    results = discover()["memory"](BenchContext(torch.device("cpu"), smoke=True))
    assert [m.contender for m in results] == ["full_graph", "bcg"]
    assert all(m.skipped is not None and "needs CUDA" in m.skipped for m in results)


def test_the_pool_turn_orders_by_the_last_stream_and_refuses_a_capturing_one() -> None:
    # Calls from the stream of the last use are ordered by that stream; another stream waits on
    # an event recorded then on the last one, which cannot be done while it captures.
    backend = CpuBackend()
    turn = PoolTurn(backend)
    other = backend.new_stream()
    turn.wait(other)  # nothing to wait for before the first use
    turn.drain()
    with BreakableCUDAGraphCapture(BreakableCUDAGraph(backend="cpu")):
        capturing = backend.current_stream()
        turn.record(capturing)
        turn.wait(capturing)  # the same stream: nothing to record
        with pytest.raises(CaptureError, match="which is capturing now"):
            turn.wait(other)
        with pytest.raises(CaptureError, match="which is capturing now"):
            turn.drain()
    turn.wait(other)  # the capture ended: the last stream can be waited for again
    turn.drain()
