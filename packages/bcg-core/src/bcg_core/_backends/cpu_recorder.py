"""Recording the aten operations of one CPU graph segment, and re-running them at replay.

The CPU graph backend (``cpu.py``) captures a segment with a :class:`Recorder`, a
``TorchDispatchMode`` that sees every aten operation the segment issues on the capturing thread,
below autograd. Every operation runs at capture (so capture produces real values) and becomes
zero or one *replay step*:

* allocations (``empty``, ``empty_strided``, ...): nothing at replay; the memory stays put.
* views, and ops whose every output lives in an input's storage without a write (checked by
  storage pointer): metadata only, nothing at replay.
* metadata mutations (``unsqueeze_``, ``t_``, ``resize_``, ``set_`` ...): nothing at replay; the
  recorded tensors carry the metadata they had when each op ran.
* in-place and ``out=`` ops (a mutable schema): run again on the same tensors.
* functional ops: the fresh result is written into the storage captured as their output, through
  the op's ``out=`` overload when there is one and it gave a bit-identical result at capture,
  else by running the op and copying. Random ops always run the functional op, so they draw
  fresh numbers at each replay from the same generator, as eager code would.

Tensors are recorded as *snapshots*: tensors over the same storage with sizes, strides and offset
frozen right after the op ran, so a later metadata mutation cannot change what an earlier step
reads or writes, and a static input whose storage is replaced is not followed (as with CUDA
graphs, which keep reading the captured address).

A random op drawing from a private ``torch.Generator`` (not the default one) raises
:class:`CaptureError` before it runs, as torch's check does on CUDA, where a graph draws only from
the generators registered with it (not under :func:`record_source_locations`: the divergence check
captures such draws to name the generator). ``torch.manual_seed`` to another seed and
``torch.seed()`` inside a segment raise too, and ``torch.manual_seed`` to the current seed does
nothing, as CUDA's generator does during capture.

Host synchronisations raise :class:`HostSyncError` at the offending call: ops that read a value on
the host (``aten._local_scalar_dense``, which ``.item()``, ``bool()``, ``int()`` and ``float()`` end
in; ``aten.equal``), ops whose output shape depends on values (``nonzero``, ``masked_select``,
``unique``, boolean-mask indexing ...), linear algebra error checks (CUDA reads the info tensor of
``linalg.inv``, ``solve``, ``cholesky`` ... and of every ``svd``, ``eigh``, ``eig`` on the host),
``histc`` without a range, and four Python-level reads that dispatch nothing on CPU tensors:
``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.__repr__`` (printing) and ``Tensor.cpu``; and waits
for the device: ``synchronize()`` of the CPU stand-in streams, events and backend
(:func:`host_wait`). The Python-level reads are caught by wrappers installed on ``torch.Tensor``
while any CPU segment is being captured (refcounted, always removed); they act only in the context
that is capturing. So is ``torch.cuda.is_current_stream_capturing``, which answers True in that
context, as it does inside a CUDA capture: code that takes another path under a capture
(transformers' ``is_tracing()`` skips GPT-2's padding check, a host read, and mask shortcuts) takes
the capture's path on the CPU backend too.

The dispatch-mode stack is per thread, not per context: an op that reaches a recorder from another
context or asyncio task on the capturing thread (one running while the capturing task awaits
inside a segment) raises :class:`CaptureError` and invalidates the capture instead of being
recorded.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar, Token
from typing import Any, NoReturn

import torch
import torch.utils._python_dispatch
from torch.multiprocessing.reductions import StorageWeakRef

from bcg_core._compare import bitwise_equal
from bcg_core._context_reset import running_task
from bcg_core._errors import CaptureError, HostSyncError, ReplayError
from bcg_core._inference_views import InferenceViews
from bcg_core._patching import hook_attribute
from bcg_core._source import user_location
from bcg_core._trees import map_tensors, tensor_leaves

Step = Callable[[], object]

_ATEN = torch.ops.aten


def _packets(*names: str) -> frozenset[Any]:
    """The aten overload packets of these names that exist in this torch build."""
    return frozenset(getattr(_ATEN, n) for n in names if hasattr(_ATEN, n))


_ALLOCATIONS = _packets(
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "empty_permuted"
)
_METADATA_MUTATIONS = _packets("resize_", "resize_as_", "set_")
_RESIZES = _packets("resize_", "resize_as_")
_VALUE_READS = _packets("_local_scalar_dense", "item", "equal", "is_nonzero")
_DYNAMIC_SHAPES = _packets(
    "nonzero",
    "nonzero_numpy",
    "argwhere",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "bincount",
)
_MASK_INDEXING = _packets("index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index")
# CUDA's linalg error check reads the info tensor on the host (infos.any().item()); the CPU kernel
# reads it too, but below the dispatcher, so only the op (and the _ex ops' check_errors) shows it.
_LINALG_CHECKS = _packets("_linalg_check_errors")
# Decompositions whose kernels always end in that check (no variant skips it), unless empty;
# torch.linalg.svdvals, eigvalsh, eigvals, matrix_rank, matrix_norm(2), cond run through them.
_LINALG_CONVERGENCE = _packets("_linalg_svd", "_linalg_eigh", "linalg_eig", "linalg_pinv")

_READS_VALUE = (
    "reads a tensor value on the host (.item(), bool(tensor), int(tensor), float(tensor), "
    "torch.equal ...)"
)
_DYNAMIC_SHAPE = (
    "has an output shape that depends on tensor values (nonzero, masked_select, unique ...), "
    "which the host must wait for"
)
_MASK = "indexes with a boolean mask (x[mask], x[mask] = v), which needs nonzero(mask) on the host"
_LINALG = (
    "checks a linear algebra result for errors by reading its info tensor on the host "
    "(torch.linalg.inv, solve, cholesky, lu_factor ... and the _ex variants with "
    "check_errors=True); call the _ex variant (torch.linalg.inv_ex ...) without check_errors "
    "and check its info tensor after the replay"
)
_CONVERGENCE = (
    "checks a decomposition for convergence by reading its info tensor on the host "
    "(torch.linalg.svd, svdvals, eigh, eigvalsh, eig, eigvals, pinv, matrix_rank, "
    "matrix_norm(ord=2) ...; no variant skips the check); compute it in an @eager_on_graph break"
)
_HISTC = (
    "computes its range from the tensor's min and max on the host (torch.histc without "
    "min < max); pass the range: torch.histc(x, bins, min=..., max=...)"
)
_PYTHON_READS = {
    "tolist": "copies the tensor's values to the host",
    "numpy": "hands the tensor's values to NumPy on the host",
    # A no-op on a CPU tensor; in code written for a device it copies to the host and waits.
    "cpu": "copies the tensor to the host, which waits for the device",
    "__repr__": "prints or formats a tensor, which reads its values on the host",
}


def host_sync_reason(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why ``func`` would synchronise with the host inside a CUDA graph capture, or None."""
    packet = func.overloadpacket
    if packet in _MASK_INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masks = (
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in indices or ()
        )
        return _MASK if any(masks) else None
    if packet in _LINALG_CHECKS or kwargs.get("check_errors") is True:
        return _LINALG
    if packet in _LINALG_CONVERGENCE:
        return _CONVERGENCE if args[0].numel() else None
    if packet is _ATEN.histc:
        # CUDA's histc takes the range from self.min() and self.max() on the host when min == max.
        low = args[2] if len(args) > 2 else kwargs.get("min", 0)
        high = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return _HISTC if low == high and args[0].numel() else None
    tags = func.tags
    if packet is _ATEN.repeat_interleave:
        dynamic = torch.Tag.dynamic_output_shape in tags and kwargs.get("output_size") is None
        return _DYNAMIC_SHAPE if dynamic else None
    if packet in _VALUE_READS or torch.Tag.data_dependent_output in tags:
        return _READS_VALUE
    if packet in _DYNAMIC_SHAPES or torch.Tag.dynamic_output_shape in tags:
        return _DYNAMIC_SHAPE
    return None


def private_generator_error(op: str, location: str | None) -> CaptureError:
    where = f" at {location}" if location else ""
    return CaptureError(
        f"{op}{where} draws from a private torch.Generator inside a graph segment. A CUDA graph "
        "draws only from the generators registered with it (bcg registers the default one), and "
        "torch refuses any other during capture ('Attempt to increase offset for a CUDA "
        "generator not in capture mode'). Draw from the default generator (seeded by "
        "torch.manual_seed), or move the draw into a function decorated with @eager_on_graph. "
        "(Detected by the CPU graph backend, which enforces CUDA graph capture rules.)"
    )


def _private_generator(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an op's arguments name a generator other than the default one (the dispatcher
    hands over another Python object for it: compared by the C++ generator's address)."""
    default = getattr(torch.default_generator, "_cdata", None)
    return any(
        isinstance(a, torch.Generator) and getattr(a, "_cdata", default) != default
        for a in itertools.chain(args, kwargs.values())
    )


def host_sync_error(op: str, reason: str, location: str | None) -> HostSyncError:
    where = f" at {location}" if location else ""
    return HostSyncError(
        f"operation not permitted when stream is capturing: {op} ({reason}){where}. Nothing "
        "inside a graph segment may wait for the device: move the code that needs this value "
        "on the host into a function decorated with @eager_on_graph (a break point, run eagerly "
        "between graph segments), or keep the value on the device. (Detected by the CPU graph "
        "backend, which enforces CUDA graph capture rules.)",
        op,
        location,
    )


# -- Python-level host reads (they dispatch nothing on CPU tensors) ------------------------------

_ACTIVE: ContextVar[Recorder | None] = ContextVar("bcg_core_cpu_recorder", default=None)
_hooks_lock = threading.Lock()
_hooks_refcount = 0
_removers: list[Callable[[], None]] = []  # the installed hooks' removers, in install order


def _hook(name: str, reason: str, original: Callable[..., Any]) -> Callable[..., Any]:
    op = f"Tensor.{name}"

    def hooked(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        recorder = _ACTIVE.get()
        if recorder is not None:
            recorder.host_sync(op, reason)
        return original(self, *args, **kwargs)

    hooked.__name__ = name
    hooked.__qualname__ = op
    hooked.__doc__ = original.__doc__
    return hooked


def host_wait(op: str) -> None:
    """Raise :class:`HostSyncError` for ``op``, a wait for the device (the CPU stand-ins of
    stream, event and device synchronisation), when a CPU segment is captured in this context:
    CUDA refuses the wait inside a capture and invalidates it."""
    recorder = _ACTIVE.get()
    if recorder is not None:
        recorder.host_sync(op, "waits on the host for the device's work to finish")


def _reseed_error(op: str) -> CaptureError:
    location = user_location()
    where = f" at {location}" if location else ""
    return CaptureError(
        f"{op}{where} reseeds the generator inside a graph segment. CUDA's generator refuses a "
        "new seed during capture ('set_current_seed can be called during stream capture only if "
        "new seed is the same as the original seed') and ignores the same one; a replay never "
        "reseeds. Seed before the capture or the replay, or in a function decorated with "
        "@eager_on_graph. (Detected by the CPU graph backend, which enforces CUDA graph capture "
        "rules.)"
    )


def _manual_seed_hook(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def manual_seed(seed: Any) -> Any:
        if _ACTIVE.get() is None:
            return original(seed)
        wanted = int(seed)
        if wanted < 0:  # torch's own remapping of negative seeds
            wanted += 0xFFFF_FFFF_FFFF_FFFF
        if wanted != torch.default_generator.initial_seed():
            raise _reseed_error("torch.manual_seed")
        return torch.default_generator  # the same seed: CUDA's generator ignores it in a capture

    manual_seed.__doc__ = original.__doc__
    return manual_seed


def _seed_hook(original: Callable[[], int]) -> Callable[[], int]:
    def seed() -> int:
        if _ACTIVE.get() is not None:
            raise _reseed_error("torch.seed")
        return original()

    seed.__doc__ = original.__doc__
    return seed


# torch.manual_seed and torch.seed are torch.random's functions: one wrapper serves both names.
_SEEDING: tuple[tuple[str, Callable[[Any], Any]], ...] = (
    ("manual_seed", _manual_seed_hook),
    ("seed", _seed_hook),
)


def _capturing_hook(original: Callable[[], bool]) -> Callable[[], bool]:
    def is_current_stream_capturing() -> bool:
        return _ACTIVE.get() is not None or original()

    is_current_stream_capturing.__doc__ = original.__doc__
    return is_current_stream_capturing


@contextlib.contextmanager
def host_read_hooks() -> Iterator[None]:
    """Wrap ``Tensor.tolist``/``numpy``/``__repr__``/``cpu``,
    ``torch.cuda.is_current_stream_capturing`` and ``torch.manual_seed``/``torch.seed`` (also as
    ``torch.random``'s) for the enclosed block (refcounted). Removed with ``hook_attribute``: a
    patch another library put over one of them meanwhile is kept (it was overwritten)."""
    global _hooks_refcount
    with _hooks_lock:
        if _hooks_refcount == 0:
            for name, reason in _PYTHON_READS.items():
                _removers.append(
                    hook_attribute(torch.Tensor, name, functools.partial(_hook, name, reason))
                )
            _removers.append(
                hook_attribute(torch.cuda, "is_current_stream_capturing", _capturing_hook)
            )
            for name, make in _SEEDING:
                for module in (torch.random, torch):
                    _removers.append(hook_attribute(module, name, make))
        _hooks_refcount += 1
    try:
        yield
    finally:
        with _hooks_lock:
            _hooks_refcount -= 1
            if _hooks_refcount == 0:
                while _removers:
                    _removers.pop()()


# -- recording ------------------------------------------------------------------------------------


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs."""
    return tensor_leaves(obj)


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _dead(ref: StorageWeakRef) -> bool:
    return bool(ref.expired())  # type: ignore[no-untyped-call]


class WrittenStorages:
    """The storages a pool's captures wrote (see :class:`HostScalar`), by address, each only
    while it lives. A plain set of addresses kept those of graphs long reset: in a shared pool
    it grew with every capture, and a 0-dim tensor from outside the graph that the allocator
    later placed at such an address was taken for graph memory (its change replayed silently
    instead of raising :class:`ReplayError`)."""

    __slots__ = ("_pruned", "_refs")

    def __init__(self) -> None:
        self._refs: dict[int, StorageWeakRef] = {}
        self._pruned = 0  # how many were alive at the last pruning

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        refs = self._refs
        for t in tensors:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            ref = refs.get(ptr)
            if ref is None or _dead(ref):
                refs[ptr] = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
        if len(refs) > 2 * self._pruned + 64:  # amortised: the dead go, the size stays bounded
            self._refs = {p: r for p, r in refs.items() if not _dead(r)}
            self._pruned = len(self._refs)

    def __contains__(self, ptr: object) -> bool:
        ref = self._refs.get(ptr) if isinstance(ptr, int) else None
        return ref is not None and not _dead(ref)


def _snapshot(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a tensor over the same storage whose sizes, strides
    and offset are frozen now (call under ``_AutoDispatchBelowADInplaceOrView``)."""
    return map_tensors(obj, _frozen_view)


def _frozen_view(t: torch.Tensor) -> torch.Tensor:
    if t.layout is not torch.strided:
        return t
    try:
        return t.as_strided(t.size(), t.stride(), t.storage_offset())
    except RuntimeError:
        return t


_out_overloads: dict[Any, tuple[Any, tuple[str, ...]] | None] = {}


def _out_overload(func: Any) -> tuple[Any, tuple[str, ...]] | None:
    """The ``out=`` overload of a functional op (same arguments plus one out per return)."""
    if func in _out_overloads:
        return _out_overloads[func]
    schema = func._schema
    wanted = [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments]
    found: tuple[Any, tuple[str, ...]] | None = None
    packet = func.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        arguments = candidate._schema.arguments
        outs = tuple(a.name for a in arguments if a.is_out)
        if not outs or len(outs) != len(schema.returns):
            continue
        rest = [(a.name, str(a.type), a.kwarg_only) for a in arguments if not a.is_out]
        if rest == wanted:
            found = (candidate, outs)
            break
    _out_overloads[func] = found
    return found


def _like(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.empty_strided(obj.size(), obj.stride(), dtype=obj.dtype, device=obj.device)
    return [_like(x) for x in obj]


def _empty_like(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.empty(0, dtype=obj.dtype, device=obj.device)
    return [_empty_like(x) for x in obj]


def _holds_more_than_its_layout(t: torch.Tensor) -> bool:
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.size(), t.stride(), strict=True))
    need = (t.storage_offset() + span) * t.element_size() if t.numel() else 0
    return bool(t.untyped_storage().nbytes() > need)


def _out_variant_step(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
) -> Step | None:
    """A replay step writing ``func``'s result into ``out`` through its ``out=`` overload, if that
    overload exists and reproduces the capture-time result bit for bit."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        # A composite op (matmul) reaches the recorder whole in inference mode; its out= overload
        # may resize a scratch output, and torch's deprecation warning about that surfaced at
        # the user's line, where eager warns nothing: run it and copy instead.
        return None
    found = _out_overload(func)
    if found is None:
        return None
    overload, names = found
    returns = out if isinstance(out, tuple) else (out,)
    if len(returns) != len(names):
        return None
    if not all(isinstance(r, (torch.Tensor, list)) for r in returns):
        return None
    # An overload that first uses its output as a larger scratch (mse_loss.out) resizes an
    # output shaped like the result, and torch's deprecation warning about that surfaced at
    # the user's line (C++ warnings reach Python only there), where eager warns nothing. An
    # empty output grows silently, and the storage it is left with tells.
    empty = [_empty_like(r) for r in returns]
    try:
        overload._op(*args, **kwargs, **dict(zip(names, empty, strict=True)))
    except Exception:
        return None
    if any(map(_holds_more_than_its_layout, _tensors(empty))):
        return None
    scratch = [_like(r) for r in returns]
    before = [(_storage_ptr(t), t.stride()) for t in _tensors(scratch)]
    try:
        overload._op(*args, **kwargs, **dict(zip(names, scratch, strict=True)))
    except Exception:
        return None
    got, want = _tensors(scratch), _tensors(returns)
    if before != [(_storage_ptr(t), t.stride()) for t in got]:
        return None  # the out= overload resized its output: not the same computation
    if len(got) != len(want) or not all(map(bitwise_equal, got, want)):
        return None
    outs = {n: _snapshot(r) for n, r in zip(names, returns, strict=True)}
    return functools.partial(overload._op, *args, **kwargs, **outs)


def _run_and_copy(
    op: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    single: bool,
    fresh: list[int],
    dsts: list[torch.Tensor],
) -> Step:
    """A replay step running ``op`` and copying its fresh outputs into the captured ones."""
    if single:
        (dst,) = dsts

        def copy_one() -> None:
            dst.copy_(op(*args, **kwargs))

        return copy_one
    pairs = tuple(zip(fresh, dsts, strict=True))

    def copy_many() -> None:
        result = _tensors(op(*args, **kwargs))
        for i, d in pairs:
            d.copy_(result[i])

    return copy_many


class HostScalar:
    """A 0-dim operand from outside the graph, and the value it had when ``op`` read it at capture.

    On CUDA a 0-dim *CPU* tensor operand is passed to the kernel by value at capture, so replay
    keeps using that value, while a 0-dim *device* tensor is read at replay. On the CPU backend
    every tensor is a CPU tensor and the two cannot be told apart, so a segment refuses to
    replay once such a value changed (:meth:`check`): any answer it gave could be GPU-wrong.
    """

    __slots__ = ("graph_memory", "live", "op", "value")

    def __init__(self, op: Any, t: torch.Tensor, graph_memory: WrittenStorages) -> None:
        self.op = op
        self.graph_memory = graph_memory
        with torch._C._AutoDispatchBelowADInplaceOrView():
            self.live = _snapshot(t)
            self.value = t.detach().clone()

    def check(self) -> None:
        if torch.equal(self.live, self.value):
            return
        # Read before the graph wrote it (a KV cache's position counter, read then add_'ed):
        # graph state, which a GPU re-reads too. Known only once the whole capture is recorded.
        if _storage_ptr(self.live) in self.graph_memory:
            return
        raise ReplayError(
            "keep a value that changes between replays in a device tensor of shape (1,) copied "
            "in before replay, pass it through a break (its return value, or an argument it "
            "writes: a tensor the break writes from its closure is not seen), or capture again "
            "after changing it: "
            f"{self.op} in a CPU graph segment read a 0-dim tensor from outside the graph whose "
            f"value changed since capture ({self.value.item()} -> {self.live.item()}). A CUDA "
            "graph bakes a 0-dim CPU operand into the kernel (replay keeps the old value) but "
            "re-reads a 0-dim CUDA tensor; the CPU backend cannot tell which this is."
        )


_capture_ids = itertools.count(1)


class Recorder(torch.utils._python_dispatch.TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs and records the aten ops of one segment; :attr:`steps` replays them in order.

    :meth:`start` / :meth:`stop` bracket the segment (they need not be in one Python block).
    After a host synchronisation the recorder is *invalidated* (as a CUDA capture would be):
    :attr:`error` holds the first one and later ops run but are no longer recorded.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch would wrap __torch_dispatch__ in torch._disable_dynamo (importing dynamo on the
        # first op and adding a frame per op); while dynamo is not even imported nothing can
        # compile, and new_recorder() picks _CompilingRecorder otherwise.
        return False

    # A random op on a private generator is refused as on CUDA (see private_generator_error).
    refuses_private_generators = True

    def __init__(self, graph_memory: WrittenStorages | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.capture_id = next(_capture_ids)
        self.steps: list[Step] = []
        # Storages this capture writes (shared by its segments through the pool): a 0-dim
        # operand outside them is a value from outside the graph, see host_scalars.
        self.graph_memory = graph_memory if graph_memory is not None else WrittenStorages()
        self.host_scalars: list[HostScalar] = []
        self.error: CaptureError | None = None  # a HostSyncError, or another task's op
        self.stopped = False
        self._thread = 0
        self._task: object = None  # the asyncio task that captures, None outside a loop
        self._token: Token[Recorder | None] | None = None
        self._hooks: contextlib.ExitStack | None = None
        # Views made by an op in inference mode, each to the tensor it views (version bumps).
        self._views = InferenceViews()

    def start(self) -> None:
        hooks = contextlib.ExitStack()
        hooks.enter_context(host_read_hooks())
        self._hooks = hooks
        self._token = _ACTIVE.set(self)
        self._thread = threading.get_ident()
        self._task = running_task()
        self.__enter__()  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        """Leave the dispatch-mode stack and remove the hooks, whatever else is on the stack.

        A dispatch mode entered inside the segment and still active here (at a break, or at the
        end of the capture) is lifted off, this recorder removed, the mode put back, and a
        :class:`CaptureError` raised: leaving the recorder in place would record forever.

        Stopped recorders found on the stack are dropped. Autograd's engine runs each backward
        node under the dispatch-mode stack of the ``backward()`` call, so after a break inside
        backward the segment that was open at that call is back on the stack (it forwards its
        ops to the active recorder, see ``__torch_dispatch__``) while the one begun at the break
        may be missing from it; this recorder is then pushed back only to be exited.
        """
        self.stopped = True
        above: list[Any] = []
        try:
            found = False
            while torch._C._len_torch_dispatch_stack() > 0:
                top = torch._C._get_dispatch_stack_at(torch._C._len_torch_dispatch_stack() - 1)
                if top is self:
                    found = True
                    break
                mode = torch._C._pop_torch_dispatch_stack(None)
                if not (isinstance(mode, Recorder) and mode.stopped):
                    above.append(mode)
            if not found:  # dropped by autograd (above): exit it all the same (mode flags)
                torch._C._push_on_torch_dispatch_stack(self)
            self.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            for mode in reversed(above):
                torch._C._push_on_torch_dispatch_stack(mode)
        finally:
            if self._token is not None:
                try:
                    _ACTIVE.reset(self._token)
                except ValueError:  # ended in another context than it began in
                    _ACTIVE.set(None)
                self._token = None
            if self._hooks is not None:
                self._hooks.close()
                self._hooks = None
        if above and found:
            names = ", ".join(type(m).__name__ for m in above)
            raise CaptureError(
                f"dispatch mode(s) {names} entered inside a graph segment were still active when "
                "the segment ended (at a break point or at the end of the capture); exit them "
                "inside the segment"
            )

    def _foreign(self, func: Any) -> NoReturn:
        # The dispatch-mode stack is per thread, not per context: an asyncio task that runs
        # while the capturing task awaits inside a segment (or any code in another context on
        # this thread) reaches this recorder. Recorded, its ops would replay with this graph
        # (on CUDA they would go to the capturing stream, the thread's current one): refused,
        # and the capture is invalidated.
        error = CaptureError(
            f"{func} ran on the capturing thread from another context (an asyncio task, or "
            f"code run with contextvars' Context.run) while a graph segment was being captured "
            f"at {user_location() or 'an unknown line'}; it would have been recorded into that "
            "graph. Do not await inside a capture block: capture (runner.capture, a runner's "
            "first calls) without yielding to the event loop, or in a thread of its own."
        )
        self._fail(error)

    def host_sync(self, op: str, reason: str) -> NoReturn:
        self._fail(host_sync_error(op, reason, user_location()))

    def _fail(self, error: CaptureError) -> NoReturn:
        if self.error is None:
            self.error = error
        try:
            raise error
        finally:
            # This frame, which the traceback keeps, must not hold the error: the cycle kept
            # the recorder, its steps and tensors until the garbage collector ran.
            del error

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self.stopped:
            # Put back on the stack by autograd after a break inside backward (see stop()):
            # the segment recording now is the active one; between segments nothing records.
            active = _ACTIVE.get()
            if active is None or active is self:
                return func(*args, **(kwargs or {}))
            return active.__torch_dispatch__(func, types, args, kwargs)
        if (
            _ACTIVE.get() is not self
            or (self._task is not None and running_task() is not self._task)
        ) and threading.get_ident() == self._thread:
            self._foreign(func)
        kwargs = kwargs or {}
        reason = host_sync_reason(func, args, kwargs)
        if reason is not None:
            self.host_sync(str(func), reason)
        if self.refuses_private_generators and _private_generator(args, kwargs):
            # Raised before the op runs and not invalidating, as torch's check on CUDA.
            raise private_generator_error(str(func), user_location())
        packet = func.overloadpacket
        before = None
        if packet in _RESIZES and args:
            before = (_storage_ptr(args[0]), args[0].untyped_storage().nbytes())
        out = func(*args, **kwargs)
        if self.stopped:
            # A break (or break_graph) ran inside this op's Python implementation (a
            # torch.library custom op) and ended this segment: the op is recorded as one step,
            # which no segment can hold half of (the new segment's recorder was pushed below
            # this one, and the capture failed later with an error about bcg's own ops).
            raise CaptureError(
                f"a break point ran inside the implementation of {func} (a torch.library "
                "custom op or another op with a Python kernel), which the CPU graph backend "
                "records as one step of a segment and cannot split between segments: call the "
                "break before or after the op, not inside its implementation (for a custom op "
                "whose implementation is a break, decorate the op instead: "
                "eager_on_graph(op))"
            )
        if self.error is not None:
            return out
        if before is not None and before[1] > 0 and _storage_ptr(args[0]) != before[0]:
            raise CaptureError(
                f"{func} moved a tensor to new memory inside a graph segment (it grew); values "
                "written to the old memory would be lost at replay. Allocate the tensor at its "
                "final size before the capture."
            )
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        packet = func.overloadpacket
        tags = func.tags
        outs = _tensors(out)
        if packet in _ALLOCATIONS:
            self.graph_memory.add(outs)
            return  # uninitialised memory: nothing to compute at replay
        if packet in _METADATA_MUTATIONS or torch.Tag.inplace_view in tags:
            return  # metadata only; later steps hold snapshots with the new metadata
        mutable: bool = func._schema.is_mutable
        operands = _tensors((args, kwargs))
        inputs = {_storage_ptr(t) for t in operands if t.untyped_storage().nbytes()}
        fresh = [i for i, t in enumerate(outs) if t.numel() and _storage_ptr(t) not in inputs]
        if not mutable and not fresh and (outs or not operands):
            if outs and torch.is_inference_mode_enabled():
                self._views.note(outs, operands)
            return  # a view or an alias of its inputs (checked by storage): metadata only
        if mutable:
            self._views.bump(func, args, kwargs)
        written = {_storage_ptr(t) for t in outs}
        for t in operands:
            if t.dim() == 0 and t.layout is torch.strided:
                ptr = _storage_ptr(t)
                if ptr not in self.graph_memory and ptr not in written:
                    self.host_scalars.append(HostScalar(func, t, self.graph_memory))
        self.graph_memory.add(outs)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            s_args, s_kwargs = _snapshot(args), _snapshot(kwargs)
            if not fresh:
                self.steps.append(functools.partial(func._op, *s_args, **s_kwargs))
                return
            seeded = torch.Tag.nondeterministic_seeded in tags
            if not mutable and not seeded and len(fresh) == len(outs):
                step = _out_variant_step(func, s_args, s_kwargs, out)
                if step is not None:
                    self.steps.append(step)
                    return
            dsts = [_snapshot(outs[i]) for i in fresh]
        single = isinstance(out, torch.Tensor)
        self.steps.append(_run_and_copy(func._op, s_args, s_kwargs, single, fresh, dsts))


class _CompilingRecorder(Recorder):  # type: ignore[no-untyped-call]
    """A recorder that ``torch.compile`` treats as opaque: torch wraps its ``__torch_dispatch__``
    in ``torch._disable_dynamo``, so dynamo, tracing a compiled function while the recorder is
    active, runs the recorder instead of inlining it (and recording fake tensors)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return super().__torch_dispatch__(func, types, args, kwargs)


# -- source locations (opt-in: walking the stack per op costs capture time) ----------------------

_LOCATIONS: ContextVar[bool] = ContextVar("bcg_core_cpu_locations", default=False)


@contextlib.contextmanager
def record_source_locations() -> Iterator[None]:
    """CPU segments captured inside this block record the user's source line of each operation
    (see :class:`LocatingRecorder`); the divergence check turns it on."""
    token = _LOCATIONS.set(True)
    try:
        yield
    finally:
        _LOCATIONS.reset(token)


class LocatingRecorder(_CompilingRecorder):  # type: ignore[no-untyped-call]
    """A recorder that also notes :func:`user_location` of every operation the segment issues
    (allocations and views too: ``torch.tensor(host_list)`` is one); a separate kind, so that
    capture without locations pays nothing for them (opaque to dynamo: it only runs in checks).

    It lets random ops on a private generator through: the divergence check, its user, captures
    them so that it can name the generator as the cause (``private_generator``)."""

    refuses_private_generators = False

    def __init__(self, graph_memory: WrittenStorages | None = None) -> None:
        super().__init__(graph_memory)
        self.locations: list[str] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        location = user_location()
        if location is not None:
            self.locations.append(location)
        return out


def new_recorder(graph_memory: WrittenStorages | None = None) -> Recorder:
    """A recorder for one segment: a :class:`LocatingRecorder` inside
    :func:`record_source_locations`; else the opaque kind once ``torch._dynamo`` is imported
    (something may compile), else the cheaper kind dynamo is never near."""
    if _LOCATIONS.get():
        return LocatingRecorder(graph_memory)
    if "torch._dynamo" in sys.modules:
        return _CompilingRecorder(graph_memory)
    return Recorder(graph_memory)
