"""Holes a second review of the diagnostics (check_divergence and its report, signatures and
describe_difference, the ``bcg`` command) found on the CPU backend: each was a wrong or unclear
report, or a raw error, and is now right or said clearly."""

from __future__ import annotations

import math

import torch

from bcg_core import check_divergence, eager_on_graph


@eager_on_graph
def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    return _plus_one(x) * scale  # the scale is baked into the segment after the break


def test_max_abs_diff_is_true_where_values_are_infinite_or_nan() -> None:
    # nan_to_num turned an infinite gap into the largest float (1.798e+308), and an infinity
    # equal on both sides (inf - inf is NaN) into an infinite gap.
    x = torch.tensor([1.0, math.inf])
    report = check_divergence(_scaled, [(x, 1.0), (x, 2.0)], backend="cpu")
    assert report.status == "diverged"
    (diff,) = report.diffs
    assert diff.max_abs_diff == 2.0  # eager [4, inf], replay [2, inf]
    assert "= 2" in diff.detail

    x = torch.tensor([1.0, -1.0])
    report = check_divergence(_scaled, [(x, 1.0), (x, math.nan)], backend="cpu")
    (diff,) = report.diffs  # eager NaN, replay a number: inf, as TensorDiff documents
    assert diff.max_abs_diff == math.inf
    assert "= inf" in diff.detail
    with_tolerance = check_divergence(_scaled, [(x, 1.0), (x, math.nan)], backend="cpu", atol=0.1)
    assert with_tolerance.diffs[0].max_abs_diff == math.inf

    y = torch.tensor([1.0, 2.0])
    report = check_divergence(_scaled, [(y, 1.0), (y, math.inf)], backend="cpu")
    assert report.diffs[0].max_abs_diff == math.inf  # eager inf, replay a number
