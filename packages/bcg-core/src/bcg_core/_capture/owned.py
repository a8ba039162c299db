"""Which tensors of a break's capture-time output nothing but that output holds.

At capture a break runs outside the graph's pool, and the tensors of its output that nobody
else can reach are copied into the pool (``bridges.copy_into_pool``): the original is dropped,
so no one can tell the copy from it, and the bridge costs what any graph intermediate costs.
Everything else (an argument returned as it is, a buffer or cache of the break's own, a view
of one, a tensor the break also stashed, one autograd saved) is held strongly, which is always
right: the capture-time tensor stays the one the code after the break reads.

"Nothing else holds it" is read from reference counts, right after the break returns, with the
output in a one-item list the capture hands over (no frame holds it: how many references a call
chain keeps depends on whether the interpreter inlines Python calls, which it stops doing once
torch.compile installs its frame evaluation hook):

- each output tensor's Python object is referenced only by the output structure (as many
  times as it occurs there) and by this module's walk;
- its ``TensorImpl`` only by that Python object and by the output's own views of it;
- its storage only by the output's tensors and by the dead bases of the output's views (a
  ``permute`` of a temporary keeps the temporary's ``TensorImpl``, which nothing else holds).

The counts these give differ between CPython and torch versions (borrowed references on the
stack, PyObject preservation), so they are not written down: the first call measures them on
probes of known ownership made the same way (:func:`_constants`) and checks the rule on probes
that must pass and probes that must fail. Where a check fails, or on a free-threaded
interpreter (whose counts other threads change), :func:`sole_owned` answers None and the
capture records the break's ops instead (``fresh.py``, about 9 us per op in the dispatch mode:
a third of a break's capture cost, which this check replaces with a few us per output).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bcg_core import _trees


@dataclass(frozen=True)
class _Counts:
    """Reference counts of one output tensor, read by :func:`_observe`."""

    refs: int  # sys.getrefcount of its Python object
    impl: int  # its TensorImpl's use count
    storage: int  # its storage's use count
    base_refs: int | None  # the same two for its view base (None: not a view)
    base_impl: int | None


@dataclass(frozen=True)
class _Rule:
    """The counts of a tensor nothing else holds, measured on probes (see :func:`_constants`)."""

    nested: int  # refs of a tensor occurring once in the output (or as the output, boxed)
    per_occurrence: int  # refs added by each further occurrence
    viewed: int  # refs added to a tensor that has views in the output
    impl: int  # TensorImpl count of a tensor with no views
    base_refs: int  # refs of a dead view base while the walk holds it
    base_impl: int  # its TensorImpl count beyond its views in the output
    storage: int  # storage count beyond the output's TensorImpls and dead bases


# How many references a TensorImpl and a storage have (torch's own, absent from its stubs).
_IMPL_COUNT: Callable[[torch.Tensor], int] | None = getattr(torch.Tensor, "_use_count", None)
_STORAGE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _impl_count(t: torch.Tensor) -> int:
    assert _IMPL_COUNT is not None  # _rule() is None without it
    return _IMPL_COUNT(t)


def _storage_count(storage: torch.UntypedStorage) -> int:
    assert _STORAGE_COUNT is not None
    return _STORAGE_COUNT(storage._cdata)


_RULE: list[_Rule | None] = []  # empty before the first call; [None] where the rule failed
_RULE_LOCK = threading.Lock()


def _observe(output: Any) -> list[tuple[torch.Tensor, _Counts]]:
    """Every tensor of ``output`` (once per occurrence) with its counts."""
    seen: list[tuple[torch.Tensor, _Counts]] = []
    for t in _trees.tensor_leaves(output):
        storage = t.untyped_storage()
        base = t._base
        seen.append(
            (
                t,
                _Counts(
                    sys.getrefcount(t),
                    _impl_count(t),
                    _storage_count(storage),
                    None if base is None else sys.getrefcount(base),
                    None if base is None else _impl_count(base),
                ),
            )
        )
        del storage, base
    return seen


def _counts_of(make: Callable[[], Any]) -> list[tuple[torch.Tensor, _Counts]]:
    return _observe([make()])  # boxed, as sole_owned's caller does


def _decided(make: Callable[[], Any], rule: _Rule) -> set[int]:
    return _judge(_observe([make()]), rule)


def _judge(seen: list[tuple[torch.Tensor, _Counts]], rule: _Rule) -> set[int]:
    """Storage pointers of ``seen`` that nothing but the output holds."""
    occurrences: dict[int, int] = {}
    first: dict[int, tuple[torch.Tensor, _Counts]] = {}
    for t, c in seen:
        occurrences[id(t)] = occurrences.get(id(t), 0) + 1
        first.setdefault(id(t), (t, c))
    groups: dict[int, list[tuple[torch.Tensor, _Counts]]] = {}
    for t, c in first.values():
        storage = t.untyped_storage()
        if storage.nbytes():
            groups.setdefault(storage.data_ptr(), []).append((t, c))
    return {ptr for ptr, group in groups.items() if _sole(group, occurrences, rule)}


def _sole(
    group: list[tuple[torch.Tensor, _Counts]], occurrences: dict[int, int], rule: _Rule
) -> bool:
    """Whether the output's tensors on one storage (``group``) are all that hold it."""
    members = {id(t) for t, _ in group}
    views: dict[int, int] = {}  # id of a base -> how many of the group's tensors view it
    dead = set()  # bases outside the group, held by the views alone (if the counts agree)
    for t, _ in group:
        base = t._base
        if base is not None:
            views[id(base)] = views.get(id(base), 0) + 1
            if id(base) not in members:
                dead.add(id(base))
    for t, c in group:
        n_views = views.get(id(t), 0)
        refs = rule.nested + rule.per_occurrence * (occurrences[id(t)] - 1)
        if n_views:
            refs += rule.viewed
        if c.refs != refs or c.impl != rule.impl + n_views:
            return False
        if c.storage != len(group) + len(dead) + rule.storage:
            return False
        base = t._base
        if (
            base is not None
            and id(base) in dead
            and (c.base_refs != rule.base_refs or c.base_impl != rule.base_impl + views[id(base)])
        ):
            return False
    return True


def _measure() -> _Rule | None:
    """The rule's counts from probes of known ownership, or None where the rule's own checks
    fail on this interpreter and torch."""

    def one() -> Any:
        return (torch.empty(4),)

    def twice() -> Any:
        p = torch.empty(4)
        return (p, p)

    def viewed() -> Any:
        p = torch.empty(4, 2)
        return (p, p[1:])

    def dead_base() -> Any:
        return (torch.empty(4, 2).t(),)

    def c(make: Callable[[], Any]) -> _Counts:
        return _counts_of(make)[0][1]

    nested = c(one)
    base = c(dead_base)
    if base.base_refs is None or base.base_impl is None:
        return None
    rule = _Rule(
        nested=nested.refs,
        per_occurrence=c(twice).refs - nested.refs,
        viewed=c(viewed).refs - nested.refs,
        impl=nested.impl,
        base_refs=base.base_refs,
        base_impl=base.base_impl - 1,
        storage=nested.storage - 1,
    )
    kept: list[torch.Tensor] = []

    def stashed() -> Any:  # the break keeps what it returns
        p = torch.empty(4)
        kept.append(p)
        return (p,)

    def view_kept() -> Any:  # a view of it lives elsewhere
        p = torch.empty(4)
        kept.append(p[1:])
        return (p,)

    def base_kept() -> Any:  # the base of the returned view lives elsewhere
        p = torch.empty(4, 2)
        kept.append(p)
        return (p.t(),)

    def two_views() -> Any:
        p = torch.empty(4, 2)
        return (p[1:], p[:2], p.t())

    def many() -> Any:
        p = torch.empty(4, 2)
        return {"a": [p, p[1:]], "b": (p.t(), torch.empty(3)), "c": p}

    must_pass = (lambda: torch.empty(4), one, twice, viewed, dead_base, two_views, many)
    must_fail = (stashed, view_kept, base_kept, lambda: kept[0], lambda: (kept[0],))
    for make in must_pass:
        want = {t.untyped_storage().data_ptr() for t in _trees.tensor_leaves(make())}
        got = _decided(make, rule)
        if len(got) != len(want):  # fresh probes: compare how many, not which addresses
            return None
    if any(_decided(make, rule) for make in must_fail):
        return None
    return rule


def _rule() -> _Rule | None:
    if _RULE:
        return _RULE[0]
    with _RULE_LOCK:
        if not _RULE:
            gil = getattr(sys, "_is_gil_enabled", lambda: True)()
            counted = _IMPL_COUNT is not None and _STORAGE_COUNT is not None
            _RULE.append(_measured_apart() if gil and counted else None)
        return _RULE[0]


def _measured_apart() -> _Rule | None:
    """:func:`_measure` on a new thread: the first call may come inside dispatch or function
    modes (a CPU capture's recorder, an integration's), grad or inference mode, all of them
    per thread, and a mode that keeps the probes' tensors would shift every count."""
    result: list[_Rule | None] = []

    def run() -> None:
        with torch.no_grad():
            result.append(_measure())

    thread = threading.Thread(target=run, name="bcg-owned-probes")
    thread.start()
    thread.join()
    return result[0] if result else None


def counts_tell() -> bool:
    """Whether :func:`sole_owned` answers on this interpreter and torch (measured once)."""
    return _rule() is not None


def sole_owned(box: list[Any], device: torch.device) -> Callable[[torch.Tensor], bool] | None:
    """A test for "this tensor of the output in ``box`` is on ``device`` and nothing else holds
    its storage", fixed now; None where reference counts cannot tell on this interpreter (the
    caller then records the break's ops instead).

    ``box`` is a one-item list holding the output, and the caller holds the output nowhere
    else (no local variable): a reference from a frame would be counted, and how many a call
    chain holds depends on whether the interpreter inlines Python calls (it stops doing so
    once torch.compile installs its frame evaluation hook)."""
    rule = _rule()
    if rule is None:
        return None
    sole = _judge(_observe(box), rule)

    def owned(t: torch.Tensor) -> bool:
        return t.device == device and t.untyped_storage().data_ptr() in sole

    return owned
