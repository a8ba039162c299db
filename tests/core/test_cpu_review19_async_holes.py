"""Holes a review of bcg under asyncio, context variables and hook lifecycles found on the CPU
backend (what an async serving engine does): each was a silently wrong value, a raw error or
state left behind, and is now right or refused clearly."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    CaptureError,
    breakable_graphs_disabled,
    disable_breakable_graphs,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
    is_in_breakable_cuda_graph,
)


@eager_on_graph
def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _clean() -> bool:
    return (
        not is_breakable_capture_active()
        and not is_in_breakable_cuda_graph()
        and torch._C._len_torch_dispatch_stack() == 0
    )


def test_another_task_running_while_a_capture_awaits_is_refused() -> None:
    # The CPU backend's recorder sits on the thread's dispatch-mode stack, which every asyncio
    # task of the loop shares: a task that ran while the capturing task awaited inside a
    # segment had its ops recorded into that graph, and each replay then rewrote the other
    # task's tensors (its y * 10 + 1 became 51 after a replay with y = 5).
    y = torch.ones(3)
    other_result: list[torch.Tensor] = []

    async def other() -> None:
        other_result.append(y * 10 + 1)

    other_error: list[BaseException | None] = []

    async def capture() -> None:
        graph = BreakableCUDAGraph(backend="cpu")
        x = torch.ones(3)
        task = asyncio.ensure_future(other())
        try:
            with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
                z = x * 2
                await asyncio.sleep(0)  # the other task runs here, inside the open segment
                _plus_one(z) * 3
        finally:
            await asyncio.wait([task])
            other_error.append(task.exception())

    with pytest.raises(CaptureError, match=r"capture invalidated.*another context"):
        asyncio.run(capture())
    assert _clean() and isinstance(other_error[0], CaptureError)
    # The other task was told, and nothing of it was recorded (its tensor is its own).
    y.fill_(5)
    assert not other_result


def test_the_other_task_gets_the_error_too() -> None:
    async def other() -> torch.Tensor:
        return torch.ones(2) * 3

    async def capture() -> BaseException | None:
        graph = BreakableCUDAGraph(backend="cpu")
        task = asyncio.ensure_future(other())
        with (
            pytest.raises(CaptureError),
            enable_breakable_cuda_graph(),
            BreakableCUDAGraphCapture(graph),
        ):
            torch.ones(2) * 2
            await asyncio.sleep(0)
        await asyncio.wait([task])
        return task.exception()

    error = asyncio.run(capture())
    assert isinstance(error, CaptureError) and "Do not await inside a capture" in str(error)
    assert _clean()


def _triple_of_plus_one(x: torch.Tensor) -> torch.Tensor:
    return _plus_one(x * 2) * 3


def test_a_capture_held_open_by_an_async_generator_closed_by_another_task() -> None:
    # An async generator that yields inside a capture block is closed by whoever finalises it
    # (another task, the loop's shutdown_asyncgens): leaving the block there raised a raw
    # ValueError ("<Token ...> was created in a different Context"), and the task that entered
    # it still saw the capture active for good, refusing every later capture as nested.
    async def steps(graph: BreakableCUDAGraph, x: torch.Tensor) -> Any:
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            yield _triple_of_plus_one(x)

    async def main() -> torch.Tensor:
        x = torch.ones(3)
        agen = steps(BreakableCUDAGraph(backend="cpu"), x)
        await agen.__anext__()
        await asyncio.create_task(agen.aclose())  # GeneratorExit: that capture fails
        assert not is_breakable_capture_active()
        graph = BreakableCUDAGraph(backend="cpu")
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            out = _triple_of_plus_one(x)
        x.fill_(2.0)
        graph.replay()
        return out

    assert torch.equal(asyncio.run(main()), _triple_of_plus_one(torch.full((3,), 2.0)))
    assert _clean()


def test_a_capture_left_in_another_context_than_it_was_entered_in() -> None:
    graph = BreakableCUDAGraph(backend="cpu")
    capture = BreakableCUDAGraphCapture(graph)
    x = torch.ones(3)
    entered = contextvars.copy_context()

    def enter() -> torch.Tensor:
        capture.__enter__()
        return _triple_of_plus_one(x)

    out = entered.run(enter)
    capture.__exit__(None, None, None)  # raised a raw ValueError
    assert _clean() and not entered.run(is_breakable_capture_active)
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(out, _triple_of_plus_one(x))


def test_a_task_made_inside_a_capture_running_while_it_awaits_is_refused() -> None:
    # A task made inside the capture block inherits the capture's context, so the context check
    # alone did not tell it apart: its ops were recorded into the capturing task's graph.
    y = torch.ones(3)

    async def other() -> torch.Tensor:
        return y * 10 + 1

    async def capture() -> BaseException | None:
        graph = BreakableCUDAGraph(backend="cpu")
        with (
            pytest.raises(CaptureError, match="another context"),
            enable_breakable_cuda_graph(),
            BreakableCUDAGraphCapture(graph),
        ):
            task = asyncio.create_task(other())
            await asyncio.sleep(0)
            _plus_one(torch.ones(3))
        await asyncio.wait([task])
        return task.exception()

    assert isinstance(asyncio.run(capture()), CaptureError)
    assert _clean()


def test_the_flag_blocks_as_decorators_cover_an_async_functions_body() -> None:
    # contextlib's decorator wrapped only the call, which makes the coroutine: the body ran
    # when awaited, outside the block, so @disable_breakable_graphs() over a request handler
    # disabled nothing (and @enable_breakable_cuda_graph() enabled nothing).
    @disable_breakable_graphs()
    async def disabled() -> bool:
        await asyncio.sleep(0)
        return breakable_graphs_disabled()

    @enable_breakable_cuda_graph()
    async def enabled() -> bool:
        await asyncio.sleep(0)
        return is_in_breakable_cuda_graph()

    @disable_breakable_graphs()
    def plain() -> bool:
        return breakable_graphs_disabled()

    assert asyncio.run(disabled()) and asyncio.run(enabled()) and plain()
    assert _clean() and not breakable_graphs_disabled()


def test_the_flag_blocks_refuse_to_decorate_a_generator_function() -> None:
    # A generator's body runs as it is iterated, after the decorated call returned: the block
    # did not cover it.
    def numbers() -> Any:
        yield is_in_breakable_cuda_graph()

    async def anumbers() -> Any:
        yield breakable_graphs_disabled()

    with pytest.raises(TypeError, match="generator function"):
        enable_breakable_cuda_graph()(numbers)
    with pytest.raises(TypeError, match="generator function"):
        disable_breakable_graphs()(anumbers)
