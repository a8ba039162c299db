"""The device index the CUDA backend reads from whatever names a device (no GPU needed when the
name carries an index: only an index-less name asks torch for the current device)."""

from __future__ import annotations

import pytest
import torch

from bcg_core._backends.cuda_pool import device_index  # noqa: PLC2701 (the helper itself)


@pytest.mark.parametrize(
    ("device", "index"),
    [(0, 0), (3, 3), (torch.device("cuda", 2), 2), ("cuda:1", 1), (torch.device("cuda:5"), 5)],
)
def test_an_indexed_device_is_read_without_cuda(device: object, index: int) -> None:
    assert device_index(device) == index


@pytest.mark.cuda
def test_an_index_less_device_is_the_current_one() -> None:
    assert device_index("cuda") == torch.cuda.current_device()
    assert device_index(torch.device("cuda")) == torch.cuda.current_device()
