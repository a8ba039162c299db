"""Holes a review of the public capture API and the runner found, on the CPU backend
(2026-12-05): each was a crash with an unclear error, a silently wrong result, or capture state
left behind, and is now right or a clear error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    is_breakable_capture_active,
)


@eager_on_graph(name="rh.strict", strict=True)
def _strict_returning(t: torch.Tensor) -> torch.Tensor:
    return t * 2  # refused: a strict break returns no device tensor


@eager_on_graph(name="rh.transpose")
def _transpose_in_place(t: torch.Tensor) -> torch.Tensor:
    t.t_()  # refused: changes an argument's layout in place
    return t * 2


@eager_on_graph(name="rh.plain")
def _plain(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _refuse_barrier() -> None:
    raise BreakableGraphError("barrier refused")


_REFUSALS: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[], None] | None]] = {
    "strict output": (_strict_returning, None),
    "layout changed": (_transpose_in_place, None),
    "barrier raised": (_plain, _refuse_barrier),
}


@pytest.mark.parametrize("refusal", sorted(_REFUSALS))
def test_code_catching_a_refused_break_goes_on_capturing(refusal: str) -> None:
    # A break that raises leaves the capture in a new segment; one that bcg refused after it
    # ran (or whose barrier raised) left none: the fallback's ops were not recorded and the
    # capture's exit failed an internal assertion ("end_segment() outside a segment").
    fn, barrier = _REFUSALS[refusal]
    x = torch.randn(3, 3)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph, barrier_fn=barrier):
        try:
            y = fn(x + 1)
        except BreakableGraphError:
            y = (x + 1) * 3  # the fallback, captured
        out = y + 1
    assert not is_breakable_capture_active()
    for _ in range(2):
        x.copy_(torch.randn(3, 3))
        graph.replay()
        assert torch.equal(out, (x + 1) * 3 + 1)
