"""The leak guard of tests/conftest.py: a test that leaves bcg's capture state, a hooked
attribute or torch's modes changed fails at teardown, naming what leaked, and the tests after it
start from a clean state (the guard undoes what it can)."""

from __future__ import annotations

import contextlib
import contextvars
import gc
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

_CONFTEST = Path(__file__).parent / "conftest.py"

_LEAKY = """
import torch
import bcg_core
from bcg_core._backends import cpu_recorder

_KEPT = []  # the blocks left open (a dropped one is closed by its finaliser)


def test_a_leaves_the_flag_on():
    _KEPT.append(bcg_core.enable_breakable_cuda_graph())
    _KEPT[-1].__enter__()


def test_b_clean():
    assert not bcg_core.is_in_breakable_cuda_graph()


def test_c_patches_manual_seed():
    torch.manual_seed = lambda seed: None


def test_d_clean():
    assert torch.manual_seed is torch.random.manual_seed or "dynamo" in repr(torch.manual_seed)


def test_e_leaves_grad_off_and_dtype():
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)


def test_f_clean():
    assert torch.is_grad_enabled()
    assert torch.get_default_dtype() is torch.float32


def test_g_leaves_the_recorder_hooks_installed():
    _KEPT.append(cpu_recorder.host_read_hooks())
    _KEPT[-1].__enter__()
"""


def _run(tmp_path: Path) -> str:
    shutil.copy(_CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_leaky.py").write_text(_LEAKY)
    # The packages' sources and the installed ones, not this process's whole sys.path: other
    # tests put folders on it (bcg check adds its target's), one with a random.py shadowing
    # the standard library's.
    root = _CONFTEST.parent.parent
    sources = [root / "packages" / name / "src" for name in ("bcg-core", "bcg-diffusion")]
    path = [str(p) for p in sources] + [os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "test_leaky.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.stdout + done.stderr


def test_the_guard_names_each_leak_and_undoes_it(tmp_path: Path) -> None:
    out = _run(tmp_path)
    assert "context variable bcg_core._capture.flag._ENABLED is True" in out, out
    assert "torch.manual_seed is <function" in out, out
    assert "torch's grad mode is False, no longer True" in out, out
    assert "torch's default dtype is torch.float64" in out, out
    assert "bcg_core._backends.cpu_recorder._hooks_refcount is 1" in out, out
    assert "torch.Tensor.tolist is" in out, out
    # Each leaking test errors at teardown; each clean one after it passes: the guard undid it.
    for test in (
        "test_a_leaves_the_flag_on",
        "test_c_patches_manual_seed",
        "test_e_leaves_grad_off_and_dtype",
        "test_g_leaves_the_recorder_hooks_installed",
    ):
        assert f"ERROR test_leaky.py::{test}" in out, out
    for test in ("test_b_clean", "test_d_clean", "test_f_clean"):
        assert f"PASSED test_leaky.py::{test}" in out, out


# -- holes: global state bcg itself changed ----------------------------------------------------


def test_a_capture_keeps_a_patch_of_gc_enable_made_after_bcg_was_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gc_paused() swapped gc.enable/disable for the capture and put back the functions it had
    saved at import: a patch of them made since (a profiler's, a test's monkeypatch) was gone
    after the first capture, and the next test saw bcg's saved originals."""
    import bcg_core  # noqa: F401  (imported before the patch, as in any process)
    from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, enable_breakable_cuda_graph

    calls: list[str] = []
    real_enable, real_disable = gc.enable, gc.disable

    def enable() -> None:
        calls.append("enable")
        real_enable()

    def disable() -> None:
        calls.append("disable")
        real_disable()

    monkeypatch.setattr(gc, "enable", enable)
    monkeypatch.setattr(gc, "disable", disable)
    x = torch.ones(3)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        y = x * 2
    graph.replay()
    assert gc.enable is enable and gc.disable is disable
    assert gc.isenabled()
    torch.testing.assert_close(y, x * 2)
    gc.disable()
    assert calls == ["disable"] and not gc.isenabled()
    gc.enable()
    assert gc.isenabled()


def test_a_routed_warm_up_closed_in_another_context_releases_its_count() -> None:
    """BreakableCUDAGraph.warmup() held across a yield (an async generator the event loop
    finalises in another task) left routed_warmup() in another context than it was entered in:
    its reset of the context variable raised a raw ValueError before the process-wide count of
    open warm-ups was decremented, so every eager break afterwards looked for a warm-up's pool
    for good. (Routing happens on CUDA only, so the block is driven directly here.)"""
    from bcg_core._capture import context  # noqa: PLC2701

    def warming_up() -> Iterator[None]:
        with context.routed_warmup(contextlib.nullcontext):
            yield

    block = warming_up()
    contextvars.copy_context().run(next, block)
    assert context._routed_warmups == 1
    contextvars.copy_context().run(block.close)  # another context, as a finaliser's
    assert context._routed_warmups == 0
    assert context.warmup_outside_pool() is None
