"""Breaks over compiled code on a real GPU: inductor's kernels captured between eager breaks,
replays equal to the compiled step run without a graph (bitwise), a compile that would happen
inside a capture refused with a CaptureError, and a transformers Llama compiled and captured."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_helpers import assert_idle, randn, refresh

import bcg_core
from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    CaptureError,
    eager_on_graph,
    enable_breakable_cuda_graph,
)

pytestmark = pytest.mark.cuda


@eager_on_graph(name="cuda.host", capture_stub=lambda h: h * 1.0)
def _host(h: torch.Tensor) -> torch.Tensor:
    # a host sync (uncapturable): must run eagerly at capture and at every replay
    return h * float(h.abs().max().item() >= 0)


@eager_on_graph(name="cuda.write", strict=True)
def _write(h: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(torch.tanh(h))


def _step(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.silu(x @ w) * 2 + 1
    h = _host(h)
    _write(h @ w, out)
    return torch.nn.functional.gelu(out) + h  # reads what the strict break wrote


def _compiled(fullgraph: bool = True) -> Any:
    torch._dynamo.reset()
    return torch.compile(_step, fullgraph=fullgraph, dynamic=False)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_step_captured_with_breaks_replays_equal_the_compiled_step(
    fullgraph: bool,
) -> None:
    compiled = _compiled(fullgraph)
    x, w, out = randn(64, 256), randn(256, 256) / 16, torch.zeros(64, 256, device="cuda")
    for _ in range(3):
        compiled(x, w, out)  # warm-ups: compile and autotune outside the capture
    graph = BreakableCUDAGraph()
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        static = compiled(x, w, out)
    assert graph.break_names == ("cuda.host", "cuda.write")
    assert graph.num_segments == 3
    assert_idle()
    reference_out = torch.zeros_like(out)
    for _ in range(3):
        refresh(x)
        graph.replay()
        expected = compiled(x, w, reference_out)
        assert torch.equal(static, expected) and torch.equal(out, reference_out)


def test_runner_over_a_compiled_step() -> None:
    compiled = _compiled()
    x, w, out = randn(64, 256), randn(256, 256) / 16, torch.zeros(64, 256, device="cuda")
    runner = BreakableGraphRunner(compiled)
    runner.capture(x, w, out)
    assert runner.stats.captures == 1 and runner.stats.failed_captures == 0
    reference_out = torch.zeros_like(out)
    for _ in range(3):
        refresh(x)
        got = runner(x, w, out)
        assert torch.equal(got, compiled(x, w, reference_out))
    assert runner.stats.hits == 3


def test_a_recompile_inside_the_capture_is_a_capture_error() -> None:
    compiled = _compiled()
    x, w, out = randn(64, 256), randn(256, 256) / 16, torch.zeros(64, 256, device="cuda")
    with torch.no_grad():
        for _ in range(2):
            compiled(x, w, out)  # warmed up without grad...
    graph = BreakableCUDAGraph()
    with (
        pytest.raises(CaptureError, match="would compile inside the capture") as info,
        enable_breakable_cuda_graph(),
        BreakableCUDAGraphCapture(graph),
    ):
        compiled(x, w, out)  # ...captured with grad: dynamo's grad-mode guard fails
    assert "guard failure" in str(info.value)
    assert_idle()
    graph.reset()
    with torch.no_grad(), enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        compiled(x, w, out)  # the warmed-up mode captures
    assert graph.num_breaks == 2
    compiled(randn(32, 256), w, out[:32])  # outside a capture, compiling works again


def test_compiled_llama_decode_through_the_runner_equals_the_compiled_step() -> None:
    transformers = pytest.importorskip("transformers")
    from test_cpu_transformers import FAMILIES, cache_tensors

    torch.manual_seed(0)
    model = (
        transformers.AutoModelForCausalLM.from_config(
            FAMILIES["llama"](),
            attn_implementation=bcg_core.breakable_attention("sdpa"),
            dtype=torch.bfloat16,
        )
        .to("cuda")
        .eval()
    )
    prompt = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1)).cuda()

    def prefilled() -> Any:
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        return cache

    def decoder(cache: Any) -> Any:
        def decode(ids: torch.Tensor) -> torch.Tensor:
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            logits: torch.Tensor = out.logits
            return logits

        return torch.compile(decode, fullgraph=True, dynamic=False)

    torch._dynamo.reset()
    cache, reference_cache = prefilled(), prefilled()
    compiled, reference = decoder(cache), decoder(reference_cache)
    runner = BreakableGraphRunner(compiled)
    ids = prompt[:, -1:].flip(0)
    with torch.no_grad():
        saved = [t.clone() for t in cache_tensors(cache)]
        runner.capture(ids)
        for t, s in zip(cache_tensors(cache), saved, strict=True):
            t.copy_(s)
        (entry,) = runner.stats.entries
        assert entry.breaks == model.config.num_hidden_layers
        for _ in range(3):
            got = runner(ids)
            expected = reference(ids)
            assert torch.equal(got, expected)
            ids = expected[:, -1:].argmax(-1)
    assert runner.stats.hits == 3 and runner.stats.failed_captures == 0


def test_compiled_sliding_window_layer_is_refused_at_capture() -> None:
    """Compiled, the sdpa op carries the layer's sliding-window reason (read at trace time) and
    refuses the capture with it; the runner then serves that signature with the compiled step."""
    transformers = pytest.importorskip("transformers")
    from test_cpu_transformers import SMALL

    torch.manual_seed(0)
    model = (
        transformers.AutoModelForCausalLM.from_config(
            transformers.MistralConfig(**SMALL, sliding_window=16),
            attn_implementation=bcg_core.breakable_attention("sdpa"),
            dtype=torch.bfloat16,
        )
        .to("cuda")
        .eval()
    )
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2)).cuda()

    def decode(ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        return logits

    torch._dynamo.reset()
    runner = BreakableGraphRunner(torch.compile(decode, backend="aot_eager", fullgraph=True))
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        runner.capture(prompt[:, -1:])
    (why,) = runner.blocked_signatures.values()
    assert "CaptureError" in why and "sliding-window attention" in why
    assert runner.stats.entries == ()
    assert not bcg_core.is_breakable_capture_active()


_logged: list[torch.Tensor] = []


@eager_on_graph(name="cuda.log")
def _log_only(x: torch.Tensor) -> None:
    if not isinstance(x, torch._subclasses.fake_tensor.FakeTensor):
        _logged.append(x.clone())


def test_inductor_keeps_a_break_that_returns_nothing_and_a_stub_of_other_strides() -> None:
    """Inductor: a break read by nobody still runs; a capture_stub whose output has other
    strides than the kernel's gets the traced strides (inductor's code assumes them)."""

    def transposed(x: torch.Tensor) -> torch.Tensor:
        return (x.t().contiguous() * 2).t()

    @eager_on_graph(name="cuda.kern", capture_stub=lambda x: torch.empty_like(x))
    def kern(x: torch.Tensor) -> torch.Tensor:
        return transposed(x)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        _log_only(y)
        return kern(y) + torch.arange(4.0, device=x.device)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    x = torch.arange(12.0, device="cuda").reshape(3, 4)
    cf(x)
    _logged.clear()
    for i in range(3):
        assert torch.equal(cf(x + i), f(x + i))
    assert len(_logged) == 6
