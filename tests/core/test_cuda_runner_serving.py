"""The runner on CUDA: device-side ordering of calls made on different streams, runners
sharing one pool, memory returned by ``reset()``, CPU 0-dim inputs written without a
host-to-device copy. The semantics shared with the CPU backend are in
test_cpu_runner_serving.py."""

from __future__ import annotations

import gc

import pytest
import torch

from bcg_core import BreakableGraphRunner, eager_on_graph
from bcg_core.bench import BenchContext
from bcg_core.bench._workloads import discover  # noqa: PLC2701

pytestmark = pytest.mark.cuda

# About 10-30 ms on current GPUs: long enough for a second call to be issued while the first
# replay still runs.
SLEEP_CYCLES = 30_000_000


@eager_on_graph
def _plus_one(h: torch.Tensor) -> torch.Tensor:
    return h + 1


def _slow_double(x: torch.Tensor) -> torch.Tensor:
    torch.cuda._sleep(SLEEP_CYCLES)  # captured: a replay reads x only after the sleep
    return _plus_one(x * 2) - 1


def _slow_triple(x: torch.Tensor) -> torch.Tensor:
    torch.cuda._sleep(SLEEP_CYCLES)
    return _plus_one(x * 3) - 1


def test_a_call_on_another_stream_waits_for_the_previous_replay() -> None:
    runner = BreakableGraphRunner(_slow_double, device="cuda")
    runner.capture(torch.zeros(2, device="cuda"))
    a_in, b_in = torch.full((2,), 1.0, device="cuda"), torch.full((2,), 5.0, device="cuda")
    stream_a, stream_b = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    for _ in range(3):
        with torch.cuda.stream(stream_a):
            out_a = runner(a_in)
        with torch.cuda.stream(stream_b):
            out_b = runner(b_in)  # its input copy must wait for call A's replay and clone
        torch.cuda.synchronize()
        assert out_a.tolist() == [2.0, 2.0]
        assert out_b.tolist() == [10.0, 10.0]
    assert runner.stats.hits == 6


def test_runners_sharing_a_pool_replay_one_at_a_time_across_streams() -> None:
    first = BreakableGraphRunner(_slow_double, device="cuda")
    second = BreakableGraphRunner(_slow_triple, device="cuda", pool=first.pool)
    first.capture(torch.zeros(1024, device="cuda"))
    second.capture(torch.zeros(1024, device="cuda"))
    assert first.stats.entries[0].pool is second.stats.entries[0].pool is first.pool
    a_in, b_in = torch.full((1024,), 1.0, device="cuda"), torch.full((1024,), 5.0, device="cuda")
    stream_a, stream_b = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    for _ in range(3):
        with torch.cuda.stream(stream_a):
            out_a = first(a_in)
        with torch.cuda.stream(stream_b):
            out_b = second(b_in)  # may reuse the pool memory that first's replay is using
        torch.cuda.synchronize()
        assert torch.equal(out_a, torch.full_like(a_in, 2.0))
        assert torch.equal(out_b, torch.full_like(b_in, 15.0))


def _measure() -> tuple[int, int]:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def test_reset_returns_the_pool_and_the_static_buffers() -> None:
    def model(x: torch.Tensor) -> torch.Tensor:  # elementwise only: no cuBLAS workspace
        return _plus_one(x * 2).sqrt() + x

    runner = BreakableGraphRunner(model, device="cuda")
    torch.cuda.synchronize()
    _ = runner.stream  # the capture stream exists before the baseline, as in a server
    allocated, reserved = _measure()
    sizes = (1 << 22, 1 << 20, 1 << 18)  # 16 MiB, 4 MiB, 1 MiB of float32
    runner.capture_many([((torch.rand(n, device="cuda"),), {}) for n in sizes])
    grown, _ = _measure()
    assert grown >= allocated + 4 * sum(sizes)  # static inputs (at least)
    x = torch.rand(1 << 20, device="cuda")
    assert torch.equal(runner(x), model(x))
    del x
    runner.reset()
    assert _measure() == (allocated, reserved)


def test_a_cpu_zero_dim_input_is_filled_into_its_device_buffer() -> None:
    def model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return _plus_one(x * t) * t

    runner = BreakableGraphRunner(model, device="cuda")
    x = torch.rand(8, device="cuda")
    runner.capture(x, torch.tensor(0.5))
    for value in (0.1, 2.0, 3.5, -1.25):
        t = torch.tensor(value)
        assert torch.allclose(runner(x, t), model(x, t.cuda()))
    assert runner.stats.hits == 4 and runner.stats.misses == 0


def test_memory_workload_measures_both_and_replays_correctly() -> None:
    plain, bcg = discover()["memory"](BenchContext(torch.device("cuda"), smoke=True))
    assert plain.pool_mb is not None and plain.pool_mb > 0
    assert bcg.pool_mb is not None and bcg.ratio_to_full_graph is not None
    assert bcg.correct is True
