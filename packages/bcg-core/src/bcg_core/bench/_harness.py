"""The benchmark harness behind ``bcg bench``: contenders timed interleaved, ratios per repeat.

Machines are noisy, so absolute times mean little: every contender of a case is timed in the
same run, round-robin (repeat 1 of each, then repeat 2 of each, ...), and ratios to the full
graph and to eager are taken per repeat before the median, min and max are reported.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

EAGER = "eager"
FULL_GRAPH = "full_graph"


@dataclass(frozen=True)
class Stats:
    """Median, min and max of one figure over the repeats.

    Attributes:
        median: the median over the repeats.
        min: the smallest value.
        max: the largest value.
    """

    median: float
    min: float
    max: float

    @staticmethod
    def of(values: list[float]) -> Stats:
        """The statistics of ``values``.

        Args:
            values: one figure per repeat (at least one).

        Returns:
            Their median, min and max.

        Raises:
            ValueError: ``values`` is empty.
        """
        return Stats(statistics.median(values), min(values), max(values))


@dataclass
class Contender:
    """One way of running a step, as a workload hands it to :meth:`BenchContext.compare`.

    Attributes:
        name: the contender's name in the report (``EAGER`` and ``FULL_GRAPH`` are the
            references that ratios are taken to).
        step: a zero-argument callable that runs one step; None when the contender cannot run
            here, with the reason in ``skipped``.
        skipped: why the contender did not run (default None).
        capture_ms: its capture's wall time in ms, when it has one (default None).
        pool_mb: its graph pool's size in MB, when known (default None).
        segments: graph segments per replay, when it has a graph (default None).
        correct: set from ``check`` after timing (default None: not checked).
        keep_alive: what a captured ``step`` reads by address (the eager step closing over its
            inputs): a graph does not own its inputs, and replaying after they are freed reads
            whatever the allocator put there since (default None).
        check: runs once after timing and gives ``correct``: it should run the contender once
            more (a replay, for a graph) and compare that output with an independent eager
            run, so a replay that went wrong while being timed is reported. A check that raises
            counts as incorrect (default None).
    """

    name: str
    step: Callable[[], object] | None
    skipped: str | None = None
    capture_ms: float | None = None
    pool_mb: float | None = None
    segments: int | None = None
    correct: bool | None = None
    keep_alive: object = None
    check: Callable[[], bool] | None = None


@dataclass
class Measurement:
    """One contender on one case of one workload: a row of the bench report.

    Attributes:
        workload: the workload's name.
        case: the case within the workload (a shape, a model size).
        contender: the contender's name.
        us_per_step: microseconds per step over the repeats; None when skipped.
        skipped: why the contender did not run (default None).
        capture_ms: its capture's wall time in ms (default None).
        pool_mb: its graph pool's size in MB (default None).
        segments: graph segments per replay (default None).
        correct: the outcome of its check (default None: not checked).
        ratio_to_full_graph: its time over the full graph's, per repeat (default None: no
            full-graph contender ran).
        ratio_to_eager: its time over eager's, per repeat (default None: no eager contender
            ran).
        details: a workload's own breakdowns beyond the table's columns (JSON only).
        figures: a workload's own named figures, shown in the table's ``figures`` column.
    """

    workload: str
    case: str
    contender: str
    us_per_step: Stats | None
    skipped: str | None = None
    capture_ms: float | None = None
    pool_mb: float | None = None
    segments: int | None = None
    correct: bool | None = None
    ratio_to_full_graph: Stats | None = None
    ratio_to_eager: Stats | None = None
    details: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The measurement as plain dicts and values, for a JSON result file.

        Returns:
            ``dataclasses.asdict`` of it: every field, the :class:`Stats` as dicts.
        """
        return dataclasses.asdict(self)


@dataclass
class BenchContext:
    """What a workload gets: sizes to use, and :meth:`compare` to time its contenders.

    Attributes:
        device: the device to run on.
        smoke: True under ``--smoke``: tiny sizes, to check that the workload runs (the
            ``torch.compile`` contender is skipped); default False.
        repeats: interleaved timing repeats per contender (default 10).
        steps: steps per timed repeat (default 20).
        skip: contender names to leave out (``--skip``); default none.
        progress: called with a line of progress text (default: discard it).
    """

    device: torch.device
    smoke: bool = False
    repeats: int = 10
    steps: int = 20
    skip: frozenset[str] = frozenset()
    progress: Callable[[str], None] = field(default=lambda _msg: None)

    def build(self, name: str, make: Callable[[], Contender]) -> Contender:
        """Build a contender unless ``--skip`` names it.

        A contender whose set-up raises (it cannot capture here, a peer misbehaves) is reported
        as skipped, not fatal.

        Args:
            name: the contender's name, matched against ``skip``.
            make: a zero-argument callable that builds the contender.

        Returns:
            ``make()``'s contender, or one with ``step=None`` and the reason in ``skipped``
            (excluded by ``--skip``, or the set-up's exception, truncated).
        """
        if name in self.skip:
            return Contender(name, None, skipped="excluded by --skip")
        self.progress(f"building {name}")
        try:
            return make()
        except Exception as exc:
            return Contender(name, None, skipped=f"failed: {type(exc).__name__}: {exc}"[:160])

    def synchronize(self) -> None:
        """Wait for the device (a no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], object]) -> tuple[object, float]:
        """Run ``fn`` once and time it, the device synchronised before and after.

        Args:
            fn: a zero-argument callable, such as a capture.

        Returns:
            ``(result, ms)``: what ``fn`` returned and its wall time in milliseconds.
        """
        self.synchronize()
        start = time.perf_counter()
        result = fn()
        self.synchronize()
        return result, (time.perf_counter() - start) * 1e3

    def _time(self, step: Callable[[], object]) -> float:
        self.synchronize()
        start = time.perf_counter()
        for _ in range(self.steps):
            step()
        self.synchronize()
        return (time.perf_counter() - start) / self.steps * 1e6

    def compare(self, workload: str, case: str, contenders: list[Contender]) -> list[Measurement]:
        """Time every runnable contender ``repeats`` times, interleaved, then check each.

        Each runnable contender runs one warm-up step first; each repeat times ``steps`` steps
        of every contender in turn. Then each contender's ``check`` runs once. Ratios are
        computed per repeat against ``eager`` and ``full_graph``.

        Args:
            workload: the workload's name, for the measurements and progress lines.
            case: the case's name.
            contenders: the contenders; those with ``step=None`` are reported as skipped.

        Returns:
            One :class:`Measurement` per contender, in the given order.
        """
        ready = [c for c in contenders if c.step is not None]
        for c in ready:
            self.progress(f"{workload} {case}: warming up {c.name}")
            assert c.step is not None
            c.step()
        times: dict[str, list[float]] = {c.name: [] for c in ready}
        for r in range(self.repeats):
            self.progress(f"{workload} {case}: repeat {r + 1}/{self.repeats}")
            for c in ready:
                assert c.step is not None
                times[c.name].append(self._time(c.step))
        for c in ready:
            if c.check is not None:
                self.progress(f"{workload} {case}: checking {c.name}")
                c.correct = _run_check(c.check)
        out = []
        for c in contenders:
            if c.step is None:
                out.append(Measurement(workload, case, c.name, None, skipped=c.skipped))
                continue
            mine = times[c.name]
            out.append(
                Measurement(
                    workload,
                    case,
                    c.name,
                    Stats.of(mine),
                    capture_ms=c.capture_ms,
                    pool_mb=c.pool_mb,
                    segments=c.segments,
                    correct=c.correct,
                    ratio_to_full_graph=_ratios(mine, times.get(FULL_GRAPH)),
                    ratio_to_eager=_ratios(mine, times.get(EAGER)),
                )
            )
        return out


def _run_check(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:
        return False


def _ratios(mine: list[float], base: list[float] | None) -> Stats | None:
    if not base:
        return None
    return Stats.of([m / b for m, b in zip(mine, base, strict=True)])
