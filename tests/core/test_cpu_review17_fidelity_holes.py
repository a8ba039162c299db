"""Holes found in the CPU backend's fidelity to CUDA graphs (review 17, second pass), each pinned
by a test: code the CPU backend captured or replayed otherwise than a CUDA graph would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    check_capture,
    enable_breakable_cuda_graph,
)
from bcg_core._errors import HostSyncError  # noqa: PLC2701


def _capture(fn: Callable[[], Any]) -> tuple[BreakableCUDAGraph, Any]:
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = fn()
    return graph, out


_A = torch.tensor([[4.0, 1.0], [1.0, 3.0]])


@pytest.mark.parametrize(
    "fn",
    [
        lambda a: torch.linalg.svd(a),
        lambda a: torch.linalg.svdvals(a),
        lambda a: torch.linalg.matrix_norm(a, 2),
        lambda a: torch.linalg.matrix_rank(a),
        lambda a: torch.linalg.eigh(a),
        lambda a: torch.linalg.eigvalsh(a),
        lambda a: torch.linalg.eig(a),
        lambda a: torch.linalg.eigvals(a),
        lambda a: torch.linalg.pinv(a),
    ],
    ids=["svd", "svdvals", "norm2", "matrix_rank", "eigh", "eigvalsh", "eig", "eigvals", "pinv"],
)
def test_a_decomposition_checking_its_convergence_is_a_host_sync(
    fn: Callable[[torch.Tensor], Any],
) -> None:
    # torch's _linalg_svd, _linalg_eigh and linalg_eig kernels end in _linalg_check_errors, which
    # reads the info tensor on the host on CUDA (a capture refuses it); on the CPU that call is
    # below the dispatcher, so the CPU backend captured and replayed them.
    with pytest.raises(HostSyncError, match="info tensor") as info:
        _capture(lambda: fn(_A * 1))
    assert "@eager_on_graph" in str(info.value)
    report = check_capture(fn, _A)
    assert not report.ok


def test_a_decomposition_of_an_empty_matrix_still_captures() -> None:
    # The kernels return before their check for an empty input: nothing is read on the host.
    graph, (_, s, _) = _capture(lambda: torch.linalg.svd(torch.zeros(0, 0) * 1))
    graph.replay()
    assert s.shape == (0,)
