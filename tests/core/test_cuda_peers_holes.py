"""The debug-check holes of tests/core/test_cpu_peers_holes.py on CUDA, where sglang tests them:
a tensor kept by a custom op's kernel inside a break, and a keep_alive_ok mark whose tensor died
(the caching allocator hands its block to the next allocation of that size)."""

from __future__ import annotations

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    CaptureError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    keep_alive_ok,
)

pytestmark = pytest.mark.cuda

_kept: list[torch.Tensor] = []


@torch.library.custom_op("bcg_peers_cuda_test::bump", mutates_args=["x"])
def _bump(x: torch.Tensor) -> None:
    _kept.append(x * 5)
    x.add_(1)


@eager_on_graph(name="peers_cuda.via_custom_op")
def _via_custom_op(x: torch.Tensor) -> None:
    torch.ops.bcg_peers_cuda_test.bump(x)


def test_the_debug_check_sees_a_tensor_kept_inside_a_custom_op() -> None:
    _kept.clear()
    x = torch.ones(1024, device="cuda")
    graph = BreakableCUDAGraph()
    with (
        pytest.raises(CaptureError, match="neither returned nor wrote"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph, debug="strict"),
    ):
        _via_custom_op(x * 1)
    assert len(_kept) == 1
    _kept.clear()


def test_keep_alive_ok_exempts_a_storage_not_its_address() -> None:
    kept: list[torch.Tensor] = []
    reused: list[bool] = []

    @eager_on_graph(name="peers_cuda.marks_then_keeps")
    def marks_then_keeps(x: torch.Tensor) -> None:
        table = keep_alive_ok(x * 2)
        address = table.data_ptr()
        del table
        kept.append(x * 3)  # the caching allocator's block of the dead table
        reused.append(kept[0].data_ptr() == address)

    x = torch.ones(1_000_003, device="cuda")
    graph = BreakableCUDAGraph()
    with (
        pytest.raises(CaptureError, match="neither returned nor wrote"),
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph, debug="strict"),
    ):
        marks_then_keeps(x)
    assert len(reused) == 1  # (the block is reused by the caching allocator; a leak either way)
