"""Which storages the ops of a block created: the tensors a break made at capture.

The debug check uses this record to name tensors a break made and kept without returning them
(``debug.py``). Where reference counts cannot tell which outputs nothing else holds
(``owned.py``: a free-threaded interpreter, or one whose counts the probes do not confirm), a
capture also uses it to choose the outputs copied into the pool: those whose storage one of the
break's ops created. It costs about 9 us per op (a Python dispatch mode).

Why a record of the ops, not the allocator's view: asking torch 2.11 for a pool's segments
(``torch.cuda.memory_snapshot(pool)``) once per break handed back Python objects that were
already freed in the allocator states bcg's captures create (many short-lived pools): on the
H200 the debug allocator faulted while reading them, and the one-process CUDA suite, the
stress suite and a two-thread capture loop died with SIGSEGV (issue 21). A storage no op of
the block created (an argument returned as it is, a buffer of the break's own, memory from a
library that allocates outside torch's dispatcher) is never taken for a pooled one: the bridge
holds it strongly, which is always safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
import torch.utils._python_dispatch
from torch.multiprocessing.reductions import StorageWeakRef

from bcg_core._inference_views import InferenceViews
from bcg_core._trees import tensor_leaves

# The tracker of the break running on this thread, for keep_alive_ok (debug.py).
TRACKER: ContextVar[FreshTensorTracker | None] = ContextVar("bcg_core_fresh", default=None)


def storage_key(t: torch.Tensor) -> int:
    """A tensor's storage, as its data pointer."""
    return t.untyped_storage().data_ptr()


# Namespaces whose schemas state every alias (ATen's are checked by torch's own tests and
# functionalization relies on them); another library's op may return an input unannotated.
_TRUSTED_SCHEMAS = frozenset({"aten", "prims"})
_fresh_cache: dict[Any, tuple[int, ...] | None] = {}
_BELOW_PYTHON = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)
_fresh_lock = threading.Lock()


def _fresh_returns(func: Any) -> tuple[int, ...] | None:
    """The positions of ``func``'s returns that are new allocations (a return without alias
    annotation in the schema of a trusted namespace), or None where the schema is not trusted.
    Read once per op: the per-op cost is most of a break's at capture."""
    try:
        return _fresh_cache[func]
    except KeyError:
        pass
    schema = getattr(func, "_schema", None)
    positions: tuple[int, ...] | None = None
    if schema is not None and getattr(func, "namespace", None) in _TRUSTED_SCHEMAS:
        positions = tuple(i for i, r in enumerate(schema.returns) if r.alias_info is None)
    with _fresh_lock:
        _fresh_cache[func] = positions
    return positions


class FreshTensorTracker(torch.utils._python_dispatch.TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Weak references to the ``device_type`` storages that the enclosed ops created.

    An op's output is fresh when its schema says it is no alias (ATen's and prims' schemas
    annotate every view, in-place and ``out=`` return), or, for another library's op, when its
    storage is none of its inputs' (views and in-place writes are not). Storages, not tensor
    objects, are referenced: a view kept after its base died still holds the storage. Only weak
    references are held, so the tracker keeps nothing alive.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # never traced by torch.compile; skip torch's per-op dynamo wrapper

    def __init__(self, device_type: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device_type = device_type
        self.fresh: list[tuple[StorageWeakRef, int, int]] = []
        # keep_alive_ok's storages, by weak reference: an address alone also exempted a tensor
        # the break made later at the same address, once the marked one had died.
        self._allowed: list[tuple[StorageWeakRef, int]] = []
        self._token: Any = None
        # In inference mode a view this mode sees made shares no version counter with its
        # base: a break writing its argument through one (x.reshape(-1)[:1] = v) was not
        # copied back to the caller by a runner under the debug check alone; nor, in any grad
        # mode, a write through a _foreach op, which bumps no version under a mode.
        self._views = InferenceViews()

    def __enter__(self) -> FreshTensorTracker:
        self._token = TRACKER.set(self)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        TRACKER.reset(self._token)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        fresh = _fresh_returns(func)
        out = self._run(func, args, kwargs or {}, inside=fresh is None)
        if hasattr(func, "_schema"):
            if func._schema.is_mutable:
                self._views.bump(func, args, kwargs or {})
            elif torch.is_inference_mode_enabled():
                operands = tensor_leaves((args, kwargs), into_objects=False)
                self._views.note(tensor_leaves(out, into_objects=False), operands)
        if fresh is None:  # no schema to trust: compare with the inputs' storages
            inputs = {storage_key(t) for t in tensor_leaves((args, kwargs), into_objects=False)}
            for t in tensor_leaves(out, into_objects=False):
                if storage_key(t) not in inputs:
                    self._note(t)
        elif fresh:
            outs = out if isinstance(out, tuple) else (out,)
            for i in fresh:
                for t in tensor_leaves(outs[i], into_objects=False):
                    self._note(t)
        return out

    def _run(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, inside: bool
    ) -> Any:
        """Run ``func``; with ``inside``, under this mode again, below the Python key: another
        library's op (a ``torch.library`` custom op) then shows the ops its kernel issues,
        which the mode, popped while it handles an op, missed (a tensor such a kernel kept was
        never reported)."""
        if not inside or not isinstance(func, torch._ops.OpOverload):
            return func(*args, **kwargs)
        tensors = tensor_leaves((args, kwargs), into_objects=False)
        if not tensors:
            return func(*args, **kwargs)
        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
        for t in tensors:
            keys = keys | torch._C._dispatch_keys(t)
        mode = torch.utils._python_dispatch.TorchDispatchMode
        mode.__enter__(self)  # type: ignore[no-untyped-call]  # the mode alone (not TRACKER)
        try:
            return func.redispatch(keys & _BELOW_PYTHON, *args, **kwargs)
        finally:
            mode.__exit__(self, None, None, None)  # type: ignore[no-untyped-call]

    def _note(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type:
            return
        storage = t.untyped_storage()
        if storage.nbytes():
            ref = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
            self.fresh.append((ref, storage.data_ptr(), storage.nbytes()))

    def allow(self, t: torch.Tensor) -> None:
        """Exempt ``t``'s storage from the leak report while it lives (``keep_alive_ok``)."""
        storage = t.untyped_storage()
        self._allowed.append((StorageWeakRef(storage), storage.data_ptr()))  # type: ignore[no-untyped-call]

    def allowed(self) -> set[int]:
        """The storage pointers exempted by :meth:`allow` whose storages are still alive."""
        return {ptr for ref, ptr in self._allowed if not ref.expired()}  # type: ignore[no-untyped-call]

    def alive(self) -> dict[int, int]:
        """Storage pointer → bytes of every fresh storage still referenced by a live tensor."""
        return {ptr: size for ref, ptr, size in self.fresh if not ref.expired()}  # type: ignore[no-untyped-call]

    def made_on(self, device: torch.device) -> Callable[[torch.Tensor], bool]:
        """A test for "this tensor's storage was created by the block's ops on ``device`` and
        is alive", fixed at the time of the call."""
        alive = self.alive()

        def made(t: torch.Tensor) -> bool:
            return t.device == device and storage_key(t) in alive

        return made
