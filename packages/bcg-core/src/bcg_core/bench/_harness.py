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
    """Median, min and max of one figure over the repeats."""

    median: float
    min: float
    max: float

    @staticmethod
    def of(values: list[float]) -> Stats:
        return Stats(statistics.median(values), min(values), max(values))


@dataclass
class Contender:
    """One way of running a step. ``step`` is None when the contender cannot run here, with the
    reason in ``skipped``; the other fields describe its capture, when it has one.

    ``keep_alive`` holds what a captured ``step`` reads by address (the eager step closing over
    its inputs): a graph does not own its inputs, and replaying after they are freed reads
    whatever the allocator put there since.

    ``check`` runs once after timing and gives ``correct``: it should run the contender once more
    (a replay, for a graph) and compare that output with an independent eager run, so a replay
    that went wrong while being timed is reported. A check that raises counts as incorrect."""

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
    """One contender on one case of one workload."""

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
    figures: dict[str, float] = field(default_factory=dict)  # a workload's own named figures

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class BenchContext:
    """What a workload gets: sizes to use, and :meth:`compare` to time its contenders."""

    device: torch.device
    smoke: bool = False
    repeats: int = 10
    steps: int = 20
    skip: frozenset[str] = frozenset()
    progress: Callable[[str], None] = field(default=lambda _msg: None)

    def build(self, name: str, make: Callable[[], Contender]) -> Contender:
        """``make()`` the contender unless ``--skip`` names it; a contender whose set-up raises
        (it cannot capture here, a peer misbehaves) is reported as skipped, not fatal."""
        if name in self.skip:
            return Contender(name, None, skipped="excluded by --skip")
        self.progress(f"building {name}")
        try:
            return make()
        except Exception as exc:
            return Contender(name, None, skipped=f"failed: {type(exc).__name__}: {exc}"[:160])

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], object]) -> tuple[object, float]:
        """Run ``fn`` once; return its result and the wall time in ms (device synchronised)."""
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
        """Time every runnable contender ``repeats`` times, interleaved, after one warm-up
        pass each, then run each contender's ``check``; ratios are computed per repeat against
        ``eager`` and ``full_graph``."""
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
