"""torch.compile with breaks that take ints which change per call (a position, a batch size,
``x.shape[0]`` under dynamic shapes), on the CPU: the op takes them as SymInt arguments, so the
frame compiles twice (static, then automatic dynamic), as the same code without a break does.
Before, each int was guarded to its value in the op's layout: every new value recompiled, and
``fullgraph=True`` hard-failed at the 9th value (``recompile_limit`` 8)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from bcg_core import BreakableGraphRunner, BreakOutputError, eager_on_graph


@eager_on_graph(name="r44.add_pos")
def _add_pos(x: torch.Tensor, pos: int) -> torch.Tensor:
    return x + pos


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_changing_int_argument_of_a_compiled_break_does_not_recompile(backend: str) -> None:
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(
        lambda x, pos: _add_pos(x * 2, pos) + 1, backend=counter, fullgraph=True
    )
    x = torch.randn(4)
    with torch.no_grad():
        for pos in range(12):  # failed at the 9th: FailOnRecompileLimitHit
            torch.testing.assert_close(compiled(x, pos), x * 2 + pos + 1, rtol=0, atol=0)
    assert counter.frame_count == 2


def test_a_changing_int_in_default_mode_stays_compiled() -> None:
    # Without fullgraph, dynamo ran the frame eagerly after 8 values, silently.
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x, pos: _add_pos(x.sin(), pos).cos(), backend=counter)
    x = torch.randn(4)
    with torch.no_grad():
        for pos in range(12):
            torch.testing.assert_close(compiled(x, pos), (x.sin() + pos).cos())
    assert counter.frame_count == 2


@eager_on_graph(name="r44.rows")
def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    return x[:n] * 2 + x.new_ones(n, 1) * n  # an output shape the int decides


def test_a_batch_size_passed_to_a_compiled_break_stays_dynamic() -> None:
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x: _rows(x, x.shape[0]) + 1, backend=counter, fullgraph=True)
    with torch.no_grad():
        for batch in range(2, 14):
            x = torch.randn(batch, 3)
            torch.testing.assert_close(compiled(x), x * 2 + batch + 1, rtol=0, atol=0)
    assert counter.frame_count == 2


@eager_on_graph(name="r44.write")
def _write(cache: torch.Tensor, x: torch.Tensor, pos: int) -> None:
    cache[pos] = x


def test_a_break_writing_at_a_changing_position_does_not_recompile() -> None:
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def step(cache: torch.Tensor, x: torch.Tensor, pos: int) -> torch.Tensor:
        _write(cache, x * 2, pos)
        return cache.sum(0)

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    cache, expected = torch.zeros(12, 3), torch.zeros(12, 3)
    with torch.no_grad():
        for pos in range(12):
            x = torch.randn(3)
            expected[pos] = x * 2
            torch.testing.assert_close(compiled(cache, x, pos), expected.sum(0))
    assert torch.equal(cache, expected)
    assert counter.frame_count == 2


@eager_on_graph(name="r44.twice")
def _twice(x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    return x + 1, n * 2


@eager_on_graph(name="r44.many")
def _many(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    return tuple(x * i for i in range(n))  # a structure the int decides: guarded, recompiles


def test_ints_a_break_returns_or_decides_its_structure_by_stay_right() -> None:
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def step(x: torch.Tensor, n: int) -> torch.Tensor:
        y, m = _twice(x, n)
        return y * m + sum(_many(x, n % 3 + 1))

    compiled = torch.compile(step, backend=counter)
    x = torch.randn(4)
    with torch.no_grad():
        for n in range(1, 12):
            expected = (x + 1) * (2 * n) + sum(x * i for i in range(n % 3 + 1))
            torch.testing.assert_close(compiled(x, n), expected)


@eager_on_graph(name="r44.strict")
def _strict(x: torch.Tensor, n: int) -> torch.Tensor:
    if type(n) is not int:
        raise TypeError("n must be an int")
    return x * n


def test_a_break_refusing_a_symbolic_int_gets_values_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Such a break was one op with the int's value before; it stays one (fullgraph=True), and
    # the log names the recompiles it costs.
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, n: _strict(x, n) + 1, backend="aot_eager", fullgraph=True)
    x = torch.randn(4)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="bcg_core"):
        for n in range(4):
            torch.testing.assert_close(compiled(x, n), x * n + 1)
    assert "every new value recompiles" in caplog.text and "r44.strict" in caplog.text


def test_a_runner_over_a_compiled_step_with_a_batch_size_break_compiles_twice() -> None:
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda x: _rows(x.sin(), x.shape[0]) * 2, backend=counter, fullgraph=True
    )
    batches = range(2, 14)
    runner = BreakableGraphRunner(compiled, device="cpu", max_entries=len(batches))
    with runner.warmup():
        for batch in batches:
            runner(torch.randn(batch, 3))
    hits = runner.stats.hits
    for batch in (*batches, 5, 2):
        x = torch.randn(batch, 3)
        assert torch.equal(runner(x), compiled(x))
        torch.testing.assert_close(runner(x), (x.sin() * 2 + batch) * 2)
    assert runner.stats.hits == hits + 2 * (len(batches) + 2) and runner.stats.misses == 0
    assert runner.stats.captures == len(batches) and runner.stats.failed_captures == 0
    assert counter.frame_count == 2


def test_a_runner_over_a_compiled_step_with_a_position_break_compiles_twice() -> None:
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda x, pos: _add_pos(x.sin(), pos) * 2, backend=counter, fullgraph=True
    )
    positions = range(12)
    runner = BreakableGraphRunner(compiled, device="cpu", max_entries=len(positions))
    with runner.warmup():
        for pos in positions:  # a signature each (a constant of it)
            runner(torch.randn(4), pos)
    for pos in (*positions, 3):
        x = torch.randn(4)
        assert torch.equal(runner(x, pos), compiled(x, pos))
        torch.testing.assert_close(runner(x, pos), (x.sin() + pos) * 2)
    assert runner.stats.captures == len(positions) and runner.stats.misses == 0
    assert counter.frame_count == 2


def _short_stub(x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    return x.new_empty(n), n


@eager_on_graph(name="r44.longer", capture_stub=_short_stub)
def _longer(x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    return x.new_ones(n + 1), n  # one more than its stub says


@eager_on_graph(name="r44.more", capture_stub=lambda x, n: (x.new_empty(n), n))
def _more(x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    return x.new_ones(n), n + 1


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_size_an_int_decides_is_still_checked_against_the_stub(backend: str) -> None:
    # With the int symbolic, the traced size was unchecked: aot_eager went on with the longer
    # tensor and inductor failed with a raw assertion ("expected size 6==5").
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, n: _longer(x, n)[0] * 2, backend=backend, fullgraph=True)
    x = torch.randn(3)
    for n in range(2, 5):
        with pytest.raises(BreakOutputError, match=rf"shape \({n + 1},\).*shape \({n},\)"):
            compiled(x, n)


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_an_int_a_break_returns_is_still_checked_against_the_stub(backend: str) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x, n: _more(x, n)[0].sum() + _more(x, n)[1], backend=backend, fullgraph=True
    )
    x = torch.randn(3)
    for n in range(2, 5):
        with pytest.raises(BreakOutputError, match=f"returned {n + 1} at run time"):
            compiled(x, n)


@eager_on_graph(name="r44.longer_rows", capture_stub=lambda x: x.new_empty(x.shape[0]))
def _longer_rows(x: torch.Tensor) -> torch.Tensor:
    return x.new_ones(x.shape[0] + 1)


def test_a_size_a_dynamic_shape_decides_is_checked_against_the_stub() -> None:
    # Under dynamic shapes the traced size was symbolic and never checked (aot_eager went on
    # with the longer tensor, silently).
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: _longer_rows(x) * 2, backend="aot_eager", dynamic=True)
    with pytest.raises(BreakOutputError, match=r"shape \(6,\).*shape \(5,\)"):
        compiled(torch.randn(5, 2))


def test_a_symbolic_number_is_a_leaf_not_walked() -> None:
    # Walked by its attributes, a SymInt a compiled break's fake run returned reached the whole
    # shape environment: the dry run's grad check took a minute per traced call under pytest.
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from bcg_core._trees import flatten  # noqa: PLC2701

    n = ShapeEnv().create_unbacked_symint()
    leaves, _ = flatten((n, torch.ones(1)))
    assert len(leaves) == 2 and leaves[0] is n
