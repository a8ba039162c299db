"""Bitwise tensor equality, the one definition used by the CPU recorder and the divergence check.

``torch.equal`` treats NaN as unequal to itself and -0.0 as equal to 0.0; comparing integer views
of the same bytes makes a replay that reproduces eager's bits (NaNs included) equal, and nothing
else.
"""

from __future__ import annotations

import torch

_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same shape and dtype and the same bits."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    view = _INT_VIEWS.get(a.element_size()) if a.dtype is not torch.bool else None
    if view is None:
        return torch.equal(a, b)
    return torch.equal(a.view(view), b.view(view))
