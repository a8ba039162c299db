"""The bcg command on a machine without a GPU: check, bench --smoke, errors."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_check_rejects_malformed_target() -> None:
    with pytest.raises(SystemExit, match="MODULE:CALLABLE"):
        main(["check", "no_colon_here"])


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
    assert "unknown workload" in capsys.readouterr().out


def test_core_workloads_are_built_in() -> None:
    assert {"decoder", "break-overhead"} <= set(discover())
