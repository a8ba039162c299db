"""Review 23: holes in the ``bcg`` command as a user meets it (CPU, no GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from bcg_core.bench import main

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the CPU path of bench --smoke"
)


def _one_line_error(capsys: pytest.CaptureFixture[str], prefix: str) -> str:
    out, err = capsys.readouterr()
    assert out == "", out  # nothing ran
    assert err.startswith(prefix) and err.count("\n") == 1, err
    return err


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")
def test_an_output_folder_that_refuses_new_files_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # os.access said yes to root for /proc (and any folder of a read-only or special mount
    # root may "write"): the whole run went by, then the write raised FileNotFoundError and
    # the figures were lost.
    for option in ("--json", "--plot"):
        assert main(["bench", "--smoke", "break-overhead", option, "/proc/bcg-out.json"]) == 2
        _one_line_error(capsys, f"bcg bench: {option} /proc/bcg-out.json")


def test_json_and_plot_to_the_same_file_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The PNG was written over the JSON just written: exit 0, "wrote" twice, the figures gone.
    out = tmp_path / "r.out"
    same = str(tmp_path / "sub" / ".." / "r.out")
    assert main(["bench", "--smoke", "break-overhead", "--json", str(out), "--plot", same]) == 2
    _one_line_error(capsys, "bcg bench: --plot")
    assert not out.exists()


def _broken_plugin(folder: Path, value: str = "broken_bcg_plugin_missing_module:workload") -> None:
    """A distribution whose ``bcg.workloads`` entry point ``broken`` is ``value``."""
    info = folder / "broken_bcg_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-bcg-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[bcg.workloads]\nbroken = {value}\n")


def test_a_plugin_that_cannot_be_imported_does_not_break_other_workloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # discover() loaded every entry point up front: one installed plugin that fails to import
    # made every `bcg bench`, even `bcg bench break-overhead`, a ModuleNotFoundError traceback.
    _broken_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["bench", "--smoke", "break-overhead", "--repeats", "1", "--steps", "1"]) == 0
    assert "break-overhead" in capsys.readouterr().out
    # Run by name, it is a row saying why, not a traceback that loses the other workloads.
    out = tmp_path / "r.json"
    argv = ["bench", "--smoke", "broken", "break-overhead", "--repeats", "1", "--steps", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["measurements"]
    broken = [m for m in rows if m["workload"] == "broken"]
    assert len(broken) == 1 and "broken_bcg_plugin_missing_module" in broken[0]["skipped"]
    assert any(m["workload"] == "break-overhead" and m["correct"] for m in rows)
    assert "broken_bcg_plugin_missing_module" not in sys.modules


def test_check_takes_a_file_in_a_folder_whose_name_has_a_colon(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The target was split at its first colon: "/x/run:3/model.py:clean" looked for a module
    # "/x/run" (exit 2, "no module"), a colon being a legal folder name (and a Windows drive).
    folder = tmp_path / "run:3"
    folder.mkdir()
    (folder / "model.py").write_text("import torch\n\ndef clean():\n    return torch.ones(2) * 2\n")
    target = f"{folder}/model.py:clean"
    assert main(["check", target]) == 0
    assert capsys.readouterr().out.startswith(f"{target}: captures cleanly")


def test_a_workload_that_raises_keeps_the_other_workloads_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A workload raising after others ran was a traceback: no table, no --json, the figures of
    # the workloads before it lost (a contender's set-up raising was already a skipped row).
    (tmp_path / "review23_raising_plugin.py").write_text(
        "def workload(ctx):\n    raise RuntimeError('review23 workload bug')\n"
    )
    _broken_plugin(tmp_path, "review23_raising_plugin:workload")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "r.json"
    argv = ["bench", "--smoke", "break-overhead", "broken", "--repeats", "1", "--steps", "1"]
    assert main([*argv, "--json", str(out)]) == 1  # something failed: not a clean run
    rows = json.loads(out.read_text())["measurements"]
    assert any(m["workload"] == "break-overhead" and m["correct"] for m in rows)
    broken = [m for m in rows if m["workload"] == "broken"]
    assert len(broken) == 1 and "review23 workload bug" in broken[0]["skipped"]
    printed, err = capsys.readouterr()
    assert "break-overhead" in printed
    assert "review23 workload bug" in err  # its traceback, for the plugin's author
