"""DiTRunner: bcg-core's signature-keyed runner, set up for diffusion transformers."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree  # noqa: PLC2701  (the one walker: torch's pytree)

from bcg_core import BreakableGraphRunner, DivergenceReport, PatchHandle
from bcg_diffusion._attention import patch_attention_classes
from bcg_diffusion._diffusers import patch_new_attention
from bcg_diffusion._tokens import ReplayTokenScope

logger = logging.getLogger("bcg_diffusion")

# The runner each handle given as breakable_attention= belongs to (a runner dropped without
# close() owns it no more).
_owned_lock = threading.Lock()
_owned: weakref.WeakKeyDictionary[PatchHandle, weakref.ref[DiTRunner]] = weakref.WeakKeyDictionary()


# warmup() yields the runner itself, typed as the caller's class (see BreakableGraphRunner).
_DiT = TypeVar("_DiT", bound="DiTRunner")


class DiTRunner(BreakableGraphRunner):
    """Replays a DiT one captured graph per signature, with attention modules as break points.

    On top of :class:`bcg_core.BreakableGraphRunner` (whose rules all apply): the runner holds
    its own reference on the attention patches it is given, released by :meth:`close` (another
    runner patching the same classes keeps its breaks), and every replay runs inside
    :func:`replay_token_scope`, so eager attention code can cache per-replay metadata once and
    reuse it in every layer. Two ways to say what breaks:

    - ``breakable_attention=make_attention_ops_breakable(model)``: every attention op of a
      diffusers transformer (projections stay captured); the runner owns the handle;
    - ``attention_classes=(MyAttention,)``: each class's ``forward`` (or a processor class's
      ``__call__``) is one break.

    An output-format flag is not part of a graph's signature: ``return_dict``, when the model
    takes it, is left to the model's default (diffusers: ``True``) at capture and at every
    call, and a call asking ``return_dict=False`` gets ``output.to_tuple()`` of the same
    output. So ``capture(...)`` and ``runner(..., return_dict=False)`` replay one graph. The
    first such call runs the model once more, eagerly, with ``return_dict=False``, to check
    that this form is that tuple; a model whose form is another (Kandinsky 5's bare tensor)
    keeps ``return_dict=False`` in its calls and gets its own graph of its own output.

    Typical use::

        runner = DiTRunner(model, breakable_attention=make_attention_ops_breakable(model))
        for latents, t, text in warmup_shapes:
            runner.capture(latents, t, text)      # one graph per resolution / prompt bucket
        for step in range(50):
            noise = runner(latents, t, text)      # replays; unknown shapes run eagerly

    Args:
        model: the diffusion transformer (or any callable) to stand in for.
        attention_classes: classes whose attention method becomes one break each (default:
            none); patched when the runner is made.
        breakable_attention: a handle from :func:`make_attention_ops_breakable`, which the
            runner then owns and releases on :meth:`close` (default None).
        **runner_options: keyword arguments of :class:`bcg_core.BreakableGraphRunner`
            (``device``, ``max_entries``, ``as_tensor`` ...); ``replay_context`` defaults to
            :func:`replay_token_scope`.

    Raises:
        TypeError: ``breakable_attention`` is not a :class:`PatchHandle`, an attention class
            has no ``forward`` or ``__call__``, or as in :class:`bcg_core.BreakableGraphRunner`.
        ValueError: ``breakable_attention`` was removed already or is owned by another live
            runner (nothing is released then), or as in :class:`bcg_core.BreakableGraphRunner`.
    """

    def __init__(
        self,
        model: Callable[..., Any],
        *,
        attention_classes: tuple[type, ...] = (),
        breakable_attention: PatchHandle | None = None,
        **runner_options: Any,
    ) -> None:
        if breakable_attention is not None and not isinstance(breakable_attention, PatchHandle):
            raise TypeError(
                "breakable_attention takes the handle make_attention_ops_breakable(model) "
                f"returns, got {breakable_attention!r}"
            )
        # A removed handle holds no patch, and one another runner owns goes when that runner
        # closes: either way this runner would capture its attention with no break, silently.
        if breakable_attention is not None and not breakable_attention.active:
            raise ValueError(
                f"breakable_attention={breakable_attention!r} was removed already; pass a new "
                "make_attention_ops_breakable(model)"
            )
        with _owned_lock:
            owner = None if breakable_attention is None else _owned.get(breakable_attention)
            if owner is not None and owner() is not None:
                raise ValueError(
                    "breakable_attention is owned by another DiTRunner (closing it removes the "
                    "patch); give each runner its own make_attention_ops_breakable(model) "
                    "(the patches are reference-counted)"
                )
            if breakable_attention is not None:
                _owned[breakable_attention] = weakref.ref(self)
        try:
            given: object = attention_classes  # typed as a tuple; callers pass one class too
            if isinstance(given, type):
                raise TypeError(
                    "attention_classes takes a tuple of classes, e.g. "
                    f"attention_classes=({given.__qualname__},); got the class itself"
                )
            # The class itself: making one runs no Python code (replay_token_scope() would).
            runner_options.setdefault("replay_context", ReplayTokenScope)
            super().__init__(model, **runner_options)
            patches = [patch_attention_classes(*attention_classes)]
        except BaseException:
            # The runner owns the handle it was given: a runner that was never made releases it.
            if breakable_attention is not None:
                breakable_attention.remove()
                with _owned_lock:
                    _owned.pop(breakable_attention, None)
            raise
        if breakable_attention is not None:
            patches.append(breakable_attention)
        counting = _count_model_changes(model)
        if counting is not None:
            patches.append(counting)
        self._patches: list[PatchHandle] = patches
        # The model's diffusers hooks, attention processors and backends (_model_state) as of
        # a value of _model_changes (_setup: one attribute, so another thread reads a count
        # with the state read after it, never a count with an older state), and when the
        # graphs were captured (None: nothing captured since the last reset).
        self._setup: tuple[int, _State] = (-1, ())
        self._setup_captured: _State | None = None
        self._breakable_attention = breakable_attention
        self._closed = False
        self._return_dict_default = _return_dict_default(model)
        # Whether the model's return_dict=False form is a tuple (diffusers' convention, which
        # to_tuple() reproduces): learnt from one eager call the first time it matters.
        self._false_is_tuple: bool | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model through the graph captured for this call's signature.

        As :meth:`bcg_core.BreakableGraphRunner.__call__`, except that ``return_dict`` is left
        out of the signature: ``return_dict=False`` on a model that returns a dict gets the
        dict's ``to_tuple()``, so a capture and a call that differ only there replay one graph.

        Args:
            *args: the model's positional arguments.
            **kwargs: the model's keyword arguments (``return_dict`` included).

        Returns:
            The model's output (a replay's, or an eager run's on a miss).

        Raises:
            BreakOutputError: at replay, a break returned other tensors or plain values than
                at capture.
        """
        # The usual call has no return_dict: told without a frame before the replay's launch.
        as_tuple = "return_dict" in kwargs and self._pop_format(kwargs, args)
        seen, now = self._setup
        if _model_changes[0] != seen:  # one int read when nothing was set
            # The count before the state: a change made while reading is the next call's.
            seen = _model_changes[0]
            now = _model_state(self.module)
            # The capture's own tuple when equal: a call then compares identities, not every
            # attention module's entry.
            now = self._setup_captured if now == self._setup_captured else now
            self._setup = (seen, now)
        if self._setup_captured is not None and now is not self._setup_captured:
            out = self._other_setup(args, kwargs)
        else:
            out = super().__call__(*args, **kwargs)
        if not as_tuple:
            return out
        if as_tuple is True:
            return out.to_tuple()
        return self._settle(out, as_tuple)

    def check_divergence(self, *args: Any, **kwargs: Any) -> DivergenceReport:
        """Compare eager and replay for this call, as the base runner's check does.

        ``return_dict`` is dropped from the call first, as in :meth:`__call__`.

        Args:
            *args: the model's positional arguments.
            **kwargs: the model's keyword arguments.

        Returns:
            The :class:`bcg_core.DivergenceReport`.

        Raises:
            ValueError: no graph is captured for the call's signature.
        """
        if "return_dict" in kwargs:
            self._pop_format(kwargs, args)
        return super().check_divergence(*args, **kwargs)

    def _pop_format(self, kwargs: dict[str, Any], args: tuple[Any, ...]) -> bool | _Probe:
        """Drop ``return_dict`` (the caller found it in ``kwargs``) from a call's keywords (the
        model's default then applies); True when the caller asked for the tuple form of a
        dict-returning model whose ``return_dict=False`` form is its output's ``to_tuple()``;
        a :class:`_Probe` while that is being learnt (the first such call)."""
        default = self._return_dict_default
        if default is None:
            return False
        wanted = kwargs["return_dict"]
        if wanted == default:
            del kwargs["return_dict"]
            return False
        if default is True and wanted is False:
            known = self._false_is_tuple
            if known is None:
                if self.serves_eagerly:
                    return False  # one eager run of the call as given: nothing to learn from
                probe = self._probe_tuple_form(args, kwargs)
                if probe is None:
                    self._false_is_tuple = False
                    return False
                del kwargs["return_dict"]
                return probe
            if known:
                del kwargs["return_dict"]
                return True
        return False  # another value: passed on, and part of the signature

    def _probe_tuple_form(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Probe | None:
        """Run the model once eagerly with ``return_dict=False`` (the first time a call asks
        for it): None when that form is no tuple, else the :class:`_Probe` that
        :meth:`_settle` checks against ``to_tuple()`` of the call's output. Not every model
        follows diffusers' convention: Kandinsky 5 returns the bare tensor, which
        ``to_tuple()`` would wrap (and ``out[0]`` then index the batch). A model that does not
        keeps ``return_dict=False`` in the call and in its signature, so it replays its own
        graph of its own output."""
        out = self.module(*args, **kwargs)
        if isinstance(out, tuple):
            return _Probe(out)
        self._log_own_form(f"a {type(out).__name__}, not a tuple")
        return None

    def _settle(self, out: Any, probe: _Probe) -> Any:
        """The first ``return_dict=False`` call's result: ``out.to_tuple()`` when it has the
        structure of the probe's eager ``return_dict=False`` output (and later calls are
        translated too); else the probe's output itself (the eager result of this very call),
        and later calls keep ``return_dict=False`` in the call and the signature."""
        to_tuple = getattr(out, "to_tuple", None)
        got = to_tuple() if callable(to_tuple) else None
        if isinstance(got, tuple) and _same_structure(got, probe.out):
            self._false_is_tuple = True
            return got
        self._false_is_tuple = False
        self._log_own_form(
            f"not the to_tuple() of its default output (a {type(out).__name__})",
            " (capture with return_dict=False for a graph of that form)",
            logging.WARNING,
        )
        return probe.out

    def _log_own_form(self, what: str, then: str = "", level: int = logging.INFO) -> None:
        logger.log(
            level,
            "bcg: the return_dict=False output of %s is %s: calls passing return_dict=False "
            "get their own graph%s",
            type(self.module).__name__,
            what,
            then,
        )

    @contextlib.contextmanager
    def warmup(self: _DiT) -> Iterator[_DiT]:
        """As :meth:`bcg_core.BreakableGraphRunner.warmup`, refused for hooks no graph replays.

        ``capture`` and ``capture_many`` open one too, so they are refused alike.

        Yields:
            This runner.

        Raises:
            ValueError: the model (or a submodule) carries a stateful diffusers hook, such as
                the caches ``enable_cache`` installs, or one that casts or moves the weights
                around forwards (``enable_layerwise_casting``, ``enable_group_offload``,
                accelerate's CPU offload from ``enable_model_cpu_offload`` or
                ``enable_sequential_cpu_offload``); no window is opened.
        """
        # Those hooks decide on the host at every step whether to recompute or reuse (PAB,
        # TaylorSeer, FasterCache...): a graph would replay the capture's decision at every step.
        stateful, weights = _diffusers_hooks(self.module)
        if stateful:
            raise ValueError(
                f"bcg: {type(self.module).__name__} carries diffusers' stateful hooks "
                f"{sorted(stateful)} (a cache from enable_cache() or apply_*): they decide at "
                "every step on the host, and a graph would replay the capture's decision. "
                "Call model.disable_cache() (or remove the hooks) before capturing, or run the "
                "model without DiTRunner"
            )
        if weights:
            raise ValueError(
                f"bcg: {type(self.module).__name__} carries hooks {sorted(weights)} "
                "(enable_layerwise_casting(), enable_group_offload(), a pipeline's "
                "enable_model_cpu_offload() or enable_sequential_cpu_offload()): they cast or "
                "move the weights around forwards, giving them new storage, so a graph would "
                "read the capture's copies of the weights (freed memory once offloaded). Load "
                "the model without them (weights in the compute dtype, on the device: "
                "pipe.to('cuda') instead of CPU offload) to capture it, or run it without "
                "DiTRunner"
            )
        self._patch_new_attention()
        if self._setup_captured is None or not self.stats.entries:
            self._take_setup()
        with super().warmup() as runner:
            yield runner

    def reset(self) -> None:
        """Drop every graph, as :meth:`bcg_core.BreakableGraphRunner.reset` does.

        The next capture window takes the model's diffusers hooks, attention processors and
        backends as they are then (calls under others than a window's run eagerly); a window
        open at the reset takes them as they are at the reset.

        Raises:
            RuntimeError: called from a break of this runner's own replay or capture (nothing
                is reset then).
        """
        super().reset()
        if self._window:
            # A window still open captures again: under the state now (None let a call under
            # other processors replay what it captured).
            self._take_setup()
        else:
            self._setup_captured = None

    def _take_setup(self) -> None:
        """Graphs captured from now on are under the model's state as it is now."""
        seen = _model_changes[0]  # before the state: a change made while reading is seen
        self._setup_captured = _model_state(self.module)
        self._setup = (seen, self._setup_captured)

    def _other_setup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run eagerly (a miss) a call made under other diffusers hooks, attention processors
        or backends than the graphs' capture: a guider's layer-skip hooks or a PAG pipeline's
        processors, set around its call only, changed what the forward computes with the same
        inputs, and a replay gave the capture's output."""
        return self._eager_miss(
            "the model carries other diffusers hooks, attention processors or attention "
            "backend than at capture (a guider's layer skip, set_attn_processor, "
            "set_attention_backend); call reset() and capture again to replay under these",
            (args, kwargs),
        )

    def _patch_new_attention(self) -> None:
        """Before a capture: patch attention the model gained since its
        ``breakable_attention`` handle was made (``set_attn_processor``, an IP-Adapter loaded
        after ``make_attention_ops_breakable``), held until :meth:`close`. Unpatched, such a
        processor was captured whole: an IP-Adapter ``scale`` changed later replayed stale."""
        if self._breakable_attention is None:
            return
        extra = patch_new_attention(self._breakable_attention)
        if extra is None:
            return
        with _owned_lock:  # close() takes the list under this lock: nothing is added after
            if not self._closed:  # a closed runner captures nothing: it keeps no new patch
                self._patches.append(extra)
                return
        extra.remove()

    def close(self) -> None:
        """Drop all graphs and release this runner's attention patches (idempotent).

        Patches that other runners or :func:`install_breakable_attention` hold stay in place.
        A closed runner serves every call eagerly (:attr:`disabled_reason` says so), also
        after :meth:`reset`: make a new runner to capture again.

        Raises:
            RuntimeError: called from a break of this runner's own replay or capture (nothing
                is closed or released then).
        """
        closed, self._closed = self._closed, True
        try:
            self.reset()
        except BaseException as exc:
            # Refused from a break of its own replay: still open, its patches in place (marked
            # closed, a later reset() disabled it saying its patches were released).
            self._closed = closed
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note("bcg: raised by DiTRunner.close(), which resets the runner first")
            raise
        with _owned_lock:
            patches, self._patches = self._patches, []
        for patch in patches:
            patch.remove()
        with _owned_lock:
            for patch in patches:
                _owned.pop(patch, None)

    def _disabled_after_reset(self) -> str | None:
        """A closed runner stays disabled, also after :meth:`reset`. Said by the reset itself,
        under its lock: set after it returned, another thread's call in a warm-up window
        between the two captured a graph that the closed runner then kept."""
        if not self._closed:
            return None
        # Its breaks are released: a graph captured now would hold the attention it was made
        # to break (state that attention reads would replay stale).
        return (
            "the DiTRunner was closed and its attention patches released; make a new "
            "DiTRunner to capture again"
        )


class _Probe:
    """The eager ``return_dict=False`` output of the first call asking for it (always true)."""

    __slots__ = ("out",)

    def __init__(self, out: tuple[Any, ...]) -> None:
        self.out = out


def _same_structure(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` have the same containers, tensor shapes and dtypes, and leaf
    types (values are not compared: a replay and an eager run may differ in rounding)."""
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    return spec_a == spec_b and all(map(_same_leaf, leaves_a, leaves_b))


def _same_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype
    return type(a) is type(b)


# Wrapper layers looked through for return_dict (a guard against self-referencing wrappers).
_MAX_UNWRAP = 32


# diffusers' hooks (their registry names) that give every weight new storage around each
# forward: enable_layerwise_casting() casts it to the compute dtype and back, group offloading
# moves it on and off the device. Under a graph the capture's casts were replayed from the
# capture-time storage into the parameters, so a weight update after capture was overwritten
# (and on CUDA that storage is freed once the forward rebinds the parameter).
_WEIGHT_HOOKS = frozenset(
    {"layerwise_casting", "group_offloading", "lazy_prefetch_group_offloading"}
)


def _hooked_module(model: Callable[..., Any]) -> torch.nn.Module | None:
    """The module whose diffusers hooks count: the model, looked through wrappers as for
    ``return_dict`` (a bound method's module too); None for a closure over a model."""
    target: Any = model
    for _ in range(_MAX_UNWRAP):
        if isinstance(target, torch.nn.Module):
            return target
        inner = getattr(target, "__self__", None) or getattr(target, "__wrapped__", None)
        if inner is None or inner is target:
            return None
        target = inner
    return None


# Bumped by every call of the diffusers setters below while a DiTRunner patches them (a guider
# adds layer-skip hooks around its perturbed call and removes them after it; a PAG pipeline
# sets its processors around its call): a call reads this one int to learn that the model's
# hooks, processors or backend may have changed. Bumped under a lock (two threads adding hooks
# must not lose a change); read without one (a stale read is the next call's change).
_model_changes = [0]
_model_changes_lock = threading.Lock()


def _counting(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def counted(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:
            with _model_changes_lock:
                _model_changes[0] += 1

    return counted


# (module, class, methods) of diffusers that change a model's hooks, attention processors or
# attention backend: what set_attn_processor, fuse_qkv_projections, IP-Adapters, PAG and
# set_attention_backend / attention_backend() go through. Those a diffusers version lacks are
# skipped. A processor assigned directly elsewhere (module.processor = p) is not counted.
_SETTERS = (
    ("diffusers.hooks.hooks", "HookRegistry", ("register_hook", "remove_hook")),
    (
        "diffusers.models.attention",
        "AttentionModuleMixin",
        ("set_processor", "set_attention_backend", "fuse_projections", "unfuse_projections"),
    ),
    (
        "diffusers.models.attention",
        "AttentionMixin",
        ("fuse_qkv_projections", "unfuse_qkv_projections"),
    ),
    ("diffusers.models.attention_processor", "Attention", ("set_processor", "fuse_projections")),
    (
        "diffusers.models.modeling_utils",
        "ModelMixin",
        ("set_attention_backend", "reset_attention_backend"),
    ),
    ("diffusers.models.attention_dispatch", "_AttentionBackendRegistry", ("set_active_backend",)),
    # PAG pipelines assign module.processor themselves here (restored by set_attn_processor).
    ("diffusers.pipelines.pag.pag_utils", "PAGMixin", ("_set_pag_attn_processor",)),
)


def _count_model_changes(model: Callable[..., Any]) -> PatchHandle | None:
    """Patch diffusers' setters of hooks, attention processors and backends
    (:data:`_SETTERS`) to count changes; None for a model that is no diffusers model (no
    patch, nothing to release: a toy model's runner never closed leaves diffusers alone)."""
    target = _hooked_module(model)
    # (Its modules, not its class: a torch.compile(model) is torch's module around it.)
    if target is None or not any(
        type(sub).__module__.startswith("diffusers.") for sub in target.modules()
    ):
        return None
    patches = []
    for module_name, class_name, methods in _SETTERS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        patches += [(cls, name, _counting) for name in methods if hasattr(cls, name)]
    return PatchHandle.patch_all(patches) if patches else None


# What _model_state gives: per module index, its diffusers hook names, or its attention
# processor's class, that processor's backend and whether its projections are fused; and the
# process's active attention backend.
_State = tuple[Any, ...]


def _model_state(model: Callable[..., Any]) -> _State:
    """The model's diffusers hooks, attention processors and attention backends (a
    :data:`_State`); compared, not read: a call under another state than the capture's is a
    miss."""
    target = _hooked_module(model)
    if target is None:
        return ()
    state: list[Any] = []
    for i, sub in enumerate(target.modules()):
        hooks = getattr(getattr(sub, "_diffusers_hook", None), "hooks", None)
        if hooks:
            state.append((i, tuple(hooks)))
        if hasattr(sub, "set_processor"):  # diffusers' attention modules (as attn_processors)
            processor = getattr(sub, "processor", None)
            backend = getattr(processor, "_attention_backend", None)
            fused = bool(getattr(sub, "fused_projections", False))
            state.append((i, type(processor), backend, fused))
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    registry = getattr(dispatch, "_AttentionBackendRegistry", None)
    state.append(getattr(registry, "_active_backend", None))
    return tuple(state)


def _diffusers_hooks(model: Callable[..., Any]) -> tuple[set[str], set[str]]:
    """Names of the diffusers hooks on the model's modules that no graph can replay: the
    stateful ones (``ModelHook._is_stateful``: the caches), and those that cast or move the
    weights at every forward (:data:`_WEIGHT_HOOKS`). The model is found by
    :func:`_hooked_module`."""
    target = _hooked_module(model)
    if target is None:
        return set(), set()
    stateful: set[str] = set()
    weights: set[str] = set()
    for sub in target.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        for name, hook in getattr(registry, "hooks", {}).items():
            if getattr(hook, "_is_stateful", False):
                stateful.add(name)
            elif name in _WEIGHT_HOOKS:
                weights.add(name)
        weights.update(_accelerate_offload_hooks(getattr(sub, "_hf_hook", None)))
    return stateful, weights


def _accelerate_offload_hooks(hook: Any) -> set[str]:
    """accelerate's hooks (``module._hf_hook``) that move the weights off the device between
    forwards: a pipeline's ``enable_model_cpu_offload()`` (``CpuOffload``) and
    ``enable_sequential_cpu_offload()`` (``AlignDevicesHook(offload=True)``). Told by class
    name and attribute, so accelerate is never imported; a ``SequentialHook`` is looked into.
    Hooks that only move inputs (``device_map`` dispatch) leave the weights where they are."""
    if hook is None:
        return set()
    found: set[str] = set()
    for inner in getattr(hook, "hooks", None) or (hook,):
        name = type(inner).__name__
        if name in ("CpuOffload", "UserCpuOffloadHook") or getattr(inner, "offload", False):
            found.add(f"accelerate {name}")
    return found


def _return_dict_default(model: Callable[..., Any]) -> Any:
    """The default of the model's ``return_dict`` parameter (None when it has none).

    Wrappers are looked through first: ``torch.compile(model)`` (an ``OptimizedModule``,
    whose ``forward`` takes ``*args, **kwargs``) by its ``_orig_mod``, decorated callables by
    their ``__wrapped__``."""
    target: Any = model
    for _ in range(_MAX_UNWRAP):
        inner = getattr(target, "_orig_mod", None)
        if inner is None:
            inner = getattr(target, "__wrapped__", None)
        if inner is None or inner is target:
            break
        target = inner
    try:
        parameters = inspect.signature(getattr(target, "forward", target)).parameters
    except (TypeError, ValueError):
        return None
    param = parameters.get("return_dict")
    if param is None or param.default is inspect.Parameter.empty:
        return None
    return param.default
