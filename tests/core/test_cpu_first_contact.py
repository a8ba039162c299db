"""A new user on a machine without CUDA: every CUDA-needing entry point says how to use the CPU
graph backend, the runner's warnings describe signatures in words, and ``bcg demo``'s summary
uses the table's definition of the speed-up."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    CaptureError,
    eager_on_graph,
    is_breakable_capture_active,
)
from bcg_core.bench import main

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the machine-without-CUDA path")
CPU_HINT = 'BreakableCUDAGraph(backend="cpu"), BreakableGraphRunner(device="cpu")'


@no_cuda
def test_a_cuda_capture_without_cuda_names_the_cpu_backend() -> None:
    graph = BreakableCUDAGraph()
    with (
        pytest.raises(CaptureError, match="needs a CUDA device") as info,
        BreakableCUDAGraphCapture(graph),
    ):
        pass
    assert CPU_HINT in str(info.value)
    assert not is_breakable_capture_active()


@no_cuda
def test_a_cuda_pool_without_cuda_is_our_error_not_torchs() -> None:
    with pytest.raises(CaptureError) as info:
        BreakableCUDAGraph(backend="cuda").pool()
    assert CPU_HINT in str(info.value) and "dummy base class" not in str(info.value)


@no_cuda
def test_the_runners_eager_notice_names_device_cpu(caplog: pytest.LogCaptureFixture) -> None:
    runner = BreakableGraphRunner(lambda x: x * 2)
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        assert torch.equal(runner.capture(torch.ones(2)), torch.full((2,), 2.0))
    assert 'pass device="cpu"' in caplog.text


@eager_on_graph(name="host_value")
def host_value(x: torch.Tensor) -> torch.Tensor:
    return x


def test_a_failed_capture_describes_the_signature_in_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def step(x: torch.Tensor, pair: tuple[torch.Tensor, int]) -> torch.Tensor:
        return x * float(pair[0].sum())  # a host sync inside a segment

    runner = BreakableGraphRunner(step, device="cpu")
    with caplog.at_level(logging.WARNING, logger="bcg_core"):
        runner.capture(torch.ones(2), (torch.ones(3), 4))
    text = caplog.text
    assert "capture failed for the call with args[0]: tensor[2] torch.float32 on cpu" in text
    assert "args[1][0]: tensor[3] torch.float32 on cpu, args[1][1]: 4" in text
    assert "<class" not in text


def test_demo_summary_uses_the_tables_speed_up(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--repeats", "3", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if re.search(r"\bbcg\b", line) and "[" in line)
    x_eager = float(re.findall(r"(\d+\.\d{3}) \[\d", row)[-1])  # the last ratio column
    found = re.search(r"speed-up over eager (\d+\.\d+)x", out)
    assert found is not None, out
    assert float(found.group(1)) == pytest.approx(1 / x_eager, abs=0.006 + 0.001 / x_eager**2)
