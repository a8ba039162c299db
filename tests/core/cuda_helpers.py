"""Helpers shared by the CUDA test modules of tests/core."""

from __future__ import annotations

import torch

from bcg_core import is_breakable_capture_active
from bcg_core._capture.streams import hooks_installed  # noqa: PLC2701


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random data drawn on the CPU and moved to the GPU: the values depend on the seed only."""
    return torch.randn(*shape, dtype=dtype).to("cuda")


def refresh(*static: torch.Tensor) -> None:
    """Copy fresh random data into static input buffers."""
    for t in static:
        t.copy_(randn(*t.shape, dtype=t.dtype))


def assert_idle() -> None:
    """No capture in this context, no stream hooks, the default stream current, not capturing."""
    assert not is_breakable_capture_active()
    assert not hooks_installed()
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream().cuda_stream == torch.cuda.default_stream().cuda_stream
