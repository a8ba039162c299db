"""Holes found by the input-zoo review (session 25), on the CPU graph backend: unusual but
legal inputs and outputs, every replay compared with eager."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    BreakOutputError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_in_breakable_cuda_graph,
)


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="bcg_core")


def _concat_kwargs(x: torch.Tensor, **kw: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, *kw.values()])


def test_a_capture_passes_the_step_s_kwargs_in_the_call_s_order() -> None:
    # The static call was built with the keywords sorted by name (the signature's walk order),
    # so a capture of f(x, b=b, a=a) ran the step with **kwargs in a, b order: the capture and
    # every replay returned [x, a, b] where eager returns [x, b, a].
    runner = BreakableGraphRunner(_concat_kwargs, device="cpu")
    x, b, a = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    assert torch.equal(runner.capture(x, b=b, a=a), _concat_kwargs(x, b=b, a=a))
    for i in range(3):
        x, b, a = torch.randn(1), torch.randn(1), torch.randn(1)
        kw: dict[str, Any] = {"b": b, "a": a}
        assert torch.equal(runner(x, **kw), _concat_kwargs(x, **kw)), i
    assert runner.stats.hits == 3


def _quantized(scale: float, zero_point: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.quantize_per_tensor(torch.randn(4), scale, zero_point, torch.quint8)


def _dequantized_twice(q: torch.Tensor) -> torch.Tensor:
    return q.dequantize() * 2


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_a_quantized_argument_of_another_scale_does_not_replay_the_capture_s_scale() -> None:
    # A quantized tensor passed as a plain tensor: its scale and zero point are not in the
    # key, and the static buffer keeps the capture's, so a call with scale 0.5 replayed with
    # the capture's 0.3 (silently wrong values). It is an object of the signature now.
    runner = BreakableGraphRunner(_dequantized_twice, device="cpu")
    runner.capture(_quantized(0.3, 0, 100))
    for i, (scale, zero) in enumerate([(0.5, 1), (0.05, 2), (0.3, 0)]):
        q = _quantized(scale, zero, i)
        assert torch.equal(runner(q), _dequantized_twice(q)), (scale, zero)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_a_break_returning_a_quantized_tensor_is_refused_at_capture() -> None:
    # A replay copied the break's new quantized values into the capture's quantized tensor,
    # which kept the capture's scale and zero point: a break returning scale 0.5 at a replay
    # was read with the capture's 0.1 (silently wrong). Refused at capture, by path.
    scale = [0.1]

    @eager_on_graph
    def quantize(y: torch.Tensor) -> torch.Tensor:
        return torch.quantize_per_tensor(y, scale[0], 0, torch.quint8)

    x = torch.randn(4)
    graph = BreakableCUDAGraph(backend="cpu")
    with (
        pytest.raises(BreakOutputError, match=r"quantize' returned output \(a quantized"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        quantize(x * 2).dequantize() + 1
    assert not is_in_breakable_cuda_graph()


def _scaled_back(x: torch.Tensor, s: Any) -> torch.Tensor:
    return x * s * 1e-300


def test_a_lifted_float_beyond_the_slot_s_range_runs_as_eager() -> None:
    # A lifted float lives in a 0-dim tensor of the default dtype (float32): a capture given
    # 1e300 computed with inf where eager gives 1.0, and a replay given 2e300 raised torch's
    # raw "value cannot be converted to type float without overflow". Such a value stays a
    # constant of the signature, as an int beyond int64 does.
    runner = BreakableGraphRunner(_scaled_back, device="cpu", as_tensor=(1,))
    x = torch.ones(2, dtype=torch.float64)
    assert torch.equal(runner.capture(x, 1e300), _scaled_back(x, 1e300))
    assert torch.equal(runner(x, 2e300), _scaled_back(x, 2e300))
    runner.capture(x, 2.0)
    assert torch.equal(runner(x, 3.0), _scaled_back(x, 3.0))
    assert torch.equal(runner(x, float("inf")), _scaled_back(x, float("inf")))
