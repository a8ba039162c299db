"""torch.compile with breaks, holes of a fourth review, on the CPU graph backend: every replay is
compared with the compiled step called outside the capture (bitwise) and with eager.

Backend ``aot_eager`` (dynamo and AOTAutograd, which make a break opaque), and ``inductor`` for
one small step only (its C++ compiles are slow on this box; the CUDA tests run it).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    eager_on_graph,
    enable_breakable_cuda_graph,
)

_adds = [eager_on_graph(lambda x, i=i: x + i, name=f"r43.add{i}") for i in range(9)]


def _chain(x: torch.Tensor) -> torch.Tensor:
    for add in _adds:
        x = add(x.sin())
    return x * 2


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_capture_leaves_the_compiled_function_compiled(fullgraph: bool) -> None:
    # Under the CPU recorder's dispatch mode dynamo skipped the compiled frame and marked its
    # code skipped for good: after one capture the function ran uncompiled at every call (its
    # breaks' frames compiled one by one instead), and with fullgraph=True the capture failed
    # ("found no compiled frames") and every later call hit dynamo's recompile limit.
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_chain, backend=counter, fullgraph=fullgraph)
    x = torch.randn(4)
    compiled(x)
    assert counter.frame_count == 1
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        static = compiled(x)
    assert len(graph.break_names) == len(_adds)
    for _ in range(2):
        x.copy_(torch.randn(4))
        graph.replay()
        assert torch.equal(static, compiled(x))
        torch.testing.assert_close(static, _chain(x))
    assert counter.frame_count == 1  # still the one compiled graph


def test_a_runner_over_a_fullgraph_compiled_step_captures_and_keeps_it_compiled() -> None:
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_chain, backend=counter, fullgraph=True)
    runner = BreakableGraphRunner(compiled, device="cpu")
    with runner.warmup():
        for n in (4, 6):
            runner(torch.randn(n))
    frames = counter.frame_count
    for n in (4, 6, 4):
        x = torch.randn(n)
        assert torch.equal(runner(x), compiled(x))
        torch.testing.assert_close(runner(x), _chain(x))
    assert runner.stats.captures == 2 and runner.stats.failed_captures == 0
    assert counter.frame_count == frames


_TABLE = torch.arange(3.0)


@eager_on_graph(name="r43.global")
def _reads_a_global(x: torch.Tensor) -> torch.Tensor:
    return x + _TABLE


@eager_on_graph(name="r43.default")
def _default_tensor(x: torch.Tensor, bias: torch.Tensor = _TABLE) -> torch.Tensor:
    return x * bias


def _reads_tensors_it_does_not_take(x: torch.Tensor) -> torch.Tensor:
    return _default_tensor(_reads_a_global(x.cos())).sin()


def test_a_break_reading_a_tensor_it_does_not_take_compiles_with_inductor() -> None:
    # Inductor re-runs the graph on fake tensors in a mode that refused real ones: the break's
    # fake run met the module-level table ("Please convert all Tensors to FakeTensors first"),
    # and the compile failed (aot_eager, with dynamo's mode, compiled).
    torch._dynamo.reset()
    compiled = torch.compile(_reads_tensors_it_does_not_take, backend="inductor", fullgraph=True)
    runner = BreakableGraphRunner(compiled, device="cpu")
    with runner.warmup():
        runner(torch.randn(4, 3))
    for _ in range(2):
        x = torch.randn(4, 3)
        # A CPU capture runs the compiled code eagerly: aten's sin, not inductor's.
        torch.testing.assert_close(runner(x), compiled(x))
        assert torch.equal(runner(x), _reads_tensors_it_does_not_take(x))
    assert runner.stats.captures == 1
