"""Repository-wide pytest set-up: the ``cuda`` marker skips cleanly on machines without a GPU,
and the ``device`` fixture runs a scenario on the CPU graph backend and, where a GPU is
present, on CUDA graphs, with the same assertions."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

_NO_CUDA = "needs a CUDA GPU and none is available here; run tools/device_tests.sh on a GPU machine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=_NO_CUDA)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> Iterator[str]:
    """Shared scenarios run on both backends: tensors are created on the parametrised device
    (torch's default device), and ``graph_helpers.device_graph()`` picks the matching backend."""
    param: str = request.param
    if param == "cuda":
        # Library handles (cuBLAS, cuBLASLt, attention) must exist before a capture, as with
        # any CUDA graph: creating one inside a capture fails.
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.ones(1, 1, 8, 8, device="cuda", dtype=dtype)
            (a @ a).sum()
            torch.nn.functional.scaled_dot_product_attention(a, a, a)
        torch.cuda.synchronize()
    torch.set_default_device(param)
    try:
        yield param
    finally:
        torch.set_default_device(None)
