"""Arguments that share memory: a call where an argument the graph writes shares memory with
another argument cannot be served by a replay (the runner copies each argument into a buffer
of its own, so the graph would not see the write through the other); the runner runs it
eagerly."""

from __future__ import annotations

import torch


def written_overlap(live: list[torch.Tensor], written: tuple[int, ...]) -> tuple[int, int] | None:
    """The first ``(i, j)``: argument ``i`` is written by the graph and may share memory with
    argument ``j``; None when every written argument has memory of its own."""
    if not written or len(live) < 2:
        return None
    storages = [t.untyped_storage().data_ptr() for t in live]
    if len(set(storages)) == len(storages):
        return None  # the common case: every argument its own storage
    for i in written:
        for j, storage in enumerate(storages):
            if j != i and storage == storages[i] and _spans_meet(live[i], live[j]):
                return (i, j)
    return None


def _spans_meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges ``a`` and ``b`` reach overlap (interleaved views count)."""
    sa, sb = _span(a), _span(b)
    return sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    if t.numel() == 0:
        return None
    start = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()
