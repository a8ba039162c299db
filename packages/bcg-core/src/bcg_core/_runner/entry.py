"""One captured signature of a runner: its graph, static inputs and output, and the per-call
work of a replay precomputed at capture (which inputs are copied, which filled, how the output
is cloned)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bcg_core import _trees
from bcg_core._capture.graph import BreakableCUDAGraph
from bcg_core._runner.overlap import OverlapCheck
from bcg_core._signature import (
    FEW_COPIES,
    call_objects,
    copy_all,
    copy_unless_same,
    walked_signature,
)


def _cloner(output: Any, passed: frozenset[int]) -> Callable[[], Any]:
    """A callable returning a copy of ``output`` with every tensor cloned (types kept), except
    in the objects whose ids are in ``passed`` (objects the call passed in, such as a cache,
    which come back as themselves, as eager returns them)."""
    if isinstance(output, torch.Tensor):
        return output.clone
    return lambda: _trees.map_tensors(output, torch.Tensor.clone, keep=passed)


# A view of a static buffer: its size, strides, storage offset from the buffer's start (in its
# own elements), its dtype where it differs from the buffer's (`x.view(torch.int32)`,
# `torch.view_as_real(x)`: a view all the same, whose writes eager's caller sees), and whether
# its lazy conjugate and negative bits differ from the buffer's (`x.conj()`, `x.conj().imag`:
# the same memory read conjugated or negated; taken without the bits, the view returned the
# argument's values unconjugated).
_View = tuple[tuple[int, ...], tuple[int, ...], int, torch.dtype | None, bool, bool]


def _view_in(t: torch.Tensor, buf: torch.Tensor) -> _View | None:
    """``t`` as a view of ``buf``'s elements, or None: only of a contiguous buffer, wholly
    within it (the same view of a caller's tensor laid out alike then holds the same
    elements)."""
    if t.device != buf.device or not buf.is_contiguous():
        return None
    size = t.element_size()
    start = t.storage_offset() * size - buf.storage_offset() * buf.element_size()
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    if start < 0 or start % size or start + span * size > buf.numel() * buf.element_size():
        return None
    return (
        tuple(t.shape),
        t.stride(),
        start // size,
        None if t.dtype == buf.dtype else t.dtype,
        t.is_conj() != buf.is_conj(),
        t.is_neg() != buf.is_neg(),
    )


def _none_is_its_buffer(live: list[torch.Tensor], ptrs: tuple[int, ...]) -> bool:
    # A loop, not all(...) over a generator: this runs before every replay's first launch.
    for t, ptr in zip(live, ptrs, strict=True):  # noqa: SIM110
        if t.data_ptr() == ptr:
            return False
    return True


@dataclass
class Entry:
    """A captured signature.

    ``statics`` are the static buffers of the call's tensors in containers, in signature walk
    order; ``scalars`` the 0-dim buffers of lifted Python numbers. At each call a live tensor
    is copied into its buffer (``copy_all``: one ``copy_`` each for a few, one batched
    ``_foreach_copy_`` for more; skipped when it already is the buffer), except those at the
    positions in ``fill`` (0-dim CPU tensors whose buffer lives on a device): they are written
    with ``fill_``, which passes the value as a kernel argument, where a host-to-device copy
    would synchronise the stream. The buffers at the positions in ``written`` are the arguments
    the graph writes in place (their version counters moved during the capture): after each
    replay they are copied back into the caller's tensors (:meth:`store`), so an in-place update
    is never lost. ``watched`` pairs the tensors a break receives at replay with the index of
    the other buffer they lie in: a break may write an argument at a replay that it did not
    write at capture (it re-reads host state), and a replay bumps no version counter but a
    break's, so a moved one is copied back too (:meth:`store`). ``inference`` is whether the
    capture ran in inference mode: replays run in the same mode. ``autocast``: the autocast
    state of the capture (None: off); a call under another one runs eagerly. ``training``:
    the wrapped module's ``training`` flag at capture (None: the runner wraps no module); a
    call in the other mode runs eagerly. ``keywords``: the order of the keywords the step's
    ``**kwargs`` received at capture, when two or more did (None otherwise); a call passing
    them in another order runs eagerly.
    ``passed``: the ids of objects (dataclasses, plain objects: a cache) that
    the call passed in and the output holds; a clone of the output returns them as themselves.
    ``overlap`` tells the calls whose written argument shares memory with another (they run
    eagerly). ``objects``: the dataclasses and plain objects of the capture's call (the graph
    and its breaks read them, not the ones a later call passes; see :meth:`stale_object`).
    ``returned``: the output tensors that are static buffers or views of one (the step returned
    an argument, or ``x[1:]``, ``x.t()`` of one), by id, with the argument's index and the view
    (None: the buffer itself); the caller's tensor, or the same view of it, is returned there.
    ``output`` never requires grad (detached at capture): a replay serves
    inference, and autograd history from the capture would point at overwritten memory.
    """

    graph: BreakableCUDAGraph
    statics: list[torch.Tensor]
    fill: tuple[int, ...]
    scalars: list[torch.Tensor]
    output: Any
    static_call: tuple[tuple[Any, ...], dict[str, Any]]
    keep_alive: list[Any]
    capture_runs: int
    capture_ms: float
    pool_bytes: int | None
    written: tuple[int, ...] = ()
    inference: bool = False
    autocast: tuple[Any, ...] | None = None
    passed: frozenset[int] = frozenset()
    overlap: OverlapCheck = field(default_factory=lambda: OverlapCheck((), []))
    watched: tuple[tuple[torch.Tensor, int], ...] = ()
    objects: tuple[Any, ...] = ()
    training: bool | None = None
    keywords: tuple[str, ...] | None = None
    replays: int = 0
    warmup_ms: float = 0.0
    _copy: tuple[int, ...] = field(init=False)
    _copy_dst: list[torch.Tensor] = field(init=False)
    _inputs: bool = field(init=False)
    _only_copies: bool = field(init=False)
    _few_copies: bool = field(init=False)
    _dst_ptrs: tuple[int, ...] = field(init=False)
    clone: Callable[[], Any] = field(init=False)
    returned: dict[int, tuple[int, _View | None]] = field(init=False)

    def __post_init__(self) -> None:
        self._copy = tuple(i for i in range(len(self.statics)) if i not in self.fill)
        self._copy_dst = [self.statics[i] for i in self._copy]
        self._inputs = bool(self.statics or self.scalars)
        self._only_copies = bool(self.statics) and not self.fill and not self.scalars
        self._few_copies = self._only_copies and len(self.statics) <= FEW_COPIES
        self._dst_ptrs = tuple(t.data_ptr() for t in self.statics)
        self.clone = _cloner(self.output, self.passed)
        # Output tensors that are static buffers (the step returned its argument, `x.add_(1)`
        # returns x): by id, the argument's index; a call returns the caller's tensor there.
        ids = {id(t): i for i, t in enumerate(self.statics)}
        storages = {t.untyped_storage().data_ptr(): i for i, t in enumerate(self.statics)}
        self.returned = {}
        for t in _trees.tensor_leaves(self.output):
            if id(t) in ids:
                self.returned[id(t)] = (ids[id(t)], None)
                continue
            i = storages.get(t.untyped_storage().data_ptr()) if t.numel() else None
            view = None if i is None else _view_in(t, self.statics[i])
            if i is not None and view is not None:
                self.returned[id(t)] = (i, view)

    def load(self, live: list[torch.Tensor], values: list[bool | int | float]) -> None:
        """Write one call's inputs into the static buffers."""
        if not self._inputs:  # a step without tensor or number arguments
            return
        if self._few_copies and not torch.is_grad_enabled():
            # copy_all's small case written out: a decode step's few inputs in the fewest
            # frames, since a call starts with the host behind the device and each step here
            # delays the replay. (copy_ itself skips a source that views its buffer's very
            # memory, and records nothing without grad.)
            for buf, t in zip(self.statics, live, strict=True):
                buf.copy_(t)
            return
        if self._only_copies and _none_is_its_buffer(live, self._dst_ptrs):
            # The serving case (every input a fresh device tensor) in the fewest steps: a call
            # starts with the host behind the device, so each step here delays the replay.
            copy_all(self.statics, live)
            return
        statics = self.statics
        copy_unless_same(self._copy_dst, [live[i] for i in self._copy])
        for i in self.fill:
            statics[i].fill_(live[i].item())
        for buf, value in zip(self.scalars, values, strict=True):
            buf.fill_(value)

    def stale_object(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The first object of the capture that a call of this signature does not pass itself
        and that no longer has the signature of the one it passes, or None.

        An object argument is keyed by its contents, and the graph's breaks read the capture's
        object at every replay: a call passing another, equal object replays right only while
        the capture's one still equals it (an engine alternating two metadata objects changes
        one while passing the other)."""
        for mine, theirs in zip(self.objects, call_objects(args, kwargs), strict=True):
            if mine is not theirs and (
                walked_signature((mine,), {})[0] != walked_signature((theirs,), {})[0]
            ):
                return mine
        return None

    def output_for(self, live: list[torch.Tensor], views: bool) -> Any:
        """The output of a call that passed ``live``, for an entry whose step returns an argument
        or a view of one (:attr:`returned`): the caller's tensor where the step returned it, the
        same view of it where it returned a view, as eager gives them back (a clone of the
        buffer missed writes through the result); the other tensors cloned, or the static ones
        with ``views``. A view in another dtype is taken through a ``view(dtype)`` of the
        caller's bytes. A view is cloned too where the caller's tensor is not laid out as its
        buffer (another device, a non-contiguous argument, bytes misaligned for the view's
        dtype, a conjugated or negated argument viewed in another dtype): no view of it holds
        the same elements. A view's lazy conjugate and negative bits (``x.conj()``) are
        applied to the caller's tensor as the step applied them to the buffer."""
        returned, statics = self.returned, self.statics

        def leaf(t: torch.Tensor) -> torch.Tensor:
            found = returned.get(id(t))
            if found is not None:
                i, view = found
                src = live[i]
                if view is None:
                    return src
                buf = statics[i]
                if (
                    src.device == buf.device
                    and src.dtype == buf.dtype
                    and src.shape == buf.shape
                    and src.is_contiguous()
                ):
                    size, stride, offset, dtype, conj, neg = view
                    if dtype is not None:  # through the bytes: view(dtype) of a 1-d tensor
                        if src.is_conj() or src.is_neg():
                            # its bytes are not the buffer's (torch refuses such a view)
                            return t if views else t.clone()
                        src = src.reshape(-1).view(torch.uint8)
                        n = torch.empty((), dtype=dtype).element_size()
                        if src.storage_offset() % n or src.numel() % n:
                            return t if views else t.clone()
                        src = src.view(dtype)
                    out = src.as_strided(size, stride, src.storage_offset() + offset)
                    if conj:  # each toggles the caller's bit as the step toggled the buffer's
                        out = out.conj()
                    if neg:
                        out = torch._neg_view(out)
                    return out
            return t if views else t.clone()

        return _trees.map_tensors(self.output, leaf, keep=self.passed)

    def writes_grad(self, live: list[torch.Tensor]) -> bool:
        """Whether an argument the graph writes requires grad. Called in grad mode only: eager
        then raises for a leaf (an in-place write of a leaf that requires grad) and records the
        write for any other, while a replay writes its buffer, which requires no grad, and
        copies it back under ``no_grad``: such a call runs eagerly."""
        return any(live[i].requires_grad for i in self.written)

    def watched_versions(self) -> list[int]:
        """The version counters of the :attr:`watched` tensors, taken before a replay."""
        return [t._version for t, _ in self.watched]

    def store(self, live: list[torch.Tensor], versions: list[int] | None = None) -> None:
        """Copy the buffers the graph wrote back into the caller's tensors: the ``written``
        ones, and the watched ones a break wrote since ``versions`` were taken."""
        copied = self.written
        if versions is not None:
            moved = {i for (t, i), v in zip(self.watched, versions, strict=True) if t._version != v}
            if moved:
                copied = tuple(sorted(moved.union(copied)))
        if copied:
            statics = self.statics
            copy_unless_same([live[i] for i in copied], [statics[i] for i in copied])
