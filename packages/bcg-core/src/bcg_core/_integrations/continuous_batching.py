"""transformers' continuous batching through breakable graphs (transformers 5.17).

transformers' engine (``generate_batch``, ``ContinuousBatchingManager``, ``transformers serve``)
packs the prefill chunks and decode tokens of many requests into one ragged forward whose
attention reads the paged KV cache through host-built metadata (read/write indices, a 4D mask
over the packed keys). Its own CUDA graphs pad the query tokens *and* the KV read length and
capture one graph per (query bucket, KV bucket) pair. Here the paged attention is the break, so
one graph per query bucket serves every KV length, and the KV read is never padded: at every
call, capture or replay, the break rebuilds the attention's arguments from the live batch (the
engine's ``ContinuousBatchingIOs``) with the batch's true sizes, exactly as the eager engine
would pass them, and slices the query to the batch's true tokens.

The engine is reached through three methods of ``ModelRunner`` and four of
``ContinuousBatchingManager`` (which picks the model's paged attention, builds the runner and
starts the engine's thread), plus the
``paged|sdpa`` and ``paged|eager`` entries of transformers' ``AttentionInterface``: patched
while any handle is alive (each handle holds one reference per patch,
``bcg_core.patch_attribute``), restored when the last is removed. They act only for enabled
models; every other model runs transformers' code unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from math import ceil
from typing import Any, Literal

import torch

from bcg_core._backends import backend_for_device
from bcg_core._capture.breaks import eager_on_graph
from bcg_core._capture.context import is_breakable_capture_active
from bcg_core._capture.flag import (
    bcg_disabled_by_env,
    breakable_graphs_disabled,
    disable_breakable_graphs,
    is_in_breakable_cuda_graph,
)
from bcg_core._patching import PatchHandle, Removable
from bcg_core._runner.runner import BreakableGraphRunner

logger = logging.getLogger("bcg_core")

SUPPORTED_TRANSFORMERS = ("5.17",)
_PAGED = "paged|"
_VARLEN_DEVICES = ("cuda",)  # where torch's varlen_attn has a kernel
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # what that kernel takes
_ATTENTION = ("paged|sdpa", "paged|eager")
_EXTRA = 'pip install "bcg-core[transformers]"'

# The engine's IO object of the batch being run through bcg and whether the break runs varlen,
# for the attention wrapper (read at warm-up and capture; a replay runs the break with its
# capture-time arguments).
_live_batch: contextvars.ContextVar[tuple[Any, bool] | None] = contextvars.ContextVar(
    "bcg_cb_batch", default=None
)


@dataclass(frozen=True)
class ContinuousBatchingStats:
    """What bcg did for an enabled model, over every engine built for it so far.

    Attributes:
        graphs: graphs captured (at most one per query-token bucket).
        graph_bytes: the largest pool size seen right after a capture (the engines' shared
            pools; None on the CPU backend).
        replays: batches served by a replay.
        eager_calls: batches run eagerly because graphs are disabled or a capture failed.
        first_batches: batches run eagerly because their bucket had not yet met
            ``capture_after`` batches (see :func:`enable_continuous_batching`).
    """

    graphs: int
    graph_bytes: int | None
    replays: int
    eager_calls: int
    first_batches: int = 0


class ContinuousBatchingHandle(Removable):
    """The reference :func:`enable_continuous_batching` returns; made by bcg, never by hand.

    :meth:`remove` (or leaving a ``with`` block) releases this handle's reference (idempotent):
    bcg is off for the model once all its handles are removed, and transformers' code is
    restored once every handle of every model is. An engine built before and still running
    then runs transformers' code (from the batch it is preparing, which keeps bcg's padding and
    the patches until its forward); its graphs are kept until it is dropped, or replaced by new
    ones once the model is enabled again (that engine then reports to the new handle).
    A handle cannot be copied or pickled (``TypeError``): enable the model again for another.

    Args:
        model: the enabled model (held weakly).
        record: the model's shared counters and handle count.
        patches: this handle's references on the patches (see :func:`bcg_core.patch_attribute`).
    """

    def __init__(self, model: Any, record: _Record, patches: PatchHandle) -> None:
        self._model: weakref.ref[Any] | None = weakref.ref(model)
        self._record = record
        self._patches = patches
        self._final: ContinuousBatchingStats | None = None  # the counts at remove()

    @property
    def active(self) -> bool:
        """Whether this handle still holds its patch reference."""
        return self._model is not None

    def stats(self) -> ContinuousBatchingStats:
        """Counters of every engine run for the model while it was enabled.

        Returns:
            A :class:`ContinuousBatchingStats`; after :meth:`remove`, the counts at the removal
            (they no longer change).
        """
        with _lock:
            return self._record.stats() if self._final is None else self._final

    def remove(self) -> None:
        """Release this handle's reference (idempotent); see the class docstring."""
        with _lock:
            ref, self._model = self._model, None
            if ref is None:
                return
            self._final = self._record.stats()
            model = ref()
            record = None if model is None else _enabled.get(model)
            if record is not None:
                record.handles -= 1
                if record.handles == 0:
                    del _enabled[model]
                    # Its running engines go back to transformers' own padding rule; one that
                    # is preparing a batch with bcg's (and reads the rule again before the
                    # forward) does at that forward, on its own thread, the patches kept
                    # until then.
                    for session in list(_sessions.values()):
                        if session.record is not record:
                            continue
                        if session.preparing:
                            session.hold_patches()
                        else:
                            session.release()
            self._patches.remove()

    def __repr__(self) -> str:
        return f"ContinuousBatchingHandle({'active' if self.active else 'removed'})"


def enable_continuous_batching(
    model: Any, *, attention: Literal["paged", "varlen"] = "paged", capture_after: int = 1
) -> ContinuousBatchingHandle:
    """Run ``model``'s continuous batching forward through breakable graphs.

    Covers ``model.generate_batch``, ``model.init_continuous_batching()`` and
    ``transformers serve``::

        handle = bcg_core.enable_continuous_batching(model)
        outputs = model.generate_batch(prompts, generation_config=gen)
        handle.remove()

    The paged attention (``paged|sdpa`` or ``paged|eager``: load the model with
    ``attn_implementation="sdpa"`` or ``"eager"``; the engine adds ``paged|``) is the break;
    everything else in the step (embeddings, projections, RoPE, MLPs, the logits and the greedy
    or sampled token choice) is captured, one graph per query-token bucket. Buckets come from
    transformers' own ``ContinuousBatchingConfig.q_padding_interval_size`` (its default, 64,
    when unset); the KV read is never padded, and each batch's attention gets exactly the
    arguments the eager engine would give it. On CUDA this replaces transformers' own CUDA
    graphs for the model (``use_cuda_graph`` is ignored, and so are the engine's compile configs,
    with a warning: the step runs uncompiled); a model on the CPU captures with
    bcg's CPU graph backend. The engine's warm-up (on by default: the largest bucket) captures
    at once (bcg first zeroes the cache rows its made-up request reads, which nothing wrote, so
    a sampling engine does not draw from NaN); in serving, a bucket is captured once it recurs
    (``capture_after``), so a bucket met once (the tail of a prefill, say) costs neither a
    capture nor pool memory. An engine started inside :func:`bcg_core.disable_breakable_graphs`
    (``generate_batch`` there, or ``manager.start()``) runs every batch eagerly, on its own
    thread too. An engine joins bcg when it builds its batch processor (``manager.start()``
    or ``manager.warmup()``): one already running when this is called keeps transformers'
    code until it is started again.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention is ``sdpa`` or ``eager``
            (tested with full-attention Llama models and a Gemma 2 of sliding and full
            layers).
        attention: what the break computes. ``"paged"``: transformers' own paged function
            (``paged|sdpa`` over its 4D mask of the packed batch, or ``paged|eager``), so
            greedy tokens equal the eager engine's. ``"varlen"`` (CUDA, fp16/bf16, a torch with
            ``torch.nn.attention.varlen``): the cache update, then
            ``varlen_attn`` over each request's own keys (causal), which skips the packed
            batch's dense mask; numerically another kernel than eager's. A batch the engine
            runs eagerly (graphs disabled with ``BCG_DISABLE=1``, a failed capture) runs the
            same kernel on the same padded batch, so such a run is the reference a replay
            equals bitwise.
        capture_after: batches of a bucket the engine serves eagerly before capturing it,
            outside its warm-up (default 1: captured on the bucket's second batch; 0: on its
            first, as transformers' own graphs are). They count as ``first_batches``.

    Returns:
        A :class:`ContinuousBatchingHandle`; ``remove()`` undoes this call.

    Raises:
        ImportError: transformers is missing or not a supported version (5.17).
        TypeError: ``model`` is not a transformers model (it has no ``config``).
        ValueError: the model's attention is another one (flash, flex), ``attention`` is
            unknown or ``"varlen"`` where torch has no ``varlen_attn``, ``capture_after`` is
            negative, or the model is on a device no graph backend captures (``"mps"``);
            nothing is patched.
        ``"varlen"`` is also refused for a model off CUDA or not in float16/bfloat16, and
        when the engine starts for a model with sliding-window layers. Asynchronous batching
        is turned off (with a warning) for an enabled model's engines.
    """
    _check_transformers()
    if getattr(model, "config", None) is None:  # else "the model's attention is None" misleads
        raise TypeError(
            "bcg_core.enable_continuous_batching takes a transformers model (a PreTrainedModel, "
            f"e.g. AutoModelForCausalLM.from_pretrained(...)), got {type(model).__name__}"
        )
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation not in (*_ATTENTION, *(a.removeprefix(_PAGED) for a in _ATTENTION)):
        raise ValueError(
            f"bcg_core.enable_continuous_batching: the model's attention is {implementation!r}; "
            "bcg makes transformers' paged sdpa and eager attention breaks. Load the model with "
            'attn_implementation="sdpa" (or "eager"), or call model.set_attn_implementation("sdpa")'
        )
    if attention not in ("paged", "varlen"):
        raise ValueError(f'attention must be "paged" or "varlen", got {attention!r}')
    if isinstance(capture_after, bool) or not isinstance(capture_after, int) or capture_after < 0:
        raise ValueError(f"capture_after must be an int >= 0, got {capture_after!r}")
    if attention == "varlen" and _varlen_attn() is None:
        raise ValueError(
            'attention="varlen" needs torch.nn.attention.varlen.varlen_attn (torch >= 2.9); '
            'use attention="paged"'
        )
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        # ValueError for a device no graph backend captures ("mps"), before anything is
        # patched: the engine's runner would refuse it at engine start.
        backend_for_device(device)
    if attention == "varlen" and getattr(device, "type", None) not in _VARLEN_DEVICES:
        raise ValueError(
            'bcg continuous batching: attention="varlen" runs a CUDA kernel (the model is on '
            f'{device}); use attention="paged"'
        )
    dtype = getattr(model, "dtype", None)
    if attention == "varlen" and dtype not in _VARLEN_DTYPES:
        # Else every capture would fail inside the kernel and the engine run eagerly.
        raise ValueError(
            f'bcg continuous batching: attention="varlen" runs a flash kernel, which takes '
            f'float16 and bfloat16 only (the model is {dtype}); use attention="paged", or '
            "cast the model (model.to(torch.bfloat16))"
        )
    with _lock:
        record = _enabled.get(model)
        if record is not None and (record.attention, record.capture_after) != (
            attention,
            capture_after,
        ):
            raise ValueError(
                f"bcg continuous batching is already enabled for this model with "
                f"attention={record.attention!r}, capture_after={record.capture_after}; "
                "remove that handle first"
            )
        patches = _patch()
        if record is None:
            record = _enabled[model] = _Record(attention=attention, capture_after=capture_after)
        record.handles += 1
    return ContinuousBatchingHandle(model, record, patches)


def _check_transformers() -> None:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"bcg_core.enable_continuous_batching needs transformers: {_EXTRA}"
        ) from exc
    version = ".".join(transformers.__version__.split(".")[:2])
    if version not in SUPPORTED_TRANSFORMERS:
        raise ImportError(
            f"bcg_core.enable_continuous_batching patches transformers' continuous batching "
            f"runner, which it supports for transformers {', '.join(SUPPORTED_TRANSFORMERS)}; "
            f"found {transformers.__version__}. Install a supported version, or run the engine "
            "without bcg."
        )


@dataclass
class _Record:
    """An enabled model: its handles, and what its engines did (they come and go per
    ``generate_batch``)."""

    attention: str = "paged"
    capture_after: int = 1
    handles: int = 0
    graphs: int = 0
    graph_bytes: int | None = None
    replays: int = 0
    eager_calls: int = 0
    first_batches: int = 0

    def stats(self) -> ContinuousBatchingStats:
        return ContinuousBatchingStats(
            self.graphs, self.graph_bytes, self.replays, self.eager_calls, self.first_batches
        )


# -- patches ------------------------------------------------------------------------------------

_lock = threading.RLock()
_enabled: weakref.WeakKeyDictionary[Any, _Record] = weakref.WeakKeyDictionary()
_sessions: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()
# Whether the code that started an engine (ContinuousBatchingManager.start) was inside
# disable_breakable_graphs(): the engine's thread runs under the same setting.
_started_disabled: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _patch() -> PatchHandle:
    """One reference on every patch (the engine's methods, the paged attention entries)."""
    from transformers.generation.continuous_batching import continuous_api, model_runner
    from transformers.modeling_utils import AttentionInterface

    runner_cls = model_runner.ModelRunner
    manager_cls = continuous_api.ContinuousBatchingManager
    targets: list[tuple[Any, str, Callable[[Any], Any]]] = [
        (manager_cls, "switch_to_cb_friendly_attn", _wrap_switch),
        (manager_cls, "_create_batch_processor", _wrap_create),
        (manager_cls, "start", _wrap_start),
        (manager_cls, "_run_generation_loop", _wrap_loop),
        (runner_cls, "maybe_pad_inputs", _wrap_pad),
        (runner_cls, "compute_batch", _wrap_compute),
        (runner_cls, "warmup", _wrap_warmup),
    ]
    mapping: dict[str, Any] = AttentionInterface._global_mapping
    targets += [(mapping, name, _WRAP_PAGED[name]) for name in _ATTENTION]
    return PatchHandle.patch_all(targets)


def _wrap_switch(original: Callable[..., Any]) -> Callable[..., Any]:
    def switch_to_cb_friendly_attn(self: Any, model: Any) -> None:
        implementation = model.config._attn_implementation
        with _lock:
            enabled = model in _enabled
        if not enabled or implementation not in ("sdpa", "eager"):
            original(self, model)
            return
        # transformers swaps in flash attention where it is installed, which bcg cannot break
        # on (the engine then failed every request): an enabled model keeps its paged sdpa or
        # eager, given back at stop() as transformers' own switch is.
        model.set_attn_implementation(_PAGED + implementation)
        self._original_attn_impl = implementation

    return switch_to_cb_friendly_attn


def _wrap_create(original: Callable[..., Any]) -> Callable[..., Any]:
    def _create_batch_processor(self: Any) -> Any:
        with _lock:
            enabled = self.model in _enabled
        if enabled and self.continuous_batching_config.use_async_batching:
            # Two IO pairs swapped per batch would need a graph set per pair; bcg keeps one.
            logger.warning(
                "bcg continuous batching: asynchronous batching is turned off for this engine "
                "(bcg graphs use one set of static inputs)"
            )
            self.continuous_batching_config.use_async_batching = False
        config = self.continuous_batching_config
        compiled = [
            name
            for name in ("varlen_compile_config", "decode_compile_config")
            if getattr(config, name, None) is not None
        ]
        if enabled and compiled:
            # bcg's runner calls transformers' uncompiled step: the setting would vanish unseen.
            logger.warning(
                "bcg continuous batching: the engine's %s (set directly, by default_compile_level "
                "or from a compile_config) is not used: bcg runs the engine's step uncompiled "
                "through its own graphs; remove the setting, or remove the bcg handle to run "
                "transformers' compiled step",
                " and ".join(compiled),
            )
        if enabled:
            # stop() (not kept) gave the model its own attention back; a manager started again
            # needs its paged one, as init_continuous_batching() does for a kept manager.
            self.switch_to_cb_friendly_attn(self.model)
        processor = original(self)
        runner = processor.model_runner
        with _lock:
            record = _enabled.get(self.model)
            session = _sessions.get(runner)
            if record is not None and (session is None or session.record is not record):
                _bind(runner, self.model, record)
        return processor

    return _create_batch_processor


def _wrap_start(original: Callable[..., Any]) -> Callable[..., Any]:
    def start(self: Any) -> None:
        # The engine runs its batches on a thread of its own, which does not inherit the
        # caller's context: record whether the caller is inside disable_breakable_graphs() for
        # that thread (BCG_DISABLE, the process-wide switch, is read at every call anyway).
        with _lock:
            _started_disabled[self] = breakable_graphs_disabled() and not bcg_disabled_by_env()
        original(self)

    return start


def _wrap_loop(original: Callable[..., Any]) -> Callable[..., Any]:
    def _run_generation_loop(self: Any) -> None:
        with _lock:
            disabled = _started_disabled.pop(self, False)
        if not disabled:
            original(self)
            return
        with disable_breakable_graphs():  # as the code that started the engine was
            original(self)

    return _run_generation_loop


def _bind(tf_runner: Any, model: Any, record: _Record) -> _Session:
    """A new session for ``tf_runner`` reporting to ``record`` (the model's current one), in
    place of the one it had; caller holds ``_lock``."""
    old = _sessions.pop(tf_runner, None)
    pad_inputs = tf_runner.pad_inputs if old is None else old.pad_inputs
    if old is not None:
        old.release()
    session = _sessions[tf_runner] = _Session(tf_runner, model, record, pad_inputs)
    tf_runner.pad_inputs = True  # the engine then prepares query-padded, static-shape batches
    return session


def _session_of(tf_runner: Any, preparing: bool = False) -> _Session | None:
    """The session serving ``tf_runner``'s next batch: None (transformers' code) unless its model
    is enabled; rebuilt when the model was enabled again since the session was made, so the
    batch reports to the live handles and follows their settings. ``preparing``: the engine
    prepares a batch with the session's padding until its next call here (the forward)."""
    with _lock:
        session = _sessions.get(tf_runner)
        if session is None:
            return None
        session.preparing = False
        model = session.model()
        record = None if model is None else _enabled.get(model)
        if record is None:
            session.release()
            return None
        if record is not session.record:
            session = _bind(tf_runner, model, record)
        session.preparing = preparing
        return session


def _wrap_pad(original: Callable[..., Any]) -> Callable[..., Any]:
    def maybe_pad_inputs(
        self: Any, num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool
    ) -> tuple[int, int]:
        if _session_of(self, preparing=True) is None:
            return original(self, num_q_tokens, max_kv_read, use_decode_fast_path)  # type: ignore[no-any-return]
        # The query is padded to its bucket (the graph's shape) by transformers' own rule; the KV
        # read keeps its length.
        from transformers.generation.continuous_batching.utils import pad_to_interval

        interval = self.cb_config.q_padding_interval_size
        return pad_to_interval(num_q_tokens, interval, self.cache.max_batch_tokens), max_kv_read

    return maybe_pad_inputs


def _wrap_warmup(original: Callable[..., Any]) -> Callable[..., Any]:
    def warmup(self: Any, model: Any) -> None:
        session = _session_of(self)
        if session is None:
            original(self, model)
            return
        session.warming_up = True  # the engine's warm-up batches capture at once
        try:
            original(self, model)
        finally:
            session.warming_up = False

    return warmup


def _wrap_compute(original: Callable[..., Any]) -> Callable[..., Any]:
    def compute_batch(self: Any, model: Any, batch_data: dict[str, Any]) -> None:
        session = _session_of(self)
        if session is None:
            original(self, model, batch_data)
            return
        session.compute(self, model, batch_data)

    return compute_batch


# -- one engine -----------------------------------------------------------------------------------


def _call_weak(step: weakref.WeakMethod[Callable[[int], None]], bucket: int) -> None:
    """Call a session's step through its weak method (the session runs it: it is alive)."""
    method = step()
    assert method is not None, "a session's runner outlived the session"
    method(bucket)


class _Session:
    """bcg's graphs for one engine (one transformers ``ModelRunner``): a runner keyed by the
    query bucket, sharing one pool. It reports to one record (the model's, while enabled);
    ``pad_inputs`` is the runner's own setting, given back by :meth:`release`."""

    def __init__(self, tf_runner: Any, model: Any, record: _Record, pad_inputs: bool) -> None:
        from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

        implementation = model.config._attn_implementation
        if implementation not in _ATTENTION:
            raise ValueError(
                f"bcg continuous batching: the model's attention is {implementation!r}; bcg makes "
                f"the paged attention a break for {' and '.join(_ATTENTION)} only. Load the model "
                'with attn_implementation="sdpa" (or "eager") and build the engine after '
                "enable_continuous_batching() (one built before may have switched it to flash), "
                "or remove the bcg handle."
            )
        if not isinstance(tf_runner.inputs_and_outputs, ContinuousBatchingIOs):
            raise TypeError("bcg continuous batching: asynchronous IO pairs are not supported")
        self.record = record
        self.model = weakref.ref(model)
        self.pad_inputs = pad_inputs
        self._tf_runner = weakref.ref(tf_runner)  # weakly: it keys _sessions
        if record.attention == "varlen" and tf_runner.cache.num_sliding_attention_groups > 0:
            raise ValueError(
                'bcg continuous batching: attention="varlen" covers full attention only (this '
                'model has sliding-window layers); use attention="paged"'
            )
        interval = tf_runner.cb_config.q_padding_interval_size
        device = torch.device(model.device)
        buckets = ceil(tf_runner.cache.max_batch_tokens / interval) if interval > 0 else 1
        # The runner calls the step through a weak method: self._step itself made a cycle
        # (session -> runner -> bound method -> session), which left a dropped engine's graphs,
        # pool and tensors to the garbage collector (on CUDA: a capture lane, a workspace).
        step: weakref.WeakMethod[Callable[[int], None]] = weakref.WeakMethod(self._step)
        self.runner = BreakableGraphRunner(
            lambda bucket: _call_weak(step, bucket),
            device=device,
            max_entries=buckets,
            # One eager run first makes the library handles (cuBLAS) a CUDA capture needs.
            warmup_iters=1,
        )
        self.captured: set[int] = set()
        self.batches: dict[int, int] = {}  # bucket -> batches served before its capture
        self.warming_up = False
        # Between the engine's padding of a batch and its forward: a handle removed then leaves
        # the runner's padding rule alone (the engine reads it again before the forward).
        self.preparing = False
        self._held: weakref.finalize[Any, Any] | None = None  # see hold_patches()
        self._call: tuple[Any, ...] | None = None
        # While a live batch is captured: the cache rows it writes, as they were before it.
        self._written: _Rows | None = None
        # This engine's own eager runs of the step (its thread alone runs them): a replay is
        # told from an eager run by it, not by the record's count, which another engine of
        # the model (another thread) may move meanwhile.
        self._eager_runs = 0

    def release(self) -> None:
        """Give the runner back its own padding rule (its model is no longer enabled)."""
        tf_runner = self._tf_runner()
        if tf_runner is not None:
            tf_runner.pad_inputs = self.pad_inputs
        if self._held is not None:
            self._held()  # the patches' reference, released once

    def hold_patches(self) -> None:
        """One reference on the patches until :meth:`release` (or this session is dropped):
        the engine's forward of the batch it is preparing must still reach the session."""
        if self._held is None:
            self._held = weakref.finalize(self, _patch().remove)

    def compute(self, tf_runner: Any, model: Any, batch_data: dict[str, Any]) -> None:
        io = tf_runner.inputs_and_outputs
        if io.use_block_table:  # the flash decode path; refused at start, kept as a guard
            raise RuntimeError("bcg continuous batching: block-table batches are not supported")
        if tf_runner.supports_logits_to_keep(model):
            batch_data["logits_to_keep"] = batch_data["logits_indices"]
        bucket = int(io.num_q_tokens)
        cb_kwargs = io.get_cb_kwargs()
        self._call = (tf_runner, model, batch_data, cb_kwargs)
        token = _live_batch.set((io, self.record.attention == "varlen"))
        stream = io.compute_stream
        try:
            with _on_stream(stream):
                if self.warming_up:  # on the stream the step reads the cache on
                    _zero_warmup_reads(io)
                if bucket in self.captured or breakable_graphs_disabled():
                    # Disabled, the runner runs the batch eagerly (an eager call, not a first
                    # batch: it does not count towards the bucket's capture).
                    eager = self._eager_runs
                    self.runner(bucket)
                    if self._eager_runs == eager:  # not run eagerly
                        self._count("replays")
                elif self.warming_up or self.batches.get(bucket, 0) >= self.record.capture_after:
                    self._capture(bucket)
                else:
                    # Not yet recurring: served eagerly, as the engine without graphs would.
                    self.batches[bucket] = self.batches.get(bucket, 0) + 1
                    self._count("first_batches")
                    tf_runner._forward_process_and_sample(model, batch_data, *cb_kwargs)
        finally:
            _live_batch.reset(token)
            self._call = None

    def _capture(self, bucket: int) -> None:
        before = self.runner.stats.captures
        assert self._call is not None
        # The capture runs the step on this batch warmup_iters + 1 times (and once more, eagerly,
        # if it fails). A sliding-window layer's update reads rows of the window before writing
        # over them, so each run after the first must start from the cache as it was.
        self._written = _Rows(self._call[0].inputs_and_outputs)
        try:
            self.runner.capture(bucket)
        finally:
            self._written = None
        stats = self.runner.stats
        if stats.captures == before:
            return  # graphs disabled or the capture failed: the batch ran eagerly
        self.captured.add(bucket)
        self._count("graphs")
        size = stats.entries[-1].pool_bytes
        if size is not None:
            with _lock:
                self.record.graph_bytes = max(size, self.record.graph_bytes or 0)

    def _count(self, counter: str) -> None:
        # Under the lock: engines of one model share its record from their own threads.
        with _lock:
            setattr(self.record, counter, getattr(self.record, counter) + 1)

    def _step(self, bucket: int) -> None:
        assert self._call is not None, "the step runs inside compute() only"
        tf_runner, model, batch_data, cb_kwargs = self._call
        written = self._written
        if not is_in_breakable_cuda_graph():
            self._eager_runs += 1
            self._count("eager_calls")
            if written is not None:  # after a capture that failed (part-way) on this batch
                written.restore()
        elif written is not None and not is_breakable_capture_active():
            try:  # a warm-up: the capture, next, starts from the batch's cache
                tf_runner._forward_process_and_sample(model, batch_data, *cb_kwargs)
            finally:
                written.restore()
            return
        tf_runner._forward_process_and_sample(model, batch_data, *cb_kwargs)


class _Rows:
    """The paged cache rows the batch ``io`` holds writes (every layer's keys and values), as
    they are now; :meth:`restore` puts them back."""

    def __init__(self, io: Any) -> None:
        cache = io.cache
        self._rows = torch.cat(_write_index(io))
        self._saved = [
            (layer, layer.index_select(0, self._rows))
            for layer in (*cache.key_cache, *cache.value_cache)
        ]

    def restore(self) -> None:
        for layer, saved in self._saved:
            layer.index_copy_(0, self._rows, saved)


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    # The engine's compute stream (CUDA; None on CPU), as its own eager path uses it.
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


# -- the attention break ------------------------------------------------------------------------


def _breakable_paged(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``function`` (a paged attention of transformers) that, inside a bcg continuous-batching
    forward, runs as one ``@eager_on_graph`` break on the live batch's true sizes."""

    def paged_attention_break(
        module: Any,
        query: Any,
        key: Any,
        value: Any,
        io: Any,
        varlen: bool,
        layer_type: str | None,
        kwargs: dict[str, Any],
    ) -> Any:
        tokens = int(io.total_seqlen_q)
        mask, read_index, write_index = _eager_arguments(io, tokens, layer_type)
        q, k, v = query[:, :, :tokens], key[:, :, :tokens], value[:, :, :tokens]
        if varlen:
            out = _varlen_attention(module, q, k, v, io, read_index, write_index, kwargs)
        else:
            out, _ = function(
                module, q, k, v, mask,
                cache=io.cache, read_index=read_index, write_index=write_index, **kwargs,
            )  # fmt: skip
        if out.shape[1] == query.shape[2]:
            return out
        # The bucket's padded rows: zeros (nothing reads them but the padded logits).
        padded = out.new_zeros((out.shape[0], query.shape[2], *out.shape[2:]))
        padded[:, :tokens] = out
        return padded

    as_break = eager_on_graph(name=f"transformers continuous batching attention ({name})")(
        paged_attention_break
    )

    def attention(module: Any, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any) -> Any:
        live = _live_batch.get()
        if live is None:
            return function(module, query, key, value, mask, **kwargs)
        io, varlen = live
        for replaced in ("cache", "read_index", "write_index"):
            kwargs.pop(replaced, None)
        # Which of the batch's masks the model gave this layer (a model with sliding and full
        # layers has one per layer type): the break rebuilds that one at its true size.
        args = (module, query, key, value, io, varlen, _layer_type(io, mask), kwargs)
        if not is_in_breakable_cuda_graph():
            # A batch run eagerly (a bucket's first batches, graphs disabled, a failed capture)
            # computes what a replay computes: the same kernel on the batch's true tokens.
            return paged_attention_break(*args), None
        return as_break(*args), None

    attention.__name__ = attention.__qualname__ = getattr(function, "__name__", "attention")
    attention.__doc__ = function.__doc__
    return attention


# One wrap per entry, made once: the same wrap object is what shares a patch between handles.
_WRAP_PAGED = {name: functools.partial(_breakable_paged, name=name) for name in _ATTENTION}


def _layer_type(io: Any, mask: Any) -> str | None:
    """The layer type (``"full_attention"``, ``"sliding_attention"``) whose mask of the batch
    ``io`` holds ``mask`` views: the one the model picked for the layer; None without masks."""
    if io.attention_mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        storage = mask.untyped_storage().data_ptr()
        for layer_type, full in io.attention_mask.items():
            if full.untyped_storage().data_ptr() == storage:
                return str(layer_type)
    raise RuntimeError(
        "bcg continuous batching: the paged attention was given a mask that is none of the "
        f"engine's masks ({', '.join(io.attention_mask)}); run this model's engine without bcg"
    )


def _eager_arguments(
    io: Any, tokens: int, layer_type: str | None
) -> tuple[Any, list[Any], list[Any]]:
    """The mask and cache indices the eager engine (no padding) passes to a layer of
    ``layer_type`` for the batch ``io`` holds: ``ContinuousBatchingIOs.get_model_kwargs(
    use_padding=False)`` for ``tokens`` query tokens, read from the same static storage."""
    write_index = _write_index(io)
    read_index = _read_index(io)
    if layer_type is None:
        return None, read_index, write_index
    mask = io.attention_mask[layer_type][..., :tokens, : io.total_seqlen_k[layer_type]]
    return mask, read_index, write_index


def _write_index(io: Any) -> list[Any]:
    """The cache rows each layer group of the batch ``io`` holds writes (its true length)."""
    return [io.write_index_storage[g, : io.true_write_sizes[g]] for g in range(io.cache.num_groups)]


def _read_index(io: Any) -> list[Any]:
    """The cache rows each layer group of the batch ``io`` holds reads (its true length)."""
    return [
        io.read_index_storage[g, : 0 if io.max_kv_read == 0 else io.true_read_sizes[g]]
        for g in range(io.cache.num_groups)
    ]


def _zero_warmup_reads(io: Any) -> None:
    """Zero the cache rows the engine's warm-up batch ``io`` reads, before it runs.

    transformers' warm-up batch is one made-up request whose ``max_kv_read`` tokens (nearly the
    whole cache) are said to be in the cache already, but nothing wrote them: the cache is
    ``torch.empty``, and attention over its leftover bytes gives NaN/inf logits, on which a
    sampling engine's ``torch.multinomial`` fails the capture (on CUDA: a device-side assert).
    The rows belong to blocks just allocated to the made-up request (never a live request's,
    nor a prefix-cached block: allocation takes uninitialised blocks), plus the zeroed read
    trash; the batch's own new keys are written over their rows by the cache update. Zeros are
    what transformers' padding tokens read (its read trash block).
    """
    cache = io.cache
    for rows in _read_index(io):
        if rows.numel():
            for layer in (*cache.key_cache, *cache.value_cache):
                layer.index_fill_(0, rows, 0)


@functools.cache
def _varlen_attn() -> Callable[..., Any] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _varlen_keywords() -> tuple[dict[str, Any], bool]:
    """How this torch's ``varlen_attn`` is asked for causal attention (``window_size=(-1, 0)``
    in newer releases, ``is_causal`` in the first ones) and whether it takes ``enable_gqa``."""
    params = inspect.signature(_varlen_attn()).parameters  # type: ignore[arg-type]
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return causal, "enable_gqa" in params


def _varlen_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    io: Any,
    read_index: list[Any],
    write_index: list[Any],
    kwargs: dict[str, Any],
) -> Any:
    """The paged cache update, then causal ``varlen_attn`` over each request's keys: query
    ``[1, H, tokens, D]`` -> ``[1, tokens, H, D]``, the layout transformers' paged functions
    return. The cache returns every request's keys packed in batch order, as ``cu_seq_lens_k``
    counts them."""
    varlen_attn = _varlen_attn()
    assert varlen_attn is not None  # checked when enabled
    k, v = io.cache.update(
        key_states=key,
        value_states=value,
        layer_idx=module.layer_idx,
        read_index=read_index,
        write_index=write_index,
    )
    q = query[0].transpose(0, 1).contiguous()  # [tokens, H, D]
    k, v = k.contiguous(), v.contiguous()  # [keys, KV heads, D]
    n = io.num_request_in_batch
    layer = "full_attention"
    causal, gqa = _varlen_keywords()
    options: dict[str, Any] = {"scale": kwargs.get("scaling"), **causal}
    if q.shape[1] != k.shape[1]:
        if gqa:
            options["enable_gqa"] = True
        else:  # this torch's varlen_attn has no GQA: repeat the KV heads
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = varlen_attn(
        q,
        k,
        v,
        io.cumulative_seqlens_q[: n + 1],
        io.cumulative_seqlens_k[layer][: n + 1],
        int(io.max_seqlen_q),  # the bucket (an upper bound) once the engine padded the batch
        int(io.max_seqlen_k[layer]),
        **options,
    )
    return out.unsqueeze(0)
