"""The bcg command on a machine without a GPU: check, bench --smoke, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bcg_core.bench import main
from bcg_core.bench._workloads import discover  # noqa: PLC2701

MODEL = """
import torch
from bcg_core import eager_on_graph

x = torch.randn(8)

@eager_on_graph
def scale(t):
    return t / (float(t.abs().max().item()) + 1.0)

def clean():
    return scale(x * 2) + 1

def syncs():
    y = x * 2
    if y.sum().item() > 1e9:  # the host sync
        y = y * 0
    return y
"""


@pytest.fixture()
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "user_model.py"
    path.write_text(MODEL)
    return path


def test_check_reports_clean_capture(user_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", f"{user_file}:clean"]) == 0
    assert "captures cleanly, 2 segments (1 breaks)" in capsys.readouterr().out


def test_check_names_the_host_sync_and_line(
    user_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", f"{user_file}:syncs"]) == 1
    out = capsys.readouterr().out
    assert "_local_scalar_dense" in out
    assert "user_model.py:16" in out
    assert "@eager_on_graph" in out


def test_check_rejects_malformed_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "no_colon_here"]) == 2
    assert "bcg check: expected FILE.py:FUNCTION or MODULE:FUNCTION" in capsys.readouterr().err


SHADOW = """
import torch

x = torch.randn(8)

def random():
    if x.sum().item() > 1e9:  # a host sync at line 7
        return x * 0
    return x * 2
"""


def test_check_loads_a_file_by_path_not_by_its_stem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "shadow" / "random.py"  # the stem names a standard-library module
    path.parent.mkdir()
    path.write_text(SHADOW)
    assert main(["check", f"{path}:random"]) == 1
    out = capsys.readouterr().out
    assert "_local_scalar_dense" in out and "random.py:7" in out


BUILDER = """
import torch

def make_check():
    return (lambda x: x * 2), [torch.ones(2), torch.zeros(2)]

def needs_args(x):
    return x

not_a_function = 3
"""


def _one_line_error(capsys: pytest.CaptureFixture[str], *words: str) -> None:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bcg check: "), captured.err
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize(
    ("target", "flags", "words"),
    [
        ("missing.py:f", [], ["no file", "missing.py"]),
        ("{path}:nope", [], ["defines no 'nope'"]),
        ("{path}:not_a_function", [], ["is not callable"]),
        ("{path}:needs_args", [], ["must take no arguments"]),
        ("{path}:make_check", [], ["add --divergence"]),
        ("{path}:needs_args", ["--divergence"], ["must take no arguments"]),
        ("no_such_module_xyz:f", [], ["no module 'no_such_module_xyz'"]),
    ],
)
def test_check_bad_targets_get_one_line_and_exit_code_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    target: str,
    flags: list[str],
    words: list[str],
) -> None:
    path = tmp_path / "builder.py"
    path.write_text(BUILDER)
    target = target.format(path=path) if "{path}" in target else str(tmp_path / target)
    if target.startswith(str(tmp_path / "no_such")):
        target = target.removeprefix(f"{tmp_path}/")
    assert main(["check", target, *flags]) == 2
    _one_line_error(capsys, *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path of bench --smoke")
def test_bench_smoke_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--smoke", "break-overhead", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["environment"]["torch"] == torch.__version__
    by_name = {m["contender"]: m for m in data["measurements"]}
    assert set(by_name) == {"eager", "full_graph", "bcg"}
    assert by_name["full_graph"]["skipped"] == "needs CUDA"
    assert by_name["bcg"]["segments"] == 9
    assert by_name["bcg"]["ratio_to_eager"]["median"] > 0
    assert "bcg bench --smoke on cpu" in capsys.readouterr().out


def test_bench_unknown_workload(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--smoke", "nope"]) == 2
    assert "unknown workload" in capsys.readouterr().err  # one line on stderr: test_cpu_docs_truth2


def test_core_workloads_are_built_in() -> None:
    assert {"decoder", "break-overhead"} <= set(discover())


def test_compiled_check_is_bitwise_unless_the_compiled_step_varies() -> None:
    """The compiled contenders' check: a replay equal to one result of the compiled step is
    right; one equal to none, where the step reproduced itself, is wrong; where the step gives
    several results (inductor's hf-llama code at batch 8 on the H200), torch.compile's tolerance
    against float32 decides."""
    from bcg_core.bench import BenchContext
    from bcg_core.bench._workloads import COMPILED_RUNS, compiled_check  # noqa: PLC2701

    lines: list[str] = []
    ctx = BenchContext(torch.device("cpu"), progress=lines.append)
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0625])
    truth, eager = torch.tensor([1.0, 2.03]), torch.tensor([1.0, 2.0])  # eager's error: 0.03

    def results(*values: torch.Tensor) -> Any:
        calls = iter(values * COMPILED_RUNS)
        return lambda: next(calls)

    exact = (lambda: eager, lambda: truth)
    assert compiled_check(ctx, "c", lambda: a, results(a), exact)()
    assert compiled_check(ctx, "c", lambda: b, results(a, b), exact)()  # one of its results
    assert not compiled_check(ctx, "c", lambda: b, results(a), exact)()
    assert "reproduced itself" in lines[-1]
    varies = results(a, torch.tensor([1.0, 2.0078]))
    assert compiled_check(ctx, "c", lambda: torch.tensor([1.0, 2.05]), varies, exact)()
    assert "error 0.02, bound 0.06" in lines[-1]
    varies = results(a, torch.tensor([1.0, 2.0078]))
    assert not compiled_check(ctx, "c", lambda: torch.tensor([1.0, 2.5]), varies, exact)()
    varies = results(a, torch.tensor([1.0, 2.0078]))
    assert not compiled_check(ctx, "c", lambda: b, varies)()  # no float32 step to judge by
