"""What an engine learns from start-up: ``capture_many``'s report (per size: capture and
warm-up ms, segments, breaks, pool bytes; failed calls with the reason), the graph memory a
runner holds, and the progress bar. Scenarios run on the shared ``device`` fixture (the CPU
graph backend everywhere, CUDA graphs where a GPU is present)."""

from __future__ import annotations

import pytest
import torch
from graph_helpers import device_graph

from bcg_core import (
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    CaptureError,
    CaptureReport,
    GraphMemory,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
    signature_of,
)
from bcg_core.bench import BenchContext
from bcg_core.bench._workloads import PEER, discover  # noqa: PLC2701


@eager_on_graph
def _squash(h: torch.Tensor) -> torch.Tensor:
    return h.tanh()


def _model(x: torch.Tensor) -> torch.Tensor:
    return _squash(x * 2) + 1


def _eager(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).tanh() + 1


def test_capture_many_reports_each_capture_in_order(device: str) -> None:
    runner = BreakableGraphRunner(_model, device=device, warmup_iters=1)
    sizes = (2, 64, 8, 64)  # the second 64 is a replay: not reported again
    report = runner.capture_many([((torch.randn(b, 16),), {}) for b in sizes])
    assert isinstance(report, CaptureReport)
    expected = [signature_of((torch.randn(b, 16),), {}) for b in (64, 8, 2)]
    assert [e.signature for e in report.captured] == expected
    assert report.failed == ()
    for e in report.captured:
        assert (e.segments, e.breaks, e.capture_runs) == (2, 1, 2)
        assert e.capture_ms > 0 and e.warmup_ms > 0
        assert (e.pool_bytes is None) == (device == "cpu")
    assert report.seconds * 1e3 >= sum(e.capture_ms + e.warmup_ms for e in report.captured)
    assert report.memory == runner.graph_memory()
    x = torch.randn(8, 16)
    assert torch.equal(runner(x), _eager(x))


def test_graph_memory_counts_static_buffers_and_bridges_outside_the_pool(device: str) -> None:
    runner = BreakableGraphRunner(_model, device=device)
    assert runner.graph_memory() == GraphMemory(0, 0, 0)  # nothing captured, no pool yet
    sizes = (32, 4)
    runner.capture_many([((torch.randn(b, 16),), {}) for b in sizes])
    memory = runner.graph_memory()
    assert memory.static_bytes == sum(b * 16 * 4 for b in sizes)  # float32 inputs
    if device == "cpu":
        # The CPU backend cannot route a break's output into a pool: it is held strongly.
        assert memory.pool_bytes is None and memory.total_bytes is None
        assert memory.bridge_bytes == sum(b * 16 * 4 for b in sizes)
    else:
        # Bridges lie in the pool (held through aliases) and are counted there.
        assert memory.bridge_bytes == 0
        assert memory.pool_bytes is not None and memory.pool_bytes > 0
        assert memory.total_bytes == memory.pool_bytes + memory.static_bytes
    runner.reset()
    assert runner.graph_memory() == GraphMemory(0, 0, 0)


def test_a_failed_capture_is_reported_with_its_reason(device: str) -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3 and is_breakable_capture_active():
            raise RuntimeError("batch 3 cannot be captured")
        return _model(x)

    runner = BreakableGraphRunner(model, device=device, warmup_iters=0)
    report = runner.capture_many([((torch.randn(b, 4),), {}) for b in (4, 3, 2)])
    assert len(report.captured) == 2
    ((sig, why),) = report.failed
    assert "batch 3 cannot be captured" in why
    assert sig in runner.blocked_signatures
    x = torch.randn(3, 4)
    assert torch.equal(runner(x), _eager(x))  # served eagerly


def test_capture_many_draws_a_progress_bar_only_when_asked(
    device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tqdm")
    calls = [((torch.randn(b, 4),), {}) for b in (4, 2)]
    BreakableGraphRunner(_model, device=device).capture_many(calls)
    assert "bcg capture" not in capsys.readouterr().err  # stderr is not a terminal here
    BreakableGraphRunner(_model, device=device).capture_many(calls, progress=True)
    assert "bcg capture" in capsys.readouterr().err


def test_capture_scale_smoke_reports_every_contender(device: str) -> None:
    rows = discover()["capture-scale"](BenchContext(torch.device(device), smoke=True))
    startup = {m.contender: m for m in rows if m.case.startswith("start-up")}
    assert set(startup) == {
        "full_graph",
        "bcg",
        "bcg-side-stream",
        "bcg-record-only",
        "runner",
        PEER,
    }
    for name in ("bcg", "runner"):
        m = startup[name]
        assert m.skipped is None and m.correct is True, m
        assert m.capture_ms is not None and 0 < m.capture_ms <= m.details["startup_s"] * 1e3
    report = startup["runner"].details["per_size"]
    assert [r["batch"] for r in report] == [2, 1]
    assert all(r["segments"] == 3 and r["breaks"] == 2 for r in report)  # 2 layers
    memory_rows = [m for m in rows if m.case in ("reserved MB", "device MB", "held MB")]
    if device == "cpu":
        assert startup["full_graph"].skipped == "needs CUDA"
        assert memory_rows == []
    else:
        assert startup["full_graph"].correct is True
        assert startup["bcg-record-only"].correct is True
        assert startup["bcg-side-stream"].correct is True
        assert {m.contender for m in memory_rows} >= {"full_graph", "bcg", "runner"}


def test_a_graph_warms_up_in_its_block_and_refuses_inside_a_capture(device: str) -> None:
    graph = device_graph()
    x = torch.randn(8, 16)
    with enable_breakable_cuda_graph():
        with graph.warmup():
            for _ in range(2):
                _model(x)
        with BreakableCUDAGraphCapture(graph):
            out = _model(x)
            with pytest.raises(CaptureError, match="warm up before capturing"), graph.warmup():
                pass
    x.copy_(torch.randn(8, 16))
    graph.replay()
    assert torch.equal(out, _eager(x))


def test_capture_many_beyond_max_entries_says_so(
    device: str, caplog: pytest.LogCaptureFixture
) -> None:
    runner = BreakableGraphRunner(_model, device=device, warmup_iters=0, max_entries=2)
    report = runner.capture_many([((torch.randn(b, 4),), {}) for b in (4, 3, 2)])
    assert len(report.captured) == 3 and len(runner.stats.entries) == 2
    assert any("evicted 1 graph" in r.getMessage() for r in caplog.records)
