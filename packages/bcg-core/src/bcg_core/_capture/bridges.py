"""Bridges: the capture-time outputs of a break, and copying fresh outputs into them at replay.

The next graph segment was captured reading the tensors a break returned at capture (the
*bridge*), and every replay copies the break's fresh output into them. At capture the break
runs outside the graph's pool, and the tensors its own ops made are then copied into the pool
(:func:`copy_into_pool`; the code after the break gets the copies): the bridge holds such a
copy through a non-owning alias (``_aliases.alias_tensor``), and the block behaves like any
intermediate of a monolithic graph. It stays allocated while the code
after the break holds the capture-time tensor, then returns to the pool for later allocations
of this capture or of other graphs sharing the pool (DESIGN.md, "Who may reuse a bridge's
memory"). A tensor that does not lie in the pool (a static buffer or parameter returned as it
is, memory from another allocator, a backend that cannot route) is held strongly, for the
graph's lifetime, as before.

Outputs are walked by ``_trees.py`` (tuples, lists, dicts, named tuples, dataclasses, plain
objects, registered pytree types). At replay the fresh output must have the capture-time
structure (types, dict keys, field names, lengths; tensors where tensors were): dicts are
matched by key, never by position, and any other difference raises :class:`BreakOutputError`
naming the break and the difference. Non-tensor values are part of the capture: later Python
code saw the capture-time value, so a ``None``, bool, number (numpy's too), string, enum,
dtype, device, bytes, set or numpy array returned directly in the structure (not inside a
dataclass or plain object, whose other state bcg cannot judge) must come back equal at every
replay (the capture's own object returned again is not judged), or the replay raises
:class:`BreakOutputError` instead of returning what the capture-time value computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from bcg_core import _trees
from bcg_core._capture.aliases import alias_tensor, has_memory_layout
from bcg_core._errors import BreakOutputError


def copy_into_pool(
    output: Any, made: Callable[[torch.Tensor], bool]
) -> tuple[Any, Callable[[torch.Tensor], bool]]:
    """``output`` with every tensor for which ``made`` holds (a break's own, fresh storage)
    replaced by a copy allocated now (the caller routes allocations to the graph's pool), and
    the test for "one of those copies".

    A storage is copied once, whole, and each tensor on it becomes the same view of the copy, so
    outputs that shared memory still do. Copied on their own, into a dense tensor of their
    values: a tensor that requires grad while grad mode is on (by an autograd-recorded
    ``copy_``, so the code after the break stays connected to the break's autograd graph), a
    lazily conjugated or negated view (a view of the copied bytes would drop the bit, and the
    values with it) and one whose storage is no whole number of its elements. Sparse and nested
    tensors are left as they are (held strongly).
    """
    copies: dict[int, torch.Tensor] = {}  # original storage pointer -> its copy, as bytes
    pooled: set[int] = set()

    def plain(t: torch.Tensor) -> bool:
        return type(t) is torch.Tensor and t.layout is torch.strided and not t.is_nested

    def move(t: torch.Tensor) -> torch.Tensor:
        if not plain(t) or not made(t):
            return t
        storage = t.untyped_storage()
        if (
            (t.requires_grad and torch.is_grad_enabled())
            or t.is_conj()
            or t.is_neg()
            or storage.nbytes() % t.element_size()
        ):
            alone = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            alone.copy_(t)  # recorded by autograd when t requires grad in grad mode
            pooled.add(alone.untyped_storage().data_ptr())
            return alone
        whole = copies.get(storage.data_ptr())
        if whole is None:
            source = torch.empty(0, dtype=torch.uint8, device=t.device)
            source.set_(storage, 0, (storage.nbytes(),), (1,))
            whole = copies[storage.data_ptr()] = source.clone()
            pooled.add(whole.data_ptr())
        return whole.view(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset())

    moved = _trees.map_tensors(output, move)
    return moved, lambda t: plain(t) and t.untyped_storage().data_ptr() in pooled


def contains_device_tensor(obj: Any, device_types: frozenset[str]) -> bool:
    return any(t.device.type in device_types for t in _trees.tensor_leaves(obj))


class Bridge:
    """The capture-time output of one break point, and the copy of fresh outputs into it.

    ``in_pool`` says which tensors lie in the graph's pool: those are held through non-owning
    aliases (the code after the break holds the owning tensors; see the module docstring), all
    others strongly. Without it every tensor is held strongly.
    """

    __slots__ = (
        "_flat",
        "_frozen",
        "_meta",
        "_name",
        "_pinned",
        "_same_if_identical",
        "_single",
        "_spec",
        "_twins",
        "output",
        "pooled",
    )

    def __init__(
        self,
        name: str,
        output: Any,
        in_pool: Callable[[torch.Tensor], bool] | None = None,
        arguments: Any = None,
    ) -> None:
        self._name = name
        pooled: list[torch.Tensor] = []
        if in_pool is not None:

            def hold(t: torch.Tensor) -> torch.Tensor:
                if not in_pool(t):
                    return t
                pooled.append(alias := alias_tensor(t))
                return alias

            output = _trees.map_tensors(output, hold)
        self.output = output
        # The aliases, which memory accounting counts in the pool, not as bridge memory.
        self.pooled = tuple(pooled)
        leaves, self._spec = _trees.flatten(output)
        self._refuse_unbridgeable(leaves, self._spec)
        # Fresh outputs are checked against metadata read once: nothing else reaches the
        # bridge's tensors, so their shape, dtype and address never change.
        # An expanded output (stride 0 along some dimensions: a broadcast mask, positions)
        # is written through its first element along those dimensions.
        self._meta = [
            (d, d.shape, d.dtype, d.data_ptr(), self._repeated_dims(d, i))
            for i, d in enumerate(x for x in leaves if isinstance(x, torch.Tensor))
        ]
        self._single = isinstance(output, torch.Tensor)
        # Outputs whose memory at capture was an argument's: the code after the break reads it
        # as both, so a replay may not copy a fresh tensor there. Outputs sharing one storage
        # (a tensor returned twice, views of one another): a replay must return them on one
        # storage, at the same offsets and strides, again (copying separate tensors into
        # overlapping bridges would overwrite one with the other).
        self._pinned, self._twins = _shared_memory(self._meta, arguments)
        # The plain values later code saw (leaf index, value): a replay must return them again.
        self._frozen = tuple(
            (i, x)
            for i, (x, inside) in enumerate(zip(leaves, _trees.in_object(self._spec), strict=True))
            if _trees.is_plain_value(x) and not inside
        )
        # A flat tuple or list (transformers' attention returns ``(out, None)``) is matched by
        # position, without flattening: its type and which positions hold tensors, read once.
        self._flat: tuple[type, tuple[bool, ...]] | None = None
        if type(output) in (tuple, list) and all(
            isinstance(x, torch.Tensor) or type(x) in _trees.PLAIN_VALUES for x in output
        ):
            self._flat = (type(output), tuple(isinstance(x, torch.Tensor) for x in output))
        # The same object back again is the same output only when it cannot have changed: a
        # tensor, a plain value, or a flat tuple of those. A list, dict or object returned
        # again may hold other tensors (a metadata object whose fields the break rebinds).
        self._same_if_identical = (
            self._single
            or type(output) in _trees.PLAIN_VALUES
            or (self._flat is not None and self._flat[0] is tuple)
        )

    def _refuse_unbridgeable(self, leaves: list[Any], spec: _trees.TreeSpec) -> None:
        """A sparse or nested tensor has no fixed memory that a replay could copy its new
        values into (its number of elements, its indices, its parts may change), a quantized
        tensor's scale is not in its memory, and tensors in a set or container subclass are not
        reached by the walk: refused by
        path (reading its address raised torch's raw internal error), at capture and at
        replay (``leaves`` and ``spec`` of the output then)."""
        for path, x in zip(_trees.key_paths(spec, "output"), leaves, strict=True):
            if _trees.hides_tensors(x):
                # Tensors the walk does not reach are not bridged: the code after the break
                # read the capture's ones at every replay (a list subclass: silently stale).
                raise BreakOutputError(
                    f"break {self._name!r} returned {path}, a {type(x).__qualname__} holding "
                    "tensors; bcg does not look into it, so a replay could not copy its new "
                    "tensors where the code after the break reads them. Return them in a "
                    "list, tuple, dict, named tuple or dataclass."
                )
            if isinstance(x, torch.Tensor) and x.is_quantized:
                # Its scale and zero point are no part of the memory a replay copies into: a
                # replay returning another scale was read with the capture's, silently wrong.
                raise BreakOutputError(
                    f"break {self._name!r} returned {path} (a quantized tensor); a replay "
                    "copies a break's new values into the capture's tensor, whose scale and "
                    "zero point would stay the capture's. Return x.dequantize(), or "
                    "x.int_repr() with its scale and zero point as tensors."
                )
            if isinstance(x, torch.Tensor) and not has_memory_layout(x):
                kind = "nested" if x.is_nested else f"{x.layout} (sparse)".replace("torch.", "")
                raise BreakOutputError(
                    f"break {self._name!r} returned {path} (a {kind} tensor); a break's tensor "
                    "outputs are copied into fixed memory at every replay, which only a dense "
                    "(strided) tensor has. Return its dense form (.to_dense(), or the nested "
                    "tensor's .unbind() parts), or its values and indices as dense tensors."
                )

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(m[0] for m in self._meta)

    @property
    def trivial(self) -> bool:
        """The capture-time output was None: a replay only checks that it still is."""
        return self.output is None

    def update(self, fresh: Any) -> None:
        """Copy ``fresh`` (the break's output at replay) into the bridge: one batched copy for
        several tensors; nothing for tensors that already live at the bridge's addresses.
        An output without tensors is checked all the same (its structure and plain values)."""
        if fresh is self.output and self._same_if_identical:
            return
        if not self._meta:
            self._match(fresh)  # raises for another structure or another plain value
            return
        # Copies into the bridge are data movement, never part of an autograd graph. Entering
        # no_grad costs twice the copy's launch; setting the mode directly a fraction of it.
        grad = torch.is_grad_enabled()
        if grad:
            torch._C._set_grad_enabled(False)
        try:
            self._update(fresh)
        except (RuntimeError, NotImplementedError):
            # Checked only once a copy failed (nothing is added to a replay that works): a
            # sparse or nested tensor at replay raised torch's raw "Cannot access data pointer
            # of Tensor that doesn't have storage" or "NestedTensorImpl doesn't support sizes".
            self._refuse_unbridgeable(*_trees.flatten(fresh))
            raise
        finally:
            if grad:
                torch._C._set_grad_enabled(True)

    def _update(self, fresh: Any) -> None:
        src: list[torch.Tensor] | None
        if self._single and isinstance(fresh, torch.Tensor):
            src = [fresh]
        else:
            src = self._match_flat(fresh) if self._flat is not None else None
        if src is None:
            src = self._match(fresh)
        meta = self._meta
        if len(meta) == 1:  # the common case, without building lists: 0.7 us less per break
            d, shape, dtype, ptr, repeated = meta[0]
            one = src[0]
            if one.shape != shape or one.dtype != dtype:
                self._check(d, one, self._tensor_paths()[0])  # raises with the details
            if one.data_ptr() != ptr or not _same_memory(d, one):
                if self._pinned:
                    self._refuse(0)
                if repeated:
                    d, one = self._first_elements(d, one, repeated, 0)
                d.copy_(one)
            return
        for group in self._twins:
            if not _same_relation(src, group):
                self._refuse(group[0][1])
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for i, ((d, shape, dtype, ptr, repeated), t) in enumerate(zip(meta, src, strict=True)):
            if t.shape != shape or t.dtype != dtype:
                self._check(d, t, self._tensor_paths()[i])
            if t.data_ptr() != ptr or not _same_memory(d, t):
                if i in self._pinned:
                    self._refuse(i)
                if repeated:
                    d, t = self._first_elements(d, t, repeated, i)
                dsts.append(d)
                srcs.append(t)
        if len(dsts) == 1:
            dsts[0].copy_(srcs[0])
        elif dsts:
            torch._foreach_copy_(dsts, srcs)

    def _match_flat(self, fresh: Any) -> list[torch.Tensor] | None:
        """The tensors of a fresh flat tuple or list shaped like the capture's, or None (then
        :meth:`_match` decides, and names any difference)."""
        assert self._flat is not None
        kind, tensors = self._flat
        if type(fresh) is not kind:
            return None
        items = cast("Sequence[Any]", fresh)  # a tuple or a list: its type was just checked
        if len(items) != len(tensors):
            return None
        out = []
        for x, is_tensor in zip(items, tensors, strict=True):
            if is_tensor:
                if not isinstance(x, torch.Tensor):
                    return None
                out.append(x)
            elif type(x) not in _trees.PLAIN_VALUES:
                return None
        if self._frozen:  # the flat output's leaves are its items
            self._check_frozen(items)
        return out

    def _match(self, fresh: Any) -> list[torch.Tensor]:
        """The fresh output's tensors in the bridge's order, matched by structure (and dicts
        by key); raises :class:`BreakOutputError` when the structure changed."""
        leaves, spec = _trees.flatten(fresh)
        if spec == self._spec:
            self._check_frozen(leaves)
            return [x for x in leaves if isinstance(x, torch.Tensor)]
        if _trees.same_up_to_key_order(spec, self._spec):
            by_path = dict(zip(_trees.key_paths(spec, "output"), leaves, strict=True))
            self._check_frozen([by_path[p] for p in _trees.key_paths(self._spec, "output")])
            return [by_path[p] for p in self._tensor_paths()]
        where = _trees.difference(spec, self._spec)
        count = sum(isinstance(x, torch.Tensor) for x in leaves)
        what = (
            f"{count} tensors at replay but {len(self._meta)} at capture"
            if count != len(self._meta)
            else "another structure at replay than at capture"
        )
        raise BreakOutputError(
            f"break {self._name!r} returned {what}: {where} at capture. A break must return "
            "the same structure every time (same container types, dict keys, fields and "
            "lengths, tensors where tensors were)."
        )

    def _check_frozen(self, leaves: Sequence[Any]) -> None:
        """Raise when a plain value in ``leaves`` (in the capture's leaf order) differs from
        the capture-time one that the code after the break was captured with."""
        for i, want in self._frozen:
            got = leaves[i]
            if got is want or _trees.same_value(got, want):  # `is`: None, small ints, bools
                continue
            where = _trees.key_paths(self._spec, "output")[i]
            raise BreakOutputError(
                f"break {self._name!r}: {where} is {got!r} at replay but was {want!r} at "
                "capture, and the code after the break was captured with the capture-time "
                "value, so this replay would compute with the stale one. Return the value as "
                "a tensor (it is then bridged), or capture a graph per value (a runner keys "
                "graphs on its call's plain arguments)."
            )

    def _tensor_paths(self) -> list[str]:
        paths = _trees.key_paths(self._spec, "output")
        leaves, _ = _trees.flatten(self.output)
        return [p for p, x in zip(paths, leaves, strict=True) if isinstance(x, torch.Tensor)]

    def _repeated_dims(self, d: torch.Tensor, index: int) -> tuple[int, ...]:
        """The dimensions along which ``d`` repeats one element (stride 0), when its elements
        overlap in memory that way; raises :class:`BreakOutputError` for any other overlap,
        which no copy can write."""
        if torch._debug_has_internal_overlap(d) != 1:  # 0: none, 2: too costly to tell
            return ()
        sizes = zip(d.shape, d.stride(), strict=True)
        dims = tuple(i for i, (n, stride) in enumerate(sizes) if stride == 0 and n > 1)
        if torch._debug_has_internal_overlap(_first(d, dims)) == 1:
            raise BreakOutputError(
                f"break {self._name!r}: {self._tensor_paths()[index]} has elements that share "
                "memory (other than an expanded dimension), so a replay cannot copy its new "
                "values into it; return a .contiguous() tensor"
            )
        return dims

    def _first_elements(
        self, d: torch.Tensor, s: torch.Tensor, dims: tuple[int, ...], index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``d`` and ``s`` narrowed to the first element along the dimensions ``d`` repeats;
        ``s`` must repeat them too (else its values along them would be lost)."""
        if any(s.stride(i) != 0 for i in dims):
            raise BreakOutputError(
                f"break {self._name!r}: {self._tensor_paths()[index]} was expanded at capture "
                f"(repeated along dimensions {list(dims)}) but not at replay, so its new values "
                "do not fit the tensors the next segment reads; return the same layout every "
                "time (for example a .contiguous() tensor)"
            )
        return _first(d, dims), _first(s, dims)

    def _refuse(self, i: int) -> None:
        raise BreakOutputError(
            f"break {self._name!r}: {self._tensor_paths()[i]} was, at capture, memory the "
            "break shared with one of its arguments or another of its outputs (it returned an "
            "argument, one tensor twice, or views of one tensor), and at replay it is another "
            "tensor; the code after the break reads that memory for both, so copying it there "
            "would overwrite the other. Return the same kind of result every call: a new "
            "tensor (y.clone() where nothing changes), or the argument, written in place."
        )

    def _check(self, d: torch.Tensor, s: torch.Tensor, where: str) -> None:
        if d.shape != s.shape or d.dtype != s.dtype:
            raise BreakOutputError(
                f"break {self._name!r}: {where} is {tuple(s.shape)} {s.dtype} at replay "
                f"but was {tuple(d.shape)} {d.dtype} at capture; capture a graph per shape"
            )


# A group of outputs on one storage: their indices, and each one's (offset in bytes from the
# first one's address, strides).
_Group = tuple[tuple[int, ...], tuple[tuple[int, tuple[int, ...]], ...]]


def _shared_memory(meta: list[Any], arguments: Any) -> tuple[frozenset[int], tuple[_Group, ...]]:
    """Indices of output tensors on an argument's storage, and groups of output tensors on one
    storage (one tensor returned twice, or views of one another: ``(y, y[1:])``)."""
    taken = {
        t.untyped_storage().data_ptr()
        for t in _trees.flatten(arguments)[0]
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and has_memory_layout(t)
    }
    pinned = frozenset(i for i, m in enumerate(meta) if m[0].untyped_storage().data_ptr() in taken)
    by_storage: dict[int, list[int]] = {}
    for i, m in enumerate(meta):
        ptr = m[0].untyped_storage().data_ptr()
        # An empty storage shares nothing, nor does an empty tensor (`y[1:]` of one row), whose
        # data_ptr() is 0: its offset from the group's first tensor changed at every replay.
        if ptr and m[0].numel():
            by_storage.setdefault(ptr, []).append(i)
    groups = []
    for members in by_storage.values():
        if len(members) > 1:
            base = meta[members[0]][0].data_ptr()
            layout = tuple((meta[i][0].data_ptr() - base, meta[i][0].stride()) for i in members)
            groups.append((tuple(members), layout))
    return pinned, tuple(groups)


def _same_relation(src: list[torch.Tensor], group: _Group) -> bool:
    """Whether the fresh tensors of a group lie on one storage as the capture's did."""
    members, layout = group
    first = src[members[0]]
    storage, base = first.untyped_storage().data_ptr(), first.data_ptr()
    return all(
        src[i].untyped_storage().data_ptr() == storage
        and src[i].data_ptr() - base == offset
        and src[i].stride() == strides
        for i, (offset, strides) in zip(members, layout, strict=True)
    )


def _first(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    for i in dims:
        t = t.narrow(i, 0, 1)
    return t


def _same_memory(d: torch.Tensor, s: torch.Tensor) -> bool:
    return d.data_ptr() == s.data_ptr() and d.stride() == s.stride() and d.device == s.device
