"""Repository-wide pytest set-up: the ``cuda`` marker skips cleanly on machines without a GPU."""

from __future__ import annotations

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
