"""Breaks inside torch.compile on the CPU graph backend: one opaque op for dynamo (fullgraph
works, no graph break), eager at run time, recorded as a break by a capture; the integrations
trace to one dynamo graph; a compile inside a capture becomes a CaptureError.

Backends: ``aot_eager`` (dynamo and AOTAutograd, which is what makes the op opaque, with aten
kernels) — inductor would spend minutes of C++ compilation on this 2-core box; the CUDA tests
(test_cuda_compile.py) run inductor. On the CPU backend a capture runs the compiled function's
frame uncompiled (dynamo's ``force_eager`` stance while a CPU capture is open), so captures
here check that breaks are recorded and replay right, and compile structure is checked
separately.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch._dynamo.testing

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakOutputError,
    CaptureError,
    eager_on_graph,
    enable_breakable_cuda_graph,
)
from bcg_core._capture.compiles import as_capture_error, compiles_refused  # noqa: PLC2701

_calls: list[str] = []


@eager_on_graph(name="cc.nested")
def _nested(x: torch.Tensor, scale: float = 1.0) -> tuple[dict[str, Any], int, None]:
    _calls.append("nested")
    return {"a": x * scale, "b": (x + 1,)}, 3, None


@eager_on_graph(name="cc.write", strict=True)
def _write(x: torch.Tensor, out: torch.Tensor) -> None:
    _calls.append("write")
    out.copy_(x.sin())


def _step(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    y = x.cos() + 1
    d, n, none = _nested(y, scale=3.0)
    assert none is None
    z = d["a"] * d["b"][0] + n
    _write(z, out)
    return out * 2 + z  # reads what the strict break wrote: the op must be ordered before


def _counter() -> Any:
    return torch._dynamo.testing.CompileCounterWithBackend("aot_eager")


def test_break_is_one_opaque_op_with_fullgraph() -> None:
    torch._dynamo.reset()
    counter = _counter()
    compiled = torch.compile(_step, backend=counter, fullgraph=True)
    x, out = torch.randn(8), torch.zeros(8)
    result = compiled(x, out)
    assert counter.frame_count == 1  # one dynamo graph: no graph break at either break
    ref_out = torch.zeros(8)
    torch.testing.assert_close(result, _step(x, ref_out), rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    _calls.clear()
    compiled(torch.randn(8), out)
    assert _calls == ["nested", "write"]  # the breaks ran eagerly at run time
    assert counter.frame_count == 1


def test_compiled_breaks_are_recorded_and_replay_right() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(_step, backend="aot_eager")
    x, out = torch.randn(8), torch.zeros(8)
    compiled(x, out)  # warm-up: compiles
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        static = compiled(x, out)
    assert graph.break_names == ("cc.nested", "cc.write")
    for _ in range(3):
        x.copy_(torch.randn(8))
        graph.replay()
        ref_out = torch.zeros(8)
        torch.testing.assert_close(static, _step(x, ref_out), rtol=0, atol=0)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)


@eager_on_graph(name="cc.host", capture_stub=lambda x: x * 1.0)
def _host_sync(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.abs().max().item() >= 0)  # reads a value: cannot run on fake tensors


@eager_on_graph(name="cc.host_no_stub")
def _host_sync_no_stub(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.abs().max().item() >= 0)


def test_capture_stub_gives_the_compiler_its_outputs() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: _host_sync(x + 1) * 2, backend="aot_eager", fullgraph=True)
    x = torch.randn(5)
    torch.testing.assert_close(compiled(x), (x + 1) * 2, rtol=0, atol=0)
    no_stub = torch.compile(
        lambda x: _host_sync_no_stub(x + 1) * 2, backend="aot_eager", fullgraph=True
    )
    with pytest.raises(Exception) as info:  # dynamo's error, with bcg's as its cause
        no_stub(x)
    chain, error = [], info.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("give the break a capture_stub" in text for text in chain)


@eager_on_graph(name="cc.peek")
def _peek(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.sum().item() != 0.5)  # reads a value: cannot run on fake tensors


def test_a_break_that_reads_values_without_a_stub_is_a_dynamo_graph_break_and_still_a_break(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Without fullgraph such a break is a dynamo graph break; on torch 2.11 dynamo used to
    # half-trace bcg's op call instead, and the capture failed ("returned * at run time, but
    # None when torch.compile traced it"), on CUDA too.
    torch._dynamo.reset()
    w = torch.randn(8, 8)

    def body(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(_peek(torch.relu(x @ w)) @ w.t()) + 1

    compiled = torch.compile(body, backend="aot_eager")
    x = torch.randn(4, 8)
    with caplog.at_level("WARNING", logger="bcg_core"):
        torch.testing.assert_close(compiled(x), body(x), rtol=0, atol=0)
        compiled(x)
    said = [r for r in caplog.records if "cannot run on fake tensors" in r.getMessage()]
    assert len(said) == 1 and "capture_stub" in said[0].getMessage()  # once per break
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = compiled(x)
    assert graph.break_names == ("cc.peek",) and graph.num_segments == 2
    for _ in range(3):
        x.copy_(torch.randn(4, 8))
        graph.replay()
        torch.testing.assert_close(out, body(x), rtol=0, atol=0)


@eager_on_graph(name="cc.module")
def _with_module(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    _calls.append("module")
    return layer(x)


def test_break_taking_a_module_is_a_dynamo_graph_break_and_still_a_break() -> None:
    torch._dynamo.reset()
    layer = torch.nn.Linear(4, 4)
    counter = _counter()

    def step(x: torch.Tensor) -> torch.Tensor:
        return _with_module(layer, x.relu()) + 1

    compiled = torch.compile(step, backend=counter)
    x = torch.randn(2, 4)
    with torch.no_grad():
        compiled(x)
        assert counter.frame_count == 2  # before and after the break
        graph = BreakableCUDAGraph(backend="cpu")
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            static = compiled(x)
        assert graph.break_names == ("cc.module",)
        x.copy_(torch.randn(2, 4))
        graph.replay()
        torch.testing.assert_close(static, step(x), rtol=0, atol=0)


@eager_on_graph(name="cc.gated", gated=True)
def _gated(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_gated_break_reads_the_flag_at_run_time() -> None:
    torch._dynamo.reset()
    counter = _counter()
    compiled = torch.compile(lambda x: _gated(x + 1) - 1, backend=counter, fullgraph=True)
    x = torch.randn(4)
    compiled(x)
    with enable_breakable_cuda_graph():
        compiled(x)
    assert counter.frame_count == 1  # the flag is no guard: nothing traced reads it
    # fullgraph=True cannot be captured on the CPU backend (see the module docstring)
    compiled = torch.compile(lambda x: _gated(x + 1) - 1, backend="aot_eager")
    compiled(x)
    on, off = BreakableCUDAGraph(backend="cpu"), BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(on):
        compiled(x)
    with (
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(off),
        enable_breakable_cuda_graph(False),
    ):
        compiled(x)
    assert on.break_names == ("cc.gated",)
    assert off.num_breaks == 0


def test_a_compile_inside_a_capture_is_a_capture_error_naming_the_guard() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x.sin() + 1, backend="eager")
    compiled(torch.randn(4))
    with compiles_refused(True):
        compiled(torch.randn(4))  # guards pass: no compile
        with pytest.raises(RuntimeError) as info:
            compiled(torch.randn(4, 3))
    error = as_capture_error(info.value)
    assert isinstance(error, CaptureError)
    assert "rank mismatch" in str(error) and "Warm up the compiled function" in str(error)
    compiled(torch.randn(4, 3))  # the stance is restored: compiles again
    assert as_capture_error(RuntimeError("other")) is None


def test_the_cpu_backend_does_not_refuse_compiles() -> None:
    # Under the CPU recorder dynamo re-traces or skips frames by itself (it guards on dispatch
    # modes), so only backends whose capture cannot compile (CUDA) refuse.
    assert BreakableCUDAGraph(backend="cpu")._backend_impl.refuses_compiles is False


# -- the integrations trace to one dynamo graph ---------------------------------------------------


def _sdpa_llama(layers: int) -> tuple[Any, Any, Any]:
    """A tiny bcg_sdpa Llama (float32, seeded), its StaticCache, and one decode step on it."""
    transformers = pytest.importorskip("transformers")
    import bcg_core

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=bcg_core.breakable_attention("sdpa"), dtype=torch.float32
    ).eval()
    cache = transformers.StaticCache(config=config, max_cache_len=32)

    def decode(ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        return logits

    return model, cache, decode


def test_breakable_sdpa_llama_is_one_dynamo_graph() -> None:
    _, _, decode = _sdpa_llama(layers=3)
    with torch.no_grad():
        decode(torch.arange(5)[None])  # prefill
        with enable_breakable_cuda_graph():
            explained = torch._dynamo.explain(decode)(torch.tensor([[7]]))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@eager_on_graph(name="cc.scaled")
def _scaled(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return x * scale


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 0.25  # under dynamic=True dynamo passes this float as a SymFloat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled(x.sin(), scale=self.scale).cos()


def test_a_break_taking_a_float_compiles_with_dynamic_shapes() -> None:
    """dynamic=True: the float argument reaches the op as a SymFloat; it is used as its value
    with a guard on it (it used to fail inside AOTAutograd: 'not tracked with proxy')."""
    torch._dynamo.reset()
    module = _Scaled()
    compiled = torch.compile(module, backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (3, 5):
        x = torch.randn(n)
        torch.testing.assert_close(compiled(x), module(x), rtol=0, atol=0)
    module.scale = 0.5  # the guard sees the new value: recompiled, not stale
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), module(x), rtol=0, atol=0)


def test_a_plain_value_a_compiled_break_returns_must_stay_the_traced_one() -> None:
    """The compiled code after a break computes with the value the break returned when it was
    traced; a run that returns another raises instead of computing with the stale one."""
    torch._dynamo.reset()
    state = {"n": 2, "kind": None}

    @eager_on_graph(name="cc.counted")
    def counted(x: torch.Tensor) -> tuple[torch.Tensor, int, Any]:
        return x * 2, state["n"], state["kind"]

    def fn(x: torch.Tensor) -> torch.Tensor:
        y, n, _ = counted(x)
        return y + n

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x = torch.ones(3)
    torch.testing.assert_close(compiled(x), torch.full((3,), 4.0), rtol=0, atol=0)
    state["n"] = 5
    with pytest.raises(BreakOutputError, match=r"returned 5 at run time .* but 2 when"):
        compiled(x)
    state["n"], state["kind"] = 2, "gqa"
    with pytest.raises(BreakOutputError, match="'gqa' at run time"):
        compiled(x)
    state["kind"] = None
    torch.testing.assert_close(compiled(x), torch.full((3,), 4.0), rtol=0, atol=0)


def test_compiled_sdpa_llama_keeps_only_the_sdpa_call_opaque() -> None:
    """Under torch.compile a bcg_sdpa layer's opaque op is the scaled_dot_product_attention call
    alone: repeat_kv and the output's transpose and copy are in the compiled graph (a whole-
    function break would run them eagerly at every replay, host time the compiled segments
    cannot hide)."""
    from torch._dynamo.backends.common import aot_autograd  # noqa: PLC2701

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _: Any) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    model, cache, decode = _sdpa_llama(layers=2)
    ids = torch.tensor([[7]])
    with torch.no_grad():
        decode(torch.arange(5)[None])  # prefill
        expected = model(input_ids=ids, past_key_values=copy.deepcopy(cache), use_cache=True)
        compiled = torch.compile(decode, backend=aot_autograd(fw_compiler=keep), fullgraph=True)
        got = compiled(ids)
    (graph,) = graphs
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    opaque = [t for t in targets if "bcg" in str(t)]
    assert opaque == [torch.ops.bcg.opaque.default] * model.config.num_hidden_layers
    assert torch.ops.aten.expand.default in targets  # repeat_kv, compiled
    assert torch.ops.aten.scaled_dot_product_attention.default not in targets  # inside the op
    for node in graph.graph.nodes:
        if node.target == torch.ops.bcg.opaque.default:  # the boolean mask made additive before
            dtypes = [t.meta["val"].dtype for t in node.args[1]]
            assert torch.bool not in dtypes and torch.float32 in dtypes
    torch.testing.assert_close(got, expected.logits, rtol=0, atol=0)


@eager_on_graph(name="cc.cache")
def _append_and_read(x: torch.Tensor, cache: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(0, slot, x)  # writes an argument and returns a tensor (attention with a
    return cache.sum(0, keepdim=True) * 2  # KV-cache write): two ops, the read after the write


def test_break_that_writes_and_returns_is_ordered_and_replays_right() -> None:
    torch._dynamo.reset()

    def step(x: torch.Tensor, cache: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        y = _append_and_read(x.exp(), cache, slot)
        return y + cache[0]  # reads the written cache after the break

    counter = _counter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    x, slot = torch.randn(1, 4), torch.tensor([1])
    cache, reference = torch.zeros(3, 4), torch.zeros(3, 4)
    torch.testing.assert_close(compiled(x, cache, slot), step(x, reference, slot), rtol=0, atol=0)
    torch.testing.assert_close(cache, reference, rtol=0, atol=0)
    assert counter.frame_count == 1
    default = torch.compile(step, backend="aot_eager")
    default(x, cache, slot)
    graph = BreakableCUDAGraph(backend="cpu")
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        static = default(x, cache, slot)
    assert graph.break_names == ("cc.cache",)
    reference.copy_(cache)
    x.copy_(torch.randn(1, 4))
    graph.replay()
    torch.testing.assert_close(static, step(x, reference, slot), rtol=0, atol=0)
    torch.testing.assert_close(cache, reference, rtol=0, atol=0)
