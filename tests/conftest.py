"""Repository-wide pytest set-up: the ``cuda`` marker skips cleanly on machines without a GPU,
and the ``device`` fixture runs a scenario on the CPU graph backend and, where a GPU is
present, on CUDA graphs, with the same assertions."""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

_NO_CUDA = "needs a CUDA GPU and none is available here; run tools/device_tests.sh on a GPU machine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=_NO_CUDA)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> Iterator[str]:
    """Shared scenarios run on both backends: tensors are created on the parametrised device
    (torch's default device), and ``graph_helpers.device_graph()`` picks the matching backend."""
    param: str = request.param
    if param == "cuda":
        # Library handles (cuBLAS, cuBLASLt, attention) must exist before a capture, as with
        # any CUDA graph: creating one inside a capture fails.
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.ones(1, 1, 8, 8, device="cuda", dtype=dtype)
            (a @ a).sum()
            torch.nn.functional.scaled_dot_product_attention(a, a, a)
        torch.cuda.synchronize()
    torch.set_default_device(param)
    try:
        yield param
    finally:
        torch.set_default_device(None)


# -- the leak guard: bcg leaves no capture state behind a test ------------------------------------
# One test's outcome must not depend on another having run first. After each test this checks
# that bcg's context variables are at their defaults, its refcounted hooks and pauses are all
# released, the attributes it hooks are back to what they were before the test, and torch's
# grad mode, inference mode, default dtype and device are as before. A leak fails the test at
# teardown, naming what leaked, and is then undone so that it does not fail the tests after it.
# Modules are read from sys.modules (none is imported here): one not imported yet holds nothing.

# Attributes bcg hooks during a capture (the CPU recorder's and the CUDA backend's hooks), as
# (owner's path, attribute).
_HOOKED = (
    *(("torch.Tensor", name) for name in ("tolist", "numpy", "__repr__", "cpu")),
    ("torch.cuda", "is_current_stream_capturing"),
    *((module, name) for module in ("torch", "torch.random") for name in ("manual_seed", "seed")),
    ("torch.cuda", "set_stream"),
    ("torch.cuda.Event", "record"),
    ("torch.cuda.Event", "wait"),
    ("torch.cuda.Stream", "__enter__"),
    ("gc", "enable"),
    ("gc", "disable"),
)
# Counts of open blocks (process-wide, refcounted) that must be back to 0: (module, name).
_COUNTS = (
    ("bcg_core._backends.cpu_recorder", "_hooks_refcount"),
    ("bcg_core._backends.cpu_recorder", "_removers"),
    ("bcg_core._capture.streams", "_installed"),
    ("bcg_core._capture.context", "_by_stream"),
    ("bcg_core._capture.context", "_routed_warmups"),
    ("bcg_core._capture.breaks", "_observing"),
    ("bcg_core._capture.gc_pause", "_open"),
    ("bcg_core._capture.compiles", "_open"),
)
_ABSENT = object()
_vars: dict[str, list[tuple[str, contextvars.ContextVar[Any], Any]]] = {}  # module -> its vars
_all_vars: list[tuple[str, contextvars.ContextVar[Any], Any]] = []
_seen_modules = 0  # len(sys.modules) at the last look for them


def _owner(path: str) -> Any:
    obj: Any = sys.modules.get(path.split(".")[0])
    for part in path.split(".")[1:]:
        obj = getattr(obj, part, None)
    return obj


def _hooked() -> list[Any]:
    return [getattr(_owner(owner), name, _ABSENT) for owner, name in _HOOKED]


def _context_vars() -> list[tuple[str, contextvars.ContextVar[Any], Any]]:
    """bcg's context variables with their defaults (read in an empty context), found again
    whenever modules were imported since the last look."""
    global _seen_modules
    if len(sys.modules) != _seen_modules:
        _seen_modules = len(sys.modules)
        for name, module in list(sys.modules.items()):
            if name.startswith("bcg_") and name not in _vars:
                found = [
                    (f"{name}.{attr}", var, contextvars.Context().run(var.get, None))
                    for attr, var in vars(module).items()
                    if isinstance(var, contextvars.ContextVar)
                ]
                _vars[name] = found
                _all_vars.extend(found)
    return _all_vars


# Integrations patch classes once and keep the patch (registration is permanent): their
# handles, kept in these modules' ``_handle`` lists, are no leak.
_PERMANENT = tuple(
    f"bcg_core._integrations.{name}" for name in ("static_cache", "sliding_window", "dynamic_cache")
)


def _patched_slots() -> set[Any]:
    patching = sys.modules.get("bcg_core._patching")
    if patching is None or not patching._slots:
        return set()
    kept = {
        (id(slot.target), slot.name)
        for module in _PERMANENT
        for handle in getattr(sys.modules.get(module), "_handle", ())
        for slot, _ in handle._refs
    }
    return set(patching._slots) - kept


def _dynamo_wrap(before: Any, now: Any, dynamo: bool) -> bool:
    """Whether ``now`` is dynamo's wrap of ``before``, dynamo being imported since (``dynamo``
    says whether it was before): importing torch._dynamo wraps torch.manual_seed once per
    process, no leak of the test that first imports it."""
    return (
        not dynamo
        and "torch._dynamo" in sys.modules
        and getattr(now, "__wrapped__", None) is before
    )


_MODES = (
    "grad mode",
    "inference mode",
    "default dtype",
    "default device",
    "dispatch mode stack depth",
    "function mode stack depth",
)


def _torch_modes() -> tuple[Any, ...]:
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.get_default_dtype(),
        torch.get_default_device(),
        torch._C._len_torch_dispatch_stack(),
        torch._C._len_torch_function_stack(),
    )


def bcg_leaks(
    hooked: list[Any], slots: set[Any], modes: tuple[Any, ...], dynamo: bool, undo: bool = True
) -> list[str]:
    """What bcg or a test left behind since ``hooked``/``slots``/``modes``/``dynamo`` (whether
    torch._dynamo was imported) were taken, in words
    (empty: nothing). With ``undo``, the context variables, attributes and torch modes found
    changed are put back."""
    leaks = []
    for name, var, default in _context_vars():
        value = var.get(default)
        if value is not default:
            leaks.append(f"context variable {name} is {value!r}, not its default {default!r}")
            if undo:
                var.set(default)
    for module, name in _COUNTS:
        count = getattr(sys.modules.get(module), name, 0)
        if count:
            leaks.append(f"{module}.{name} is {count!r}: a refcounted block was left open")
    for (owner, name), before, now in zip(_HOOKED, hooked, _hooked(), strict=True):
        if now is not before and not _dynamo_wrap(before, now, dynamo):
            leaks.append(f"{owner}.{name} is {now!r}, no longer {before!r}")
            if undo and before is not _ABSENT:
                setattr(_owner(owner), name, before)
    new_slots = _patched_slots() - slots
    if new_slots:
        leaks.append(f"bcg patches left installed (unreleased PatchHandles): {len(new_slots)}")
    now_modes = _torch_modes()
    for what, before, now in zip(_MODES, modes, now_modes, strict=True):
        if now != before:
            leaks.append(f"torch's {what} is {now!r}, no longer {before!r}")
    if undo and now_modes[:4] != modes[:4]:
        torch.set_grad_enabled(modes[0])
        torch.set_default_dtype(modes[2])
        # (get_default_device() says cpu with none set; setting cpu would install a mode.)
        torch.set_default_device(None if modes[3] == torch.device("cpu") else modes[3])
    return leaks


@pytest.fixture(autouse=True)
def _no_bcg_state_left() -> Iterator[None]:
    hooked, slots, modes = _hooked(), _patched_slots(), _torch_modes()
    dynamo = "torch._dynamo" in sys.modules
    yield
    leaks = bcg_leaks(hooked, slots, modes, dynamo)
    if leaks:
        pytest.fail(
            "the test left global state behind (a later test's outcome would depend on it; "
            "restore it in a finally or use monkeypatch):\n  " + "\n  ".join(leaks),
            pytrace=False,
        )
