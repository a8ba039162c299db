"""Holes found reviewing the changes merged on review 41's afternoon (the inference-mode view
note shared by the CPU recorder and the debug tracker, hook_attribute's heal, typing), on the
CPU graph backend."""

from __future__ import annotations

import pytest
import torch

from bcg_core import BreakableGraphRunner, eager_on_graph


def _foreach_write(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    torch._foreach_add_([x.reshape(-1)], [v])
    return x * 2


@pytest.mark.parametrize("inference", [False, True])
def test_a_segment_writing_its_argument_with_a_foreach_op_is_copied_back(inference: bool) -> None:
    # Under a dispatch mode (the CPU recorder) a _foreach_*_ op bumps no version of the tensors
    # of its written list, so the runner, which finds the arguments a step writes by their
    # versions, never copied the write back to the caller's x (at capture or at replay).
    x = torch.zeros(2, 2)
    with torch.inference_mode(inference):
        runner = BreakableGraphRunner(_foreach_write, device="cpu", warmup_iters=0)
        runner.capture(x, torch.full((4,), 3.0))
        assert x.flatten().tolist() == [3.0] * 4
        x = torch.zeros(2, 2)
        out = runner(x, torch.full((4,), 5.0))
    assert runner.stats.hits == 1
    assert x.flatten().tolist() == [5.0] * 4 and out.flatten().tolist() == [10.0] * 4


@eager_on_graph
def _foreach_copy(x: torch.Tensor, v: torch.Tensor) -> None:
    torch._foreach_copy_([x.reshape(-1)], [v])


def _step_with_foreach_break(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    y = x * 2
    _foreach_copy(x, v)
    return x + y


@pytest.mark.parametrize("inference", [False, True])
def test_bcg_debug_keeps_a_break_s_foreach_write_to_its_argument(
    monkeypatch: pytest.MonkeyPatch, inference: bool
) -> None:
    # The debug check runs each break under its tracker, a dispatch mode: the foreach write
    # bumped no version, so capture() never copied it back into the caller's x.
    monkeypatch.setenv("BCG_DEBUG", "1")
    x = torch.zeros(4)
    with torch.inference_mode(inference):
        runner = BreakableGraphRunner(_step_with_foreach_break, device="cpu")
        runner.capture(x, torch.full((4,), 9.0))
        assert x.tolist() == [9.0] * 4
        x = torch.zeros(4)
        out = runner(x, torch.full((4,), 5.0))
    assert x.tolist() == [5.0] * 4 and out.tolist() == [5.0] * 4
    assert runner.stats.hits == 1


_HEAL_SCRIPT = """
import functools
import torch
from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, enable_breakable_cuda_graph

def capture(fn):
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        fn()

under = []
def step():
    # Another library patches torch.manual_seed while bcg's capture hooks are installed.
    under.append(torch.manual_seed)
    inner = torch.manual_seed
    torch.manual_seed = lambda seed: inner(seed)
    torch.ones(1) + 1

capture(step)  # bcg's hook stays under their patch as a pass-through
torch.manual_seed = under[0]  # they undo it: the pass-through is back on top
# A third library wraps it with functools.wraps, which copies the hook's __dict__.
wrapped = under[0]
seen = []
@functools.wraps(wrapped)
def theirs(seed):
    seen.append(seed)
    return wrapped(seed)
torch.manual_seed = theirs
capture(lambda: torch.ones(1) + 1)
assert torch.manual_seed is theirs, torch.manual_seed
torch.manual_seed(3)
assert seen == [3] and torch.initial_seed() == 3
print("ok")
"""


def test_a_functools_wraps_copy_of_a_retired_hook_does_not_hang_the_next_capture() -> None:
    # hook_attribute heals a retired pass-through found back on top by calling its
    # _bcg_unhook until none is left; functools.wraps copies that attribute onto another
    # library's wrapper, whose restore then did nothing, so the loop spun for ever.
    import subprocess
    import sys

    try:
        done = subprocess.run(
            [sys.executable, "-c", _HEAL_SCRIPT],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the capture after a functools.wraps copy of a retired hook hung")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_model_defined_static_layer_is_reordered_in_place() -> None:
    # The reorder patch found the StaticLayer subclasses overriding reorder_cache in
    # transformers' cache_utils only: a model file's own (MiniMax M3 VL's sparse layer rebinds
    # idx_keys after StaticLayer's reorder) left a graph over the cache reading a stale index
    # cache after the first beam reorder, silently. (The module's import comes after
    # breakable_attention(), as a model's does in from_pretrained.)
    cache_utils = pytest.importorskip("transformers.cache_utils")
    import bcg_core

    bcg_core.breakable_attention()  # installs the reorder patch
    minimax = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    layer = minimax.MiniMaxM3VLSparseStaticCacheLayer(max_cache_len=4)
    kv = torch.arange(2 * 1 * 2 * 3, dtype=torch.float32).reshape(2, 1, 2, 3)
    layer.update(kv, kv.clone())
    layer.update_index(torch.arange(2 * 1 * 2 * 3, dtype=torch.float32).reshape(2, 1, 2, 3))
    held = {name: getattr(layer, name) for name in ("keys", "values", "idx_keys")}
    expected = {name: t.flip(0) for name, t in held.items()}
    cache_utils.Cache(layers=[layer]).reorder_cache(torch.tensor([1, 0]))  # as generate does
    for name, t in held.items():
        assert getattr(layer, name) is t, name  # the captured tensor, at its address
        assert torch.equal(t, expected[name]), name
