"""Holes found in the CPU backend's CUDA capture rules (review 9), each pinned by a test: code the
CPU backend captured and replayed although a CUDA capture refuses it (a host synchronisation
inside an op's CUDA kernel, which the dispatcher does not show on the CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from graph_helpers import cpu_capture

from bcg_core._errors import HostSyncError  # noqa: PLC2701

_A = torch.tensor([[4.0, 1.0], [1.0, 3.0]])
_B = torch.tensor([[1.0], [2.0]])


@pytest.mark.parametrize(
    "fn",
    [
        lambda a: torch.linalg.inv(a),
        lambda a: torch.inverse(a),
        lambda a: torch.linalg.solve(a, _B),
        lambda a: torch.linalg.cholesky(a),
        lambda a: torch.linalg.lu_factor(a),
        lambda a: torch.linalg.inv_ex(a, check_errors=True),
        lambda a: torch.linalg.cholesky_ex(a, check_errors=True),
    ],
    ids=["inv", "inverse", "solve", "cholesky", "lu_factor", "inv_ex_check", "cholesky_ex_check"],
)
def test_a_linalg_op_checking_its_errors_is_a_host_sync(fn: Callable[[torch.Tensor], Any]) -> None:
    # On CUDA these read their info tensor on the host (_linalg_check_errors:
    # infos.any().item()), which a capture refuses; the CPU backend captured and replayed them.
    with pytest.raises(HostSyncError, match="info tensor") as info:
        cpu_capture(lambda: fn(_A * 1))
    assert "_ex" in str(info.value)


def test_the_unchecked_ex_variants_capture_and_replay() -> None:
    a = _A.clone()
    graph, (inverse, info) = cpu_capture(lambda: torch.linalg.inv_ex(a))
    a.mul_(2)
    graph.replay()
    torch.testing.assert_close(inverse, torch.linalg.inv(a))
    assert int(info) == 0
    graph, (low, _) = cpu_capture(lambda: torch.linalg.cholesky_ex(a))
    torch.testing.assert_close(low, torch.linalg.cholesky(a))


def test_histc_without_a_range_is_a_host_sync() -> None:
    # CUDA's histc with min == max (the default) reads the tensor's min and max on the host.
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    with pytest.raises(HostSyncError, match="histc") as info:
        cpu_capture(lambda: torch.histc(x * 1, bins=4))
    assert "min < max" in str(info.value)
    with pytest.raises(HostSyncError, match="histc"):
        cpu_capture(lambda: torch.histc(x * 1, 4, 1, 1))
    graph, out = cpu_capture(lambda: torch.histc(x * 1, bins=4, min=0, max=4))
    x.fill_(0.5)
    graph.replay()
    assert out.tolist() == [4.0, 0.0, 0.0, 0.0]
