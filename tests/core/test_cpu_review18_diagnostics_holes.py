"""Holes a second review of the diagnostics (check_divergence and its report, signatures and
describe_difference, the ``bcg`` command) found on the CPU backend: each was a wrong or unclear
report, or a raw error, and is now right or said clearly."""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bcg_core import (
    BCG_FAILURE_HINT,
    BreakableGraphRunner,
    CaptureError,
    check_divergence,
    describe_difference,
    disable_breakable_graphs,
    eager_on_graph,
    signature_of,
)
from bcg_core.bench import main


@eager_on_graph
def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    return _plus_one(x) * scale  # the scale is baked into the segment after the break


def test_max_abs_diff_is_true_where_values_are_infinite_or_nan() -> None:
    # nan_to_num turned an infinite gap into the largest float (1.798e+308), and an infinity
    # equal on both sides (inf - inf is NaN) into an infinite gap.
    x = torch.tensor([1.0, math.inf])
    report = check_divergence(_scaled, [(x, 1.0), (x, 2.0)], backend="cpu")
    assert report.status == "diverged"
    (diff,) = report.diffs
    assert diff.max_abs_diff == 2.0  # eager [4, inf], replay [2, inf]
    assert "= 2" in diff.detail

    x = torch.tensor([1.0, -1.0])
    report = check_divergence(_scaled, [(x, 1.0), (x, math.nan)], backend="cpu")
    (diff,) = report.diffs  # eager NaN, replay a number: inf, as TensorDiff documents
    assert diff.max_abs_diff == math.inf
    assert "= inf" in diff.detail
    with_tolerance = check_divergence(_scaled, [(x, 1.0), (x, math.nan)], backend="cpu", atol=0.1)
    assert with_tolerance.diffs[0].max_abs_diff == math.inf

    y = torch.tensor([1.0, 2.0])
    report = check_divergence(_scaled, [(y, 1.0), (y, math.inf)], backend="cpu")
    assert report.diffs[0].max_abs_diff == math.inf  # eager inf, replay a number


def test_a_nan_argument_replays_the_graph_captured_for_a_nan() -> None:
    # NaN is unequal to itself and hashed by identity: a call given a NaN made anew (a NaN
    # read from a config, float("nan")) never matched the signature captured for one, ran
    # eagerly at every call and logged "args[1]: nan (captured: nan)".
    def nan() -> float:
        return float("nan")

    assert signature_of((nan(),), {}) == signature_of((nan(),), {})
    assert hash(signature_of(([nan()],), {})) == hash(signature_of(([nan()],), {}))  # walked
    assert signature_of((complex(nan(), 1),), {}) == signature_of((complex(nan(), 1),), {})
    assert signature_of((nan(),), {}) != signature_of((-nan(),), {})  # copysign tells them apart
    assert signature_of((nan(),), {}) != signature_of((1.0,), {})

    runner = BreakableGraphRunner(_scaled, device="cpu", warmup_iters=0)
    x = torch.ones(2)
    runner.capture(x, nan())
    out = runner(x, nan())
    assert runner.stats.hits == 1 and runner.stats.misses == 0
    assert bool(out.isnan().all())
    assert runner.check_divergence(x, nan()).ok


def test_describe_difference_of_a_call_of_many_tensors_stays_short() -> None:
    # Every differing field was listed: 200 tensors of other shapes made a 17,000-character
    # line, logged at every new miss.
    sig = signature_of(tuple(torch.ones(i + 1) for i in range(200)), {})
    captured = signature_of(tuple(torch.ones(i + 2) for i in range(200)), {})
    text = describe_difference(sig, [captured])
    assert len(text) < 1000
    assert text.startswith("args[0]: tensor[1] torch.float32 on cpu (captured: tensor[2]")
    assert text.endswith("... and 192 more")
    few = describe_difference(signature_of((1, 2), {}), [signature_of((3, 4), {})])
    assert few == "args[0]: 1 (captured: 3); args[1]: 2 (captured: 4)"


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ('raise RuntimeError("boom at import")\n', ["raised RuntimeError: boom at import", ":1"]),
        ("def f(:\n", ["raised SyntaxError", "line 1"]),
        ("import no_such_dependency_zz\n", ["No module named 'no_such_dependency_zz'", ":1"]),
    ],
)
@pytest.mark.parametrize("as_file", [True, False])
def test_check_a_target_that_raises_on_import_gets_one_line_and_exit_code_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    source: str,
    words: list[str],
    as_file: bool,
) -> None:
    # A file target raising on import gave a traceback and exit status 1 ("the check failed"),
    # leaving its half-made module in sys.modules; a module target whose own import lacked a
    # dependency was "no module 'target'".
    name = f"broken_target_{abs(hash(source)) % 10**8}_{as_file}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = set(sys.modules)
    target = f"{tmp_path / name}.py:f" if as_file else f"{name}:f"
    assert main(["check", target]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"bcg check: importing {tmp_path / name if as_file else name}")
    assert "no module" not in line
    for word in words:
        assert word in line, line
    assert set(sys.modules) <= modules | {"no_such_dependency_zz"}


@pytest.mark.parametrize("how", ["env", "context"])
def test_check_divergence_where_graphs_are_disabled_refuses_before_running(
    how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # It ran the step's warm-up, then the capture refused and logged BCG_FAILURE_HINT, whose
    # advice is to set the BCG_DISABLE=1 that refused it.
    calls: list[float] = []

    def step(x: torch.Tensor, scale: float) -> torch.Tensor:
        calls.append(scale)
        return _scaled(x, scale)

    sets = [(torch.ones(2), 1.0), (torch.ones(2), 2.0)]
    if how == "env":
        monkeypatch.setenv("BCG_DISABLE", "1")
        disabled: Any = contextlib.nullcontext()
    else:
        disabled = disable_breakable_graphs()
    with disabled, pytest.raises(CaptureError) as info:
        check_divergence(step, sets, backend="cpu")
    assert "breakable graphs are disabled" in str(info.value)
    assert ("BCG_DISABLE=1 is set" if how == "env" else "disable_breakable_graphs()") in str(
        info.value
    )
    assert calls == []
    assert BCG_FAILURE_HINT not in caplog.text


@eager_on_graph
def _next_and_total(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    return x + 1, x.sum().item()  # the float is frozen at capture


def test_a_frozen_break_output_is_the_only_difference_named() -> None:
    # The bridge refuses the changed float before it copies the break's tensors, so the check
    # read the stale capture-time tensor and also reported output[0] as differing by 1,
    # though the break computed it right.
    def step(x: torch.Tensor) -> torch.Tensor:
        y, total = _next_and_total(x)
        return y * total

    report = check_divergence(step, [torch.ones(2), torch.full((2,), 2.0)], backend="cpu")
    assert report.status == "diverged" and report.cause == "frozen_break_output"
    assert report.observed_at == "the outputs of break '_next_and_total' (call 1)"
    (diff,) = report.diffs
    assert (diff.path, diff.shape, diff.max_abs_diff) == ("output[1]", None, None)
    assert diff.detail == "eager 4.0, replay 2.0 (frozen at capture)"
    assert "output[0]" not in str(report)


HOST_SYNC_BUILDER = """
import torch

def make_check():
    def step(x):
        return x * x.sum().item()  # a host sync at line 6

    return step, [torch.ones(2), torch.zeros(2)]
"""


def test_check_divergence_of_a_step_that_cannot_capture_reports_the_host_sync(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The plain check named the host sync and its line; with --divergence the same step gave
    # HostSyncError's traceback.
    path = tmp_path / "sync_builder.py"
    path.write_text(HOST_SYNC_BUILDER)
    assert main(["check", f"{path}:make_check", "--divergence"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{path}:make_check: host synchronisation inside a graph segment: ")
    assert "aten._local_scalar_dense.default" in out and "sync_builder.py:6" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path of bench --smoke")
def test_bench_says_when_a_skip_matches_no_contender(capsys: pytest.CaptureFixture[str]) -> None:
    # A misspelt --skip ("bgc") left the bcg contender in without a word, and so did one
    # naming eager (the baseline, always timed).
    argv = ["bench", "--smoke", "break-overhead", "--skip", "bgc", "--skip", "eager"]
    assert main([*argv, "--skip", "full_graph"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if "--skip" in line]
    assert lines == [
        "bcg bench: --skip bgc, eager left out no contender of these workloads (timed: bcg, eager)"
    ]  # full_graph is left out (it needs CUDA here)
    assert main(["bench", "--smoke", "break-overhead", "--skip", "bcg"]) == 0
    captured = capsys.readouterr()
    assert "excluded by --skip" in captured.out and "--skip" not in captured.err


def test_max_abs_diff_of_large_integers_is_exact() -> None:
    # Integers were compared as doubles, which drop the low bits of a large int64: a diverged
    # report said "max |eager - replay| = 0".
    def ids(x: torch.Tensor, scale: int) -> torch.Tensor:
        return (_plus_one(x) * scale).long() + 2**60

    report = check_divergence(ids, [(torch.ones(3), 1), (torch.ones(3), 2)], backend="cpu")
    assert report.status == "diverged"
    (diff,) = report.diffs
    assert diff.max_abs_diff == 2.0 and diff.detail == "max |eager - replay| = 2"
    flags = check_divergence(
        lambda x, n: _plus_one(x) > n, [(torch.ones(3), 1.0), (torch.ones(3), 3.0)], backend="cpu"
    )
    assert flags.diffs[0].max_abs_diff == 1.0  # bool: True against False


def test_describe_difference_of_a_captured_signature_says_so() -> None:
    # It returned "", which a log line showed as a miss without a reason.
    sig = signature_of((torch.ones(2), 3), {"mask": None})
    other = signature_of((torch.ones(4), 3), {"mask": None})
    assert describe_difference(sig, [other, sig]) == (
        "no field differs: a captured signature is this one"
    )


BAD_SETS_BUILDER = """
import torch

def shapes():
    return (lambda x: x * 2), [torch.ones(2), torch.ones(3)]

def one_set():
    return (lambda x: x * 2), [torch.ones(2)]

def nothing():
    return (lambda x: None), [torch.ones(2), torch.ones(2)]

def step_raises():
    def step(x):
        raise ValueError("the step's own error")

    return step, [torch.ones(2), torch.ones(2)]
"""


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("shapes", ["input set 1: args[0] is a tensor [3]"]),
        ("one_set", ["at least two input sets"]),
        ("nothing", ["nothing to compare"]),
    ],
)
def test_check_divergence_of_sets_the_check_refuses_is_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, words: list[str]
) -> None:
    # The builder's sets were refused with check_divergence's ValueError traceback and exit
    # code 1, which says the check ran and failed.
    path = tmp_path / "bad_sets.py"
    path.write_text(BAD_SETS_BUILDER)
    assert main(["check", f"{path}:{name}", "--divergence"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"bcg check: {path}:{name}: check_divergence refused its (fn, sets): ")
    for word in words:
        assert word in line, line


def test_check_divergence_lets_the_steps_own_error_raise(tmp_path: Path) -> None:
    path = tmp_path / "bad_sets.py"
    path.write_text(BAD_SETS_BUILDER)
    with pytest.raises(ValueError, match="the step's own error") as info:
        main(["check", f"{path}:step_raises", "--divergence"])
    assert info.value.__notes__[-1].startswith("bcg divergence check: raised in the warm-up")


def test_max_abs_diff_of_complex_values_is_their_distance() -> None:
    # The real and imaginary parts were compared one by one: eager 2+2j against replay 1+1j
    # was "max |eager - replay| = 1", not |1+1j| = 1.414.
    def rotor(x: torch.Tensor, scale: float) -> torch.Tensor:
        y = _plus_one(x)
        return torch.complex(y, y) * scale

    report = check_divergence(rotor, [(torch.zeros(2), 1.0), (torch.zeros(2), 2.0)], backend="cpu")
    (diff,) = report.diffs
    assert diff.max_abs_diff == pytest.approx(math.sqrt(2))
    assert diff.detail == "max |eager - replay| = 1.414"


def test_runner_stats_of_a_call_of_many_tensors_stay_short() -> None:
    # EntryStats' repr held the raw signature: 13,000 characters for a call of 200 tensors.
    def double_all(*xs: torch.Tensor) -> list[torch.Tensor]:
        return [x * 2 for x in xs]

    runner = BreakableGraphRunner(double_all, device="cpu", warmup_iters=0)
    runner.capture(*[torch.ones(2) for _ in range(200)])
    text = repr(runner.stats)
    assert len(text) < 1500
    (entry,) = runner.stats.entries
    assert repr(entry).startswith(
        "EntryStats(signature=<args[0]: tensor[2] torch.float32 on cpu, args[1]: "
    )
    assert "... and 192 more>, segments=1, breaks=0, pool_bytes=None, replays=0" in repr(entry)
