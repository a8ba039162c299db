"""The divergence check as a new user meets it: no false alarm on adapter breaks, every tensor
the step writes compared, blame that does not move with the tolerance, state the step keeps in
itself named, nothing compared refused, and the run that raised named. Scenarios with the
``device`` fixture run on the CPU graph backend and, on a GPU, on CUDA graphs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import bcg_core
from bcg_core import BreakableGraphRunner, check_divergence, eager_on_graph
from bcg_core._capture.streams import hooks_installed  # noqa: PLC2701


@eager_on_graph(name="amplify")
def amplify(h: torch.Tensor) -> torch.Tensor:
    return h * 100


@eager_on_graph(name="double")
def double(h: torch.Tensor) -> torch.Tensor:
    return h * 2


def _x(seed: int, *shape: int) -> torch.Tensor:
    # A generator on the test's device: on CUDA, randn refuses a CPU generator.
    gen = torch.Generator(torch.get_default_device()).manual_seed(seed)
    return torch.randn(shape or (2, 4), generator=gen)


# -- a result written into an argument ----------------------------------------------------------


def test_a_result_written_into_an_argument_is_compared(device: str) -> None:
    lin = torch.nn.Linear(4, 4)

    def step(x: torch.Tensor, out: torch.Tensor, k: float) -> None:
        out.copy_(lin(x) * k)  # k is baked into the segment at capture

    with torch.no_grad():
        sets = [(_x(i), torch.zeros(2, 4), float(i + 1)) for i in range(3)]
        report = check_divergence(step, sets)
    assert report.status == "diverged", str(report)
    assert report.observed_at == "the arguments the step wrote"
    assert report.segment == 1 and report.cause == "baked_in_segment"
    assert [d.path for d in report.diffs] == ["args[1]"]
    with torch.no_grad():
        fixed = [(_x(i), torch.zeros(2, 4), 2.0) for i in range(3)]
        assert check_divergence(step, fixed).ok


# -- blame in execution order, whatever the tolerance -------------------------------------------


def test_blame_is_where_replay_first_differs_whatever_the_tolerance(device: str) -> None:
    def step(x: torch.Tensor, k: float) -> torch.Tensor:
        return amplify(x + 1e-4 * k)  # a tiny baked value that the break multiplies by 100

    sets = [(_x(0), float(k)) for k in range(3)]
    for atol in (1e-3, 0.0):
        report = check_divergence(step, sets, atol=atol)
        assert report.status == "diverged", str(report)
        assert (report.segment, report.break_after) == (1, "amplify"), str(report)
        assert report.cause == "baked_in_segment"
        assert report.observed_at is not None
        assert report.observed_at.startswith("the arguments of break 'amplify' (call 1)")
        assert report.diffs[0].path == "args[0]"
        beyond = "(within atol/rtol there; beyond them at the outputs of break 'amplify'"
        assert (beyond in report.observed_at) == (atol > 0)
    assert check_divergence(step, sets, atol=1.0).ok  # within the tolerance everywhere


# -- state the step keeps in itself -------------------------------------------------------------


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        return double(self.lin(x) * self.step)


def test_a_python_counter_in_a_module_is_named(device: str) -> None:
    for atol in (0.0, 1e-3):
        with torch.no_grad():
            report = check_divergence(Counter(), [_x(i) for i in range(3)], atol=atol)
        assert report.status == "stateful", str(report)
        assert report.cause == "step_attribute"
        assert [d.path for d in report.diffs] == ["Counter.step"]
        assert report.diffs[0].detail == "2 before, 3 after"  # warm-up and capture ran first
        text = str(report)
        assert "THE STEP CHANGES ITS OWN STATE" in text and "self.step.add_(1)" in text
        assert "eager vs replay" not in text


class Submodule(torch.nn.Module):
    """The counter sits in a submodule the step calls, which the check finds by calling it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_counter_in_a_called_submodule_and_through_the_runner(device: str) -> None:
    model = Submodule()
    with torch.no_grad():
        assert check_divergence(lambda x: model(x), [_x(0), _x(1)]).cause == "step_attribute"
        runner = BreakableGraphRunner(model, device=device)
        runner.capture(_x(0))
        report = runner.check_divergence(_x(1))
    assert report.status == "stateful" and report.diffs[0].path == "Counter.step"


class PrivateNoise(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return double(x + torch.randn(x.shape, generator=self.gen, device=x.device))


def test_a_private_generator_is_named_with_its_fix() -> None:
    # CPU only: a CUDA capture refuses random ops on a generator the graph was not given.
    report = check_divergence(PrivateNoise(), [_x(i) for i in range(3)])
    assert report.status == "stateful", str(report)
    assert report.cause == "private_generator"
    assert [d.path for d in report.diffs] == ["PrivateNoise.gen"]
    assert "default generator" in str(report) and "deterministic algorithms" not in str(report)
    gen = torch.Generator().manual_seed(1)

    def closure(x: torch.Tensor) -> torch.Tensor:
        return double(x + torch.randn(x.shape, generator=gen, device=x.device))

    report = check_divergence(closure, [_x(i) for i in range(3)])
    assert report.cause == "private_generator" and "(closure).gen" in report.diffs[0].path


def test_two_eager_runs_that_differ_are_headed_as_such(device: str) -> None:
    state = torch.zeros(())

    def step(x: torch.Tensor) -> torch.Tensor:
        state.add_(1)  # tensor state the step advances: a replay advances it too
        return double(x * state)

    report = check_divergence(step, [_x(i) for i in range(3)])
    assert report.status == "nondeterministic", str(report)
    text = str(report)
    assert "eager run 1 vs eager run 2" in text and "max |run 1 - run 2|" in text
    assert "eager vs replay" not in text and "zero-argument callable" in text

    def at_start(x: torch.Tensor) -> Any:
        return lambda: (state.fill_(3), x)[1]  # put the state back before every run

    assert check_divergence(step, [at_start(_x(i)) for i in range(3)]).ok


# -- nothing compared, and which run raised -----------------------------------------------------


@pytest.mark.parametrize("value", [None, 3.0, "hello"])
def test_nothing_compared_is_an_error(value: Any) -> None:
    with pytest.raises(ValueError, match="nothing to compare"):
        check_divergence(lambda x: value, [torch.ones(2), torch.zeros(2)])
    assert not bcg_core.is_breakable_capture_active() and not hooks_installed()


def test_an_unwritten_argument_is_not_something_compared() -> None:
    with pytest.raises(ValueError, match="nothing to compare"):
        check_divergence(lambda x, out: None, [(torch.ones(2), torch.ones(2))] * 2)


def _notes(exc: BaseException) -> list[str]:
    return list(getattr(exc, "__notes__", ()))


def test_every_failure_says_which_run_raised(caplog: pytest.LogCaptureFixture) -> None:
    def always(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        check_divergence(always, [torch.ones(2), torch.zeros(2)])
    assert "bcg divergence check: raised in the warm-up (an eager run) of input set 0" in _notes(
        info.value
    )
    assert bcg_core.BCG_FAILURE_HINT not in caplog.text  # no capture-failure banner

    calls = []

    def on_third_call(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:  # warm-up, capture, then eager run 1 of set 1
            raise RuntimeError("eager")
        return double(x)

    with pytest.raises(RuntimeError, match="eager") as info:
        check_divergence(on_third_call, [torch.ones(2), torch.zeros(2)])
    assert "bcg divergence check: raised in eager run 1 of input set 1" in _notes(info.value)

    @eager_on_graph(name="fails_at_replay")
    def fails_at_replay(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 5:  # warm-up, capture, two eager runs, then the replay
            raise RuntimeError("replay")
        return x * 2

    calls.clear()
    with pytest.raises(RuntimeError, match="replay") as info:
        check_divergence(lambda x: fails_at_replay(x), [torch.ones(2), torch.zeros(2)])
    assert "bcg divergence check: raised in the replay of input set 1" in _notes(info.value)
    assert not bcg_core.is_breakable_capture_active() and not hooks_installed()
