"""Holes found by a randomized differential fuzzer on the CPU graph backend: random step
programs (views, in-place ops, casts, reductions, breaks returning new tensors, views, tuples,
dicts, None or their written argument) run eagerly, through a hand capture and through
``BreakableGraphRunner``, compared bitwise over replays with fresh input values. A small seeded
run of the fuzzer is kept here, with the minimized regressions."""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    break_graph,
    eager_on_graph,
    enable_breakable_cuda_graph,
)

# -- minimized regressions -------------------------------------------------------------------


def _write_first(x: torch.Tensor) -> torch.Tensor:
    x[0].add_(1)  # x expanded: its one element is seen at every position
    return x * 2


def test_an_expanded_argument_the_graph_writes_runs_eagerly() -> None:
    runner = BreakableGraphRunner(_write_first, device="cpu")
    runner.capture(torch.zeros(2))
    x = torch.zeros(1).expand(2)
    out = runner(x)  # raised torch's raw "more than one element of the written-to tensor"
    ref = torch.zeros(1).expand(2)
    assert torch.equal(out, _write_first(ref))
    assert torch.equal(x, ref)
    assert runner.stats.misses == 1
    # Dense arguments still replay.
    y = torch.zeros(2)
    assert torch.equal(runner(y), torch.tensor([2.0, 0.0]))
    assert runner.stats.hits == 1


def test_an_expanded_argument_the_capture_writes_is_served_eagerly() -> None:
    runner = BreakableGraphRunner(_write_first, device="cpu")
    x = torch.zeros(1).expand(2)
    out = runner.capture(x)  # raised the same raw error after the capture
    ref = torch.zeros(1).expand(2)
    assert torch.equal(out, _write_first(ref))
    assert torch.equal(x, ref)
    assert runner.stats.captures == 0
    y = torch.zeros(2)
    runner.capture(y)  # the signature is not blocked: dense tensors capture
    assert runner.stats.captures == 1


@eager_on_graph
def _and_its_tail(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x + 1
    return y, y[1:]  # empty for one row


def test_a_break_returning_an_empty_view_of_its_output_replays() -> None:
    x = torch.zeros(1, 3)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        y, tail = _and_its_tail(x)
        out = y * 2
    x.fill_(5)
    graph.replay()  # raised BreakOutputError: the empty view's data_ptr() is 0
    assert torch.equal(out, torch.full((1, 3), 12.0))
    assert tail.shape == (0, 3)


def _set_through_reshape(x: torch.Tensor) -> torch.Tensor:
    x.reshape(-1)[..., :1] = 7
    return x + 1


def test_an_argument_written_through_a_reshape_in_inference_mode_is_copied_back() -> None:
    with torch.inference_mode():
        runner = BreakableGraphRunner(_set_through_reshape, device="cpu")
        runner.capture(torch.zeros(2))
        x = torch.zeros(2)
        out = runner(x)
    assert runner.stats.hits == 1
    assert torch.equal(out, torch.tensor([8.0, 1.0]))
    assert torch.equal(x, torch.tensor([7.0, 0.0]))  # was left [0, 0]: the write was not seen


def test_a_write_through_a_reshape_in_inference_mode_bumps_the_version() -> None:
    with torch.inference_mode(False):
        s = torch.zeros(2)
    with torch.inference_mode():
        graph = BreakableCUDAGraph(backend="cpu")
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            before = s._version
            _set_through_reshape(s)
        assert s._version != before  # as on CUDA, where no dispatch mode records the ops


def _write_twice(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float32)  # x itself (aten.to of its own dtype): no new view
    x.add_(1)
    x.mul_(2)
    return x.reshape(-1)[:1] * 1


def test_a_tensor_returned_as_itself_then_written_in_inference_mode_captures() -> None:
    # The alias note took an op's output that is its operand itself (`.to()` of its own
    # dtype) for a view of it, and the next write followed that cycle of one for
    # ever: a transformers decode captured in inference mode hung the CPU suite.
    with torch.inference_mode():
        runner = BreakableGraphRunner(_write_twice, device="cpu", warmup_iters=1)
        runner.capture(torch.zeros(2))
        x = torch.ones(2)
        out = runner(x)
    assert runner.stats.hits == 1
    assert torch.equal(x, torch.tensor([4.0, 4.0])) and torch.equal(out, torch.tensor([4.0]))


def test_a_vector_matmul_in_inference_mode_captures_without_a_warning() -> None:
    v, m = torch.randn(4), torch.randn(4, 3)
    graph = BreakableCUDAGraph(backend="cpu")
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "output ... was resized" (eager warns nothing)
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            out = v @ m
        v.copy_(torch.randn(4))
        graph.replay()
    assert torch.equal(out, v @ m)


# -- the seeded differential fuzzer ----------------------------------------------------------

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool)
_MODES: dict[str, Callable[[], Any]] = {
    "grad": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference": torch.inference_mode,
}


def _values(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.int64:
        return torch.randint(-4, 5, shape, generator=g)
    return torch.randint(0, 2, shape, generator=g).bool()


def _changed(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    return y.logical_not_() if y.dtype == torch.bool else y.add_(1)


def _write(x: torch.Tensor) -> torch.Tensor:
    return x.logical_not_() if x.dtype == torch.bool else x.mul_(2)


# What a break returns: a new tensor, a view of its argument, a tuple, a dict in another key
# order, None after writing its argument, its written argument, views of one output.
_BREAKS: dict[str, Callable[..., Any]] = {
    "new": _changed,
    "view": lambda x: x.view(x.shape) if x.dim() < 2 else x.transpose(0, 1),
    "tuple": lambda x: (_changed(x), x),
    "dict": lambda x: {"b": x[...], "a": _changed(x)},
    "none": lambda x: _write(x) and None,
    "written": _write,
    "views": lambda x: (lambda y: (y, y[1:]))(_changed(x)),
    "two": lambda x, y: x + y,
}

_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor, int], Any]] = {
    "matmul": lambda a, b, p: a @ b,
    "add": lambda a, b, p: a + b,
    "mul": lambda a, b, p: a * b,
    "add_": lambda a, b, p: a.add_(b),
    "mul_": lambda a, b, p: a.mul_(b),
    "copy_": lambda a, b, p: a.copy_(b),
    "index_select": lambda a, b, p: a.index_select(
        p % a.dim(), torch.tensor([i % a.shape[p % a.dim()] for i in range(1 + p % 3)])
    ),
    "transpose": lambda a, b, p: a.transpose(0, -1),
    "narrow": lambda a, b, p: a.narrow(p % a.dim(), 0, max(1, a.shape[p % a.dim()] - 1)),
    "reshape": lambda a, b, p: a.reshape(-1),
    "cat": lambda a, b, p: torch.cat([a, b], dim=p % a.dim()),
    "where": lambda a, b, p: torch.where(a > 0 if a.dtype != torch.bool else a, b, b),
    "softmax": lambda a, b, p: torch.softmax(a, dim=-1),
    "sum": lambda a, b, p: a.sum(dim=p % a.dim()),
    "amax": lambda a, b, p: a.amax(dim=-1),
    "argmax": lambda a, b, p: a.argmax(dim=-1),
    "mean": lambda a, b, p: a.mean(),
    "cast": lambda a, b, p: a.to(_DTYPES[p % len(_DTYPES)]),
    "select": lambda a, b, p: a[p % a.shape[0]] if a.dim() >= 2 else a[:1],
    "set_slice": lambda a, b, p: a.reshape(-1)[:1].copy_(b.reshape(-1)[:1]),
    "masked_fill": lambda a, b, p: a.masked_fill(b > 0 if b.dtype != torch.bool else b, 1),
}

_Program = tuple[list[tuple[tuple[int, ...], torch.dtype, bool]], list[Any], list[int], str]


def _layout(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``t``, or (``transposed``, two dimensions or more) a transposed tensor of its shape."""
    return t.transpose(0, 1).contiguous().transpose(0, 1) if transposed and t.dim() >= 2 else t


def _step(step: Any, regs: list[torch.Tensor]) -> None:
    if step[0] == "split":
        break_graph()
    elif step[0] == "op":
        regs.append(_OPS[step[1]](regs[step[2]], regs[step[3]], step[4]))
    else:
        out = step[1](*[regs[i] for i in step[2]])
        if isinstance(out, torch.Tensor):
            regs.append(out)
        elif isinstance(out, tuple):
            regs.extend(out)
        elif isinstance(out, dict):
            regs.extend([out["a"], out["b"]])


def _run(program: _Program, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    regs = list(inputs)
    for step in program[1]:
        _step(step, regs)
    return tuple(regs[i] for i in program[2])


def _generate(seed: int) -> _Program:
    """A random program: inputs (shape, dtype, transposed), steps, the outputs, a grad mode.
    Each step is drawn until it runs on sample inputs (shapes and dtypes are what matter)."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dims = [rnd.choice([1, 2, 3, 4]) for _ in range(3)]
    shapes = [
        (tuple(dims[: rnd.choice([1, 2, 2, 3])]), rnd.choice(_DTYPES), rnd.random() < 0.2)
        for _ in range(rnd.randint(1, 3))
    ]
    regs = [_layout(_values(g, s, d), t) for s, d, t in shapes]
    steps: list[Any] = []
    n = rnd.randint(2, 9)
    breaks = set(rnd.sample(range(n + 3), rnd.randint(0, 3)))
    for k in range(n + 3):
        for _ in range(8):
            step: Any
            if k in breaks:
                kind = rnd.choice([*_BREAKS, "split"])
                args = [rnd.randrange(len(regs)) for _ in range(2 if kind == "two" else 1)]
                step = (
                    ("split",)
                    if kind == "split"
                    else ("break", eager_on_graph(_BREAKS[kind]), args)
                )
            else:
                name = rnd.choice(list(_OPS))
                step = (
                    "op",
                    name,
                    rnd.randrange(len(regs)),
                    rnd.randrange(len(regs)),
                    rnd.randint(0, 5),
                )
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _step(step, regs)
            except (RuntimeError, IndexError, ZeroDivisionError):
                continue
            steps.append(step)
            break
    outs = sorted(rnd.sample(range(len(shapes), len(regs)), min(3, len(regs) - len(shapes))))
    return shapes, steps, outs, rnd.choice(list(_MODES))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaN equal to NaN), same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _named_differences(where: str, outputs: tuple[Any, Any], inputs: tuple[Any, Any]) -> list[str]:
    """The outputs and inputs (got, want) that differ, named."""
    return [
        f"{where}: {kind} {k}"
        for kind, (got, want) in (("output", outputs), ("input", inputs))
        for k, (a, b) in enumerate(zip(got, want, strict=True))
        if not _same(a, b)
    ]


def _differences(program: _Program, seed: int, replays: int = 3) -> list[str]:
    """Where a hand capture's replays and a runner's calls differ from eager, for fresh input
    values each replay: every output and every input (written ones included)."""
    shapes = program[0]
    g = torch.Generator().manual_seed(seed + 1)

    def fresh() -> list[torch.Tensor]:
        return [_layout(_values(g, s, d), t) for s, d, t in shapes]

    def eager(values: list[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
        inputs = [_layout(v.clone(), t) for v, (_, _, t) in zip(values, shapes, strict=True)]
        return _run(program, inputs), inputs

    found = []
    statics = fresh()
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = _run(program, statics)
    for r in range(replays):
        values = fresh()
        for s, v in zip(statics, values, strict=True):
            s.copy_(v)
        graph.replay()
        want, inputs = eager(values)
        found += _named_differences(f"hand replay {r}", (out, want), (statics, inputs))
    runner = BreakableGraphRunner(lambda *xs: _run(program, list(xs)), device="cpu")
    runner.capture(*fresh())
    for r in range(replays):
        values = fresh()
        want, inputs = eager(values)
        got = runner(*values)
        found += _named_differences(f"runner call {r}", (got, want), (values, inputs))
    if runner.stats.hits != replays:
        found.append(f"runner: {runner.stats}")
    return found


@pytest.mark.parametrize("chunk", range(4))
def test_random_programs_replay_as_eager_runs(chunk: int) -> None:
    """Random programs (views, in-place ops, casts, reductions, breaks of every kind) replay
    bitwise as eager, by hand and through a runner, in grad, no_grad and inference mode."""
    failures = {}
    for seed in range(chunk * 25, chunk * 25 + 25):
        program = _generate(seed)
        with _MODES[program[3]]():
            found = _differences(program, seed)
        if found:
            failures[seed] = found[:3]
    assert not failures
