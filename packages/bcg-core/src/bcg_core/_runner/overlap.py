"""Arguments that share memory: a call where an argument the graph writes shares memory with
another argument, or with a tensor inside an object argument, cannot be served by a replay
(the runner copies each argument into a buffer of its own, so the graph would not see the write
through the other); the runner runs it eagerly.

Views of one storage are compared exactly, not by their byte ranges: ``cache[:, 0]`` and
``cache[:, 1]`` interleave without sharing an element (a paged K/V cache), and adjacent slices
touch without overlapping; both replay."""

from __future__ import annotations

from typing import NamedTuple

import torch

# Steps the exact test may take before it gives up and answers "they may overlap".
_BUDGET = 4096


class Layout(NamedTuple):
    """Where a tensor's elements lie: its storage, first byte, sizes, strides, element size."""

    storage: int
    start: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    itemsize: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Layout:
        return cls(
            t.untyped_storage().data_ptr(),
            t.data_ptr(),
            tuple(t.shape),
            t.stride(),
            t.element_size(),
        )

    def span(self) -> tuple[int, int] | None:
        """The bytes from the first element to past the last; None when it has no element."""
        if 0 in self.shape:
            return None
        last = sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        return self.start, self.start + (last + 1) * self.itemsize


class OverlapCheck:
    """For one captured signature: which written argument (positions ``written`` among the
    call's tensors in containers) shares memory with another argument or with one of
    ``inside`` (the tensors inside the call's objects, fixed by the signature: it keys them by
    address). The layout of the last call that passed is remembered, so a loop passing the same
    slices of one cache pays the exact test once."""

    __slots__ = ("_inside", "_inside_storages", "_passed", "_written")

    def __init__(self, written: tuple[int, ...], inside: list[torch.Tensor]) -> None:
        self._written = written
        self._inside = [Layout.of(t) for t in inside if t.numel()]
        self._inside_storages = {x.storage for x in self._inside}
        self._passed: tuple[tuple[int, tuple[int, ...]], ...] | None = None

    def find(self, live: list[torch.Tensor]) -> tuple[int, int] | None:
        """``(i, j)``: written argument ``i`` may share memory with argument ``j`` (``j >=
        len(live)``: with inside tensor ``j - len(live)``; ``j == i``: with itself, expanded);
        None when it shares none."""
        written = self._written
        if not written:
            return None
        for i in written:
            # An expanded argument (stride 0 along a dimension of 2 or more) has several
            # elements at one address: its dense buffer cannot show eager's write through all of
            # them, nor take it back (copy_ into it raised torch's raw "more than one element").
            t = live[i]
            if 0 in t.stride() and any(
                s == 0 and n > 1 for n, s in zip(t.shape, t.stride(), strict=True)
            ):
                return (i, i)
        storages = [t.untyped_storage().data_ptr() for t in live]
        mine = {storages[i] for i in written}
        members = [j for j, s in enumerate(storages) if s in mine]  # on a written storage
        if len(members) == len(mine) and mine.isdisjoint(self._inside_storages):
            return None  # the common case: each written argument alone on its storage
        key = tuple((live[j].data_ptr(), live[j].stride()) for j in members)
        if key == self._passed:
            return None
        layouts = {j: Layout.of(live[j]) for j in members}
        inside = [(len(live) + k, x) for k, x in enumerate(self._inside) if x.storage in mine]
        for i in written:
            a = layouts[i]
            others = [(j, b) for j, b in layouts.items() if j != i] + inside
            for j, b in others:
                if b.storage == a.storage and may_overlap(a, b):
                    return (i, j)
        self._passed = key
        return None


def may_overlap(a: Layout, b: Layout) -> bool:
    """Whether two views of one storage share an element; True where the test cannot tell
    (other element sizes, misaligned starts, too many ways to reach)."""
    sa, sb = a.span(), b.span()
    if sa is None or sb is None or sa[1] <= sb[0] or sb[1] <= sa[0]:
        return False
    if a.itemsize != b.itemsize or (b.start - a.start) % a.itemsize:
        return True
    # An element of a at a.start + sum(i_k * sa_k) is one of b at b.start + sum(j_k * sb_k) iff
    # sum(i_k * sa_k) - sum(j_k * sb_k) == (b.start - a.start) / itemsize: terms of one stride
    # each, a's coefficients in [0, n - 1], b's in [-(n - 1), 0].
    terms = [(s, 0, n - 1) for n, s in zip(a.shape, a.stride, strict=True) if n > 1 and s]
    terms += [(s, 1 - n, 0) for n, s in zip(b.shape, b.stride, strict=True) if n > 1 and s]
    terms.sort(reverse=True)
    reach = [0] * (len(terms) + 1)  # the most the terms from k on can add, either way
    for k in range(len(terms) - 1, -1, -1):
        s, lo, hi = terms[k]
        reach[k] = reach[k + 1] + s * max(-lo, hi)
    budget = [_BUDGET]

    def solvable(k: int, rest: int) -> bool:
        if k == len(terms):
            return rest == 0
        s, lo, hi = terms[k]
        first = max(lo, -((reach[k + 1] - rest) // s))  # ceil((rest - reach) / s), exactly
        last = min(hi, (rest + reach[k + 1]) // s)
        for c in range(first, last + 1):
            budget[0] -= 1
            if budget[0] < 0 or solvable(k + 1, rest - c * s):
                return True
        return False

    return solvable(0, (b.start - a.start) // a.itemsize)
