"""Fourth pass over what the docs promise (README, DESIGN.md, public docstrings) after the
last sessions' changes, on the CPU backend: each test is a documented behaviour, run."""

from __future__ import annotations

import copy
import gc
import pickle
import re
import timeit
from pathlib import Path

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    CaptureError,
    eager_on_graph,
    enable_breakable_cuda_graph,
    get_current_stream,
)


@eager_on_graph
def _timed_double(x: torch.Tensor) -> torch.Tensor:
    # timeit's own pattern: gcold = gc.isenabled(); gc.disable(); ...; if gcold: gc.enable()
    timeit.Timer("1 + 1").timeit(1)
    return x * 2


def test_code_that_saves_and_restores_the_collector_inside_a_capture_leaves_it_enabled() -> None:
    """DESIGN 'gc pause': the collector is left as the user last set it. Inside a capture
    gc.isenabled() said False (bcg's pause), so code saving and restoring the switch around a
    gc.disable() (timeit, here in a break) never re-enabled it: the collector stayed off for
    good after the capture, silently."""
    assert gc.isenabled()
    seen: list[bool] = []
    graph = BreakableCUDAGraph(backend="cpu")
    try:
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            seen.append(gc.isenabled())
            y = _timed_double(torch.ones(3) + 1) + 1
        assert torch.equal(y, torch.full((3,), 5.0))
        assert seen == [True], "inside a capture gc.isenabled() is the user's switch"
        assert gc.isenabled(), "the capture left the collector disabled"
    finally:
        gc.enable()
        graph.reset()


def test_gc_isenabled_inside_a_capture_follows_the_users_switch() -> None:
    seen: list[bool] = []
    graph = BreakableCUDAGraph(backend="cpu")
    try:
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            gc.disable()
            seen.append(gc.isenabled())
            gc.enable()
            seen.append(gc.isenabled())
            torch.ones(2).mul(2)
        assert seen == [False, True]
        assert gc.isenabled()
    finally:
        gc.enable()
        graph.reset()


def _refusals() -> list[str]:
    graph = BreakableCUDAGraph(backend="cpu")
    messages = []
    with pytest.raises(TypeError) as stream_error:
        BreakableCUDAGraphCapture(graph, stream=object())
    messages.append(str(stream_error.value))
    with pytest.raises(TypeError) as pool_error:
        BreakableCUDAGraphCapture(graph, pool=object())
    messages.append(str(pool_error.value))
    with (
        pytest.raises(CaptureError) as default_error,
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph, stream=get_current_stream("cpu")),
    ):
        torch.ones(2).mul(2)
    messages.append(str(default_error.value))
    graph.reset()
    return messages


def test_the_cpu_backends_stream_and_pool_refusals_name_only_public_remedies() -> None:
    """The refusals of a foreign stream, the default stream and a foreign pool told to pass
    one 'made by backend_for('cpu').new_stream()' (or new_pool()): bcg_core exports no
    backend_for (it lives in the private bcg_core._backends), so the advice was a NameError."""
    import bcg_core

    for message in _refusals():
        assert "backend_for" not in message, message
        called = set(re.findall(r"(\w+)\(", message))
        public = set(bcg_core.__all__) | {"pool"}  # BreakableCUDAGraph.pool()
        assert called <= public, (called - public, message)
        assert "=None" in message, message


def test_a_static_cache_reorder_keeps_the_tensors_a_closed_over_graph_reads() -> None:
    """DESIGN 'Stateful inputs' said `reorder_cache` rebinds each layer's tensors, so replays
    over a closed-over cache read the old ones, silently; since the beam-search patch that
    `breakable_attention` installs, the reorder writes into the same tensors (the section
    'A StaticCache reordered for beam search keeps its addresses'). The text now says so."""
    transformers = pytest.importorskip("transformers")
    import bcg_core

    name = bcg_core.breakable_attention("sdpa")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name)
    cache = transformers.StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (3, 4)), past_key_values=cache)
    layer = cache.layers[0]
    before = (layer.keys, layer.values)
    want = [t.index_select(0, torch.tensor([2, 0, 0])) for t in before]
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    assert layer.keys is before[0] and layer.values is before[1]
    assert torch.equal(layer.keys, want[0]) and torch.equal(layer.values, want[1])
    text = (Path(__file__).resolve().parents[2] / "packages/bcg-core/DESIGN.md").read_text()
    stateful = text[text.index("### Stateful inputs") : text.index("## The transformers integ")]
    assert "`reorder_cache`, which rebinds each layer's tensors" not in stateful


def test_capture_of_a_call_whose_written_argument_overlaps_another_says_what_it_runs() -> None:
    """capture()'s docstring said the step runs warmup_iters + 1 times, or once when the call
    cannot be captured; a call whose written argument shares memory with another is captured,
    dropped and run again eagerly (warmup_iters + 2 runs, nothing captured). Its docstring now
    says so; the behaviour is the one it states."""
    import bcg_core

    runs = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        x.add_(1)
        return x + y

    runner = bcg_core.BreakableGraphRunner(step, device="cpu", warmup_iters=2)
    x = torch.zeros(3)
    out = runner.capture(x, x)
    assert torch.equal(x, torch.ones(3)) and torch.equal(out, torch.full((3,), 2.0))
    assert len(runs) == 2 + 2
    assert (runner.stats.captures, runner.stats.misses, runner.stats.entries) == (0, 1, ())
    doc = bcg_core.BreakableGraphRunner.capture.__doc__ or ""
    assert "overlaps another argument" in doc and "runs once more, eagerly" in doc


class _Patched:
    def f(self) -> str:
        return "original"


def _wrap(original: object) -> object:
    return lambda self: "patched"


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_patch_handle_cannot_be_copied_so_a_reference_is_released_once(how: str) -> None:
    """PatchHandle holds references: a shallow copy shared them, and removing the handle and
    its copy released one reference twice, restoring an attribute that another handle still
    held ('active') — that holder's breaks silently gone. A deep copy said 'active' and held
    nothing. Copying or pickling a handle now raises TypeError, as for graphs and runners."""
    import bcg_core

    mine = bcg_core.patch_attribute(_Patched, "f", _wrap)
    other = bcg_core.patch_attribute(_Patched, "f", _wrap)
    try:
        copier = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
        with pytest.raises(TypeError, match="cannot be copied"):
            copier(mine)
        mine.remove()
        assert _Patched().f() == "patched" and other.active
        assert bcg_core.PatchHandle.count(_Patched, "f") == 1
    finally:
        mine.remove()
        other.remove()
    assert _Patched().f() == "original"


def test_a_continuous_batching_handle_cannot_be_copied_so_it_is_released_once() -> None:
    """A shallow copy of a ContinuousBatchingHandle shared its count: removing the handle and
    its copy took the model's handle count down twice, so bcg was off for a model whose other
    handle still said 'active'. Copying now raises TypeError; the other handle keeps bcg on."""
    import bcg_core

    transformers = pytest.importorskip("transformers")
    from bcg_core._integrations.continuous_batching import _enabled  # noqa: PLC2701

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    mine = bcg_core.enable_continuous_batching(model)
    other = bcg_core.enable_continuous_batching(model)
    try:
        with pytest.raises(TypeError, match="cannot be copied"):
            copy.copy(mine)
        mine.remove()
        assert other.active and model in _enabled
    finally:
        mine.remove()
        other.remove()
    assert model not in _enabled
