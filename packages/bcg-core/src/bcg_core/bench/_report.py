"""Output of ``bcg demo`` / ``bcg bench``: a table, a progress line, JSON, and a PNG plot.

rich (tables, progress bar) and matplotlib (plots) come with the ``bcg-core[bench]`` extra; in
their absence the table is plain text and ``--plot`` says what to install.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bcg_core import __version__
from bcg_core.bench._harness import Measurement, Stats

COLUMNS = (
    "workload", "case", "contender", "us/step median [min-max]", "x full graph", "x eager",
    "segments", "capture ms", "pool MB", "correct", "figures",
)  # fmt: skip


def environment() -> dict[str, Any]:
    """What every result file records about the machine and the software.

    Returns:
        A JSON-ready dict with keys ``date`` (UTC, ISO 8601), ``bcg_core``, ``python``,
        ``cpu``, ``torch_threads``, ``torch``, ``cuda``, ``gpu`` and ``driver`` (None where
        unknown: no GPU, or ``nvidia-smi`` failed).
    """
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "bcg_core": __version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "driver": None,
    }
    if torch.cuda.is_available():
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            done = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
            env["driver"] = done.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    return env


def _stats(s: Stats | None, fmt: str) -> str:
    if s is None:
        return "—"
    return f"{s.median:{fmt}} [{s.min:{fmt}}-{s.max:{fmt}}]"


def _cell(value: float | int | bool | None, fmt: str = ".1f") -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:{fmt}}" if isinstance(value, float) else str(value)


def speedup_over_eager(m: Measurement) -> float | None:
    """The one speed-up over eager: the inverse of the median per-repeat ratio in the table's
    ``x eager`` column (the demo's summary and the plot both use it)."""
    if m.ratio_to_eager is None or m.ratio_to_eager.median <= 0:
        return None
    return 1.0 / m.ratio_to_eager.median


def rows(measurements: Sequence[Measurement]) -> list[list[str]]:
    out = []
    for m in measurements:
        if m.skipped is not None:
            timing = f"skipped: {m.skipped}"
            ratios = ["—", "—"]
        else:
            timing = _stats(m.us_per_step, ".1f")  # "—" for untimed figures (memory)
            ratios = [_stats(m.ratio_to_full_graph, ".3f"), _stats(m.ratio_to_eager, ".3f")]
        out.append(
            [
                m.workload,
                m.case,
                m.contender,
                timing,
                *ratios,
                _cell(m.segments),
                _cell(m.capture_ms),
                _cell(m.pool_mb),
                _cell(m.correct),
                ", ".join(f"{k} {v:.1f}" for k, v in m.figures.items()),
            ]
        )
    return out


def print_table(title: str, measurements: Sequence[Measurement]) -> None:
    table_rows = rows(measurements)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}")
        widths = [max(len(c), *(len(r[i]) for r in table_rows)) for i, c in enumerate(COLUMNS)]
        for line in (list(COLUMNS), ["-" * w for w in widths], *table_rows):
            print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
        return
    table = Table(title=title)
    for column in COLUMNS:
        table.add_column(column)
    for row in table_rows:
        table.add_row(*row)
    # Logs and CI are not terminals: give the table room instead of rich's 80 columns.
    Console(width=None if sys.stdout.isatty() else 220).print(table)


@contextmanager
def progress(total_hint: str) -> Iterator[Callable[[str], None]]:
    """A progress display for long runs; yields ``update(message)``. Into a log (stderr is not
    a terminal) each message is its own line, so a crash shows what was running."""
    if not sys.stderr.isatty():

        def line(message: str) -> None:
            print(f"[bcg] {message}", file=sys.stderr, flush=True)

        yield line
        return
    try:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:

        def plain(message: str) -> None:
            print(f"\r[bcg] {message[:90]:<90}", end="", file=sys.stderr, flush=True)

        yield plain
        print(file=sys.stderr)
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(total_hint)
        yield lambda message: bar.update(task, description=message)


def write_json(
    path: Path, measurements: Sequence[Measurement], settings: dict[str, Any] | None = None
) -> None:
    """Write ``{"environment", "settings", "measurements"}``: the machine (:func:`environment`),
    the run's settings as given (the CLI's: device, smoke, repeats, steps, skip, workloads),
    plus ``cases`` (each workload's cases as run, such as its batch sizes), and every figure."""
    cases: dict[str, list[str]] = {}
    for m in measurements:
        workload = cases.setdefault(m.workload, [])
        if m.case not in workload:
            workload.append(m.case)
    data = {
        "environment": environment(),
        # Without them a result file could not say what it measured (a --smoke run read as a
        # full one).
        "settings": {**(settings or {}), "cases": cases},
        "measurements": [m.as_dict() for m in measurements],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def write_plot(path: Path, measurements: Sequence[Measurement]) -> bool:
    """A bar chart of speed-up over eager per case and contender (without eager figures, as in
    start-up workloads: the ratio to plain graphs, lower is better); False without
    matplotlib."""
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return False
    timed = [m for m in measurements if speedup_over_eager(m) is not None]
    speedup = bool(timed)
    if not speedup:
        timed = [m for m in measurements if m.ratio_to_full_graph is not None]
    cases = list(dict.fromkeys(f"{m.workload}\n{m.case}" for m in timed))
    contenders = list(dict.fromkeys(m.contender for m in timed))
    width = 0.8 / max(len(contenders), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases)), 4))
    for i, name in enumerate(contenders):
        xs, ys = [], []
        for j, case in enumerate(cases):
            for m in timed:
                if m.contender == name and f"{m.workload}\n{m.case}" == case:
                    value = speedup_over_eager(m) if speedup else None
                    if value is None:
                        assert m.ratio_to_full_graph is not None
                        value = m.ratio_to_full_graph.median
                    xs.append(j + i * width)
                    ys.append(value)
        ax.bar(xs, ys, width=width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], cases, fontsize=8)
    ax.set_ylabel("speed-up over eager (x)" if speedup else "x plain CUDA graphs (lower is better)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    env = environment()
    ax.set_title(f"bcg bench — {env['gpu'] or 'CPU'}, torch {env['torch']}", fontsize=10)
    if contenders:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
