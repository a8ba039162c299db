"""transformers models (tiny, random weights, float32) decoding with a StaticCache through
BreakableGraphRunner on the CPU graph backend, with bcg_core.breakable_attention.

The recipe for the stateful cache: a StaticCache advances its position (a tensor inside the
cache) in place on every forward, in the graph too. ``runner.capture()`` runs the step
``warmup_iters + 1`` times (warm-ups, then the capture), so the cache state is saved before the
capture and put back after it (the tensors in place: the graph reads those addresses; the
sliding-window layers' Python int positions too). The eager reference steps its own cache,
prefilled with the same prompt.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import bcg_core
from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, BreakableGraphRunner
from bcg_core._capture.graph import BreakStep  # noqa: PLC2701

transformers = pytest.importorskip(
    "transformers", reason='transformers is not installed (pip install "bcg-core[transformers]")'
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402

SMALL = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
    "max_position_embeddings": 64,
}  # fmt: skip
FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=16),
}
# More families, CPU only: full attention everywhere (WINDOWED below has them with windows).
MORE_FAMILIES: dict[str, Callable[[], Any]] = {
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=None),
    "gemma2": lambda: transformers.Gemma2Config(
        **SMALL, head_dim=16, pad_token_id=0, layer_types=["full_attention"] * 3
    ),
    "phi3": lambda: transformers.Phi3Config(**SMALL, pad_token_id=0),
}


def _model(family: str, attn: str) -> Any:
    torch.manual_seed(0)
    config = {**FAMILIES, **MORE_FAMILIES}[family]()
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn, dtype=torch.float32
    ).eval()


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """Every tensor a StaticCache's layers hold: keys, values, the position counter and, for
    hybrid and linear-attention layers, their convolution and recurrent states."""
    found: list[torch.Tensor] = []
    for layer in cache.layers:
        for _, value in sorted(vars(layer).items()):
            if isinstance(value, dict):
                value = list(value.values())
            items = value if isinstance(value, (list, tuple)) else [value]
            found.extend(t for t in items if isinstance(t, torch.Tensor))
    return found


def sliding_positions(cache: Any) -> list[int]:
    """The Python int positions of a StaticCache's sliding-window layers."""
    return [layer.cumulative_length_int for layer in cache.layers if layer.is_sliding]


def saved_cache(cache: Any) -> Callable[[], None]:
    """Save what a StaticCache's forward mutates; the returned function puts it back (the
    tensors in place, the sliding layers' int positions)."""
    tensors = [t.clone() for t in cache_tensors(cache)]
    positions = [vars(layer).get("cumulative_length_int") for layer in cache.layers]

    def restore() -> None:
        for t, s in zip(cache_tensors(cache), tensors, strict=True):
            t.copy_(s)
        for layer, position in zip(cache.layers, positions, strict=True):
            if position is not None:
                layer.cumulative_length_int = position

    return restore


def _prefilled(model: Any, prompt: torch.Tensor, max_cache_len: int = 32) -> Any:
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    return cache


def runner_and_caches(
    model: Any,
    prompt: torch.Tensor,
    device: str = "cpu",
    max_cache_len: int = 32,
    **runner_kwargs: Any,
) -> tuple[BreakableGraphRunner, Any, Any]:
    """A runner decoding one step on a cache prefilled with ``prompt``, that cache, and a
    second one prefilled alike for the eager reference."""
    cache, reference_cache = (_prefilled(model, prompt, max_cache_len) for _ in range(2))

    def decode(ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        return logits

    return BreakableGraphRunner(decode, device=device, **runner_kwargs), cache, reference_cache


def decode_through_runner(
    model: Any,
    steps: int,
    device: str = "cpu",
    mask_breaks: int = 0,
    mode: Callable[[], Any] = torch.no_grad,
    max_cache_len: int = 32,
) -> Any:
    """Greedy decode: the runner's graph against eager on a second cache, bitwise, per step.
    ``mask_breaks``: the mask functions the forward calls as breaks (bases other than sdpa);
    ``mode``: what capture and decode run under (``torch.inference_mode`` as engines do).
    Sliding-window cache layers add one break each and one per forward. Returns the eager
    reference's cache."""
    prompt = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)
    runner, cache, reference_cache = runner_and_caches(model, prompt, device, max_cache_len)
    ids = prompt[:, -1:].flip(0)
    sliding = len(sliding_positions(cache))
    with mode():
        restore = saved_cache(cache)
        runner.capture(ids)  # advances the cache several times...
        restore()  # ...so put it back where it was
        (entry,) = runner.stats.entries
        layers = model.config.num_hidden_layers
        assert entry.breaks == layers + mask_breaks + sliding + int(sliding > 0)
        if not sliding:
            # adjacent mask breaks leave empty segments between them, which are dropped
            assert entry.segments == entry.breaks + 1 - max(mask_breaks - 1, 0)
        for _ in range(steps):
            got = runner(ids)
            expected = model(input_ids=ids, past_key_values=reference_cache, use_cache=True).logits
            assert torch.equal(got, expected)
            ids = expected[:, -1:].argmax(-1)
    assert runner.stats.hits == steps
    assert all(
        torch.equal(a.cumulative_length, b.cumulative_length)
        for a, b in zip(cache.layers, reference_cache.layers, strict=True)
    )
    assert sliding_positions(cache) == sliding_positions(reference_cache)
    return reference_cache


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_static_cache_decode_replays_equal_eager(family: str) -> None:
    decode_through_runner(_model(family, bcg_core.breakable_attention("sdpa")), steps=3)


@pytest.mark.parametrize("base", ["sdpa", "eager"])
def test_decode_captured_in_inference_mode_replays_equal_eager(base: str) -> None:
    # Under inference mode sdpa reached the kernel-break mode whole: the capture was refused
    # ("0 fused attention kernels") and the runner served every step eagerly.
    model = _model("llama", bcg_core.breakable_attention(base))
    decode_through_runner(
        model, steps=3, mask_breaks=int(base != "sdpa"), mode=torch.inference_mode
    )


@pytest.mark.parametrize("base", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(MORE_FAMILIES))
def test_more_families_decode_equal_eager(family: str, base: str) -> None:
    masks = 0 if base == "sdpa" else 2 if family == "gemma2" else 1  # gemma2: full and sliding
    model = _model(family, bcg_core.breakable_attention(base))
    decode_through_runner(model, steps=3, mask_breaks=masks)


def test_sdpa_break_is_the_kernel_call_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """At replay only the attention kernel runs eagerly: transformers' ``repeat_kv`` (and the
    rest of its sdpa function) was captured into the graph, so replays never call it."""
    from transformers.integrations import sdpa_attention

    calls: list[int] = []
    real = sdpa_attention.repeat_kv

    def counted(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
        calls.append(n_rep)
        return real(hidden, n_rep)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", counted)
    model = _model("llama", bcg_core.breakable_attention("sdpa"))
    prompt = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    runner, _, reference_cache = runner_and_caches(model, prompt, warmup_iters=0)
    ids = prompt[:, -1:]
    with torch.no_grad():
        runner.capture(ids)
        assert calls, "the model's attention does not repeat key/value heads"
        assert runner.stats.entries[0].breaks == model.config.num_hidden_layers
        model(input_ids=ids, past_key_values=reference_cache, use_cache=True)  # the capture's step
        calls.clear()
        got = runner(ids)
        assert calls == [], "a replay ran transformers' attention function, not just the kernel"
        expected = model(input_ids=ids, past_key_values=reference_cache, use_cache=True).logits
    assert torch.equal(got, expected)


def captured_breaks(model: Any, device: str = "cpu") -> tuple[list[BreakStep], torch.Tensor, Any]:
    """One decode step of ``model`` captured after one warm-up step: its breaks, the output,
    and a cache prefilled alike for the eager reference."""
    prompt = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    prompt, ids = prompt.to(device), prompt[:, -1:].to(device)
    spare, cache, reference_cache = (_prefilled(model, prompt) for _ in range(3))
    graph = BreakableCUDAGraph(backend=torch.device(device).type)
    with torch.no_grad(), bcg_core.enable_breakable_cuda_graph():
        model(input_ids=ids, past_key_values=spare, use_cache=True)  # the warm-up
        with BreakableCUDAGraphCapture(graph):
            out = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        expected = model(input_ids=ids, past_key_values=reference_cache, use_cache=True).logits
    assert torch.equal(out, expected)
    return [s for s in graph._steps if isinstance(s, BreakStep)], out, reference_cache


def test_sdpa_break_is_the_fused_kernel_with_the_mask_converted_in_the_graph() -> None:
    """Where torch picks a fused backend, the break is its kernel op alone: the boolean mask's
    conversion to an additive one (three kernels per layer on CUDA) is captured into the
    graph, and the kernel gets the converted mask, as inside eager sdpa."""
    model = _model("llama", bcg_core.breakable_attention("sdpa"))
    breaks, _, _ = captured_breaks(model)
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert [b.args[0] for b in breaks] == [kernel] * model.config.num_hidden_layers
    assert all(b.kwargs["attn_mask"].dtype == torch.float32 for b in breaks)


def test_sdpa_on_the_math_backend_breaks_at_the_sdpa_call() -> None:
    """The math backend ends in no single kernel op: the sdpa call is the break, and replays
    equal eager under the same backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _model("llama", bcg_core.breakable_attention("sdpa"))
    with sdpa_kernel(SDPBackend.MATH):
        breaks, _, _ = captured_breaks(model)
        assert len(breaks) == model.config.num_hidden_layers
        assert all(b.args[0] is not None and b.args[0].dim() == 4 for b in breaks)  # query first
        decode_through_runner(model, steps=3)


def test_eager_base_uses_the_models_own_eager_attention() -> None:
    name = bcg_core.breakable_attention("eager")
    assert name == "bcg_eager"
    decode_through_runner(_model("qwen3", name), steps=3, mask_breaks=1)


def test_eager_mask_is_a_break_and_sdpa_mask_is_captured() -> None:
    """eager's mask function makes its fill value with a pageable host-to-device copy, which a
    CUDA capture refuses (the CPU backend cannot see it: test_cuda_transformers shows it), so
    bcg_eager runs the mask as a break, before the layers; bcg_sdpa's mask stays in the graph."""
    from transformers.masking_utils import eager_mask

    layers = FAMILIES["llama"]().num_hidden_layers
    breaks, _, _ = captured_breaks(_model("llama", bcg_core.breakable_attention("eager")))
    assert [b.name for b in breaks] == [
        "transformers mask (bcg_eager)",
        *["transformers attention (bcg_eager)"] * layers,
    ]
    assert breaks[0].fn is eager_mask
    breaks, _, _ = captured_breaks(_model("llama", bcg_core.breakable_attention("sdpa")))
    assert [b.name for b in breaks] == ["transformers attention (bcg_sdpa)"] * layers


def test_mask_is_registered_with_the_attention() -> None:
    """Without the mask function the decode would attend to the empty cache slots."""
    name = bcg_core.breakable_attention("sdpa")
    assert bcg_core.breakable_attention("sdpa") == name == "bcg_sdpa"
    assert bcg_core.breakable_attention(name) == name
    masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    assert masks[name].__wrapped__ is masks["sdpa"]  # a break only for a padded sliding layer
    plain, breakable = _model("llama", "sdpa"), _model("llama", "sdpa")
    breakable.set_attn_implementation(name)
    assert breakable.config._attn_implementation == name
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    caches = _prefilled(plain, prompt), _prefilled(breakable, prompt)
    ids = torch.tensor([[7]])
    with torch.no_grad():
        a = plain(input_ids=ids, past_key_values=caches[0], use_cache=True).logits
        b = breakable(input_ids=ids, past_key_values=caches[1], use_cache=True).logits
    assert torch.equal(a, b)


def test_bad_bases_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention implementation 'nope'"):
        bcg_core.breakable_attention("nope")
    with pytest.raises(ValueError, match="flash attention functions choose their kernel"):
        bcg_core.breakable_attention("flash_attention_2")


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r'pip install "bcg-core\[transformers\]"'):
        bcg_core.breakable_attention("sdpa")


# Every family with sliding layers, with a window of 16 (a 64-slot StaticCache: the sliding
# layers' buffers hold 16 tokens, the full layers' 64, so decode crosses the window).
WINDOW = 16
WINDOWED: dict[str, Callable[[], Any]] = {
    # Exaone 4 sets sliding_window on every attention module and says which slide (is_sliding)
    "exaone4": lambda: transformers.Exaone4Config(
        **{**SMALL, "num_hidden_layers": 4}, sliding_window=WINDOW
    ),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=WINDOW),
    "gemma2": lambda: transformers.Gemma2Config(
        **SMALL, head_dim=16, pad_token_id=0, sliding_window=WINDOW
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SMALL, head_dim=16, pad_token_id=0, sliding_window=WINDOW
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **{**SMALL, "num_hidden_layers": 2},
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "phi3": lambda: transformers.Phi3Config(**SMALL, pad_token_id=0, sliding_window=WINDOW),
}  # fmt: skip
# The mask functions a forward calls (as breaks, for bases other than sdpa): one per mask kind.
WINDOWED_MASKS = {
    "exaone4": 2, "mistral": 1, "phi3": 1, "gemma2": 2, "gemma3": 2, "qwen2": 2, "qwen2_moe": 2,
}  # fmt: skip


def _windowed(family: str, base: str = "sdpa") -> Any:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        WINDOWED[family](), attn_implementation=bcg_core.breakable_attention(base),
        dtype=torch.float32,
    ).eval()  # fmt: skip


@pytest.mark.parametrize("base", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_window_decode_replays_equal_eager_across_the_window(
    family: str, base: str
) -> None:
    """One capture at position 6, then 40 replays: the sliding layers fill (position 16) and
    roll for 30 steps, every replay's logits equal eager's on its own cache."""
    model = _windowed(family, base)
    masks = 0 if base == "sdpa" else WINDOWED_MASKS[family]
    reference = decode_through_runner(model, steps=40, mask_breaks=masks, max_cache_len=64)
    assert reference.layers[0].is_sliding or reference.layers[1].is_sliding
    assert set(sliding_positions(reference)) == {6 + 40}  # 30 steps past a full window


def test_sliding_window_breaks_are_the_update_and_one_position() -> None:
    """Gemma 2 alternates sliding and full layers: each sliding layer's cache update is a break,
    one break per forward reads the sliding position; the full layer has its attention alone."""
    breaks, _, _ = captured_breaks(_windowed("gemma2"))
    update, position = (
        "transformers sliding-window cache update",
        "transformers sliding-window position",
    )
    attention = "transformers attention (bcg_sdpa)"
    assert [b.name for b in breaks] == [position, update, attention, attention, update, attention]


def refused_on_a_prefilled_dynamic_cache(model: Any, steps: int) -> None:
    """Decode ``model`` on a prefilled DynamicCache through a runner: the capture is refused
    by name (at layer 0's first update: a DynamicCache made before the capture), nothing is
    left capturing, and ``steps`` eager runs from the prompt equal eager on its own copy."""
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        prefilled = transformers.DynamicCache(config=model.config)
        model(input_ids=prompt, past_key_values=prefilled, use_cache=True)
        caches = [copy.deepcopy(prefilled)]

        def decode(ids: torch.Tensor) -> torch.Tensor:
            logits: torch.Tensor = model(input_ids=ids, past_key_values=caches[-1]).logits
            return logits

        runner = BreakableGraphRunner(decode, device="cpu", warmup_iters=0)
        ids = prompt[:, -1:]
        runner.capture(ids)  # refused, then run eagerly
        (why,) = runner.blocked_signatures.values()
        assert "CaptureError" in why and "DynamicCache made before the capture" in why
        assert runner.stats.entries == ()
        assert not bcg_core.is_breakable_capture_active()
        caches.append(copy.deepcopy(prefilled))  # decode from the prompt again
        reference = copy.deepcopy(prefilled)
        for _ in range(steps):
            got = runner(ids)
            expected = model(input_ids=ids, past_key_values=reference).logits
            assert torch.equal(got, expected)
            ids = expected[:, -1:].argmax(-1)


def test_sliding_window_on_a_dynamic_cache_is_refused_and_the_runner_stays_eager() -> None:
    """A DynamicCache's sliding layer keeps its position in a Python int bcg does not take
    over: the capture is refused by name (at its first update, before the attention's own
    sliding-window refusal) and the runner serves that signature eagerly."""
    refused_on_a_prefilled_dynamic_cache(_windowed("mistral"), steps=3)


def test_sliding_window_step_of_several_tokens_is_refused() -> None:
    """Several tokens change the sliding layers' mask length and update result once the window
    fills: such a step is refused at capture and served eagerly."""
    model = _windowed("gemma3")
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    runner, _, _ = runner_and_caches(model, prompt, max_cache_len=64, warmup_iters=0)
    with torch.no_grad():
        runner.capture(prompt[:, -2:])
    (why,) = runner.blocked_signatures.values()
    assert "CaptureError" in why and "for a step of 2 tokens" in why
    assert runner.stats.entries == ()
    assert not bcg_core.is_breakable_capture_active()


def test_sliding_window_capture_before_the_prefill_is_refused() -> None:
    model = _windowed("mistral")
    cache = transformers.StaticCache(config=model.config, max_cache_len=64)

    def decode(ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=ids, past_key_values=cache).logits
        return logits

    runner = BreakableGraphRunner(decode, device="cpu", warmup_iters=0)
    with torch.no_grad():
        runner.capture(torch.tensor([[3]]))
    (why,) = runner.blocked_signatures.values()
    assert "CaptureError" in why and "before the cache is prefilled" in why
    assert not bcg_core.is_breakable_capture_active()


def test_sliding_window_replays_pass_the_divergence_check() -> None:
    """bcg's own check, over input sets before, at and well past a full window."""
    model = _windowed("mistral")
    cache = transformers.StaticCache(config=model.config, max_cache_len=64)
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))

    def at(length: int, token: int) -> Callable[[], tuple[torch.Tensor]]:
        def load() -> tuple[torch.Tensor]:
            cache.reset()
            model(input_ids=prompt.repeat(1, length // 5), past_key_values=cache)
            return (torch.tensor([[token]]),)

        return load

    def step(ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=ids, past_key_values=cache).logits
        return logits

    with torch.no_grad():
        report = bcg_core.check_divergence(step, [at(5, 3), at(15, 5), at(40, 9)])
    assert report.ok, str(report)


def _compiled_decode(
    family_config: Any, dynamic: bool = False
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A bcg_sdpa model prefilled on a StaticCache, compiled (aot_eager, fullgraph) for one
    decode step: (the explain result, the compiled step's logits, eager's on a copy)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        family_config, attn_implementation=bcg_core.breakable_attention("sdpa"),
        dtype=torch.float32,
    ).eval()  # fmt: skip
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)

    def decode(ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        return logits

    ids = torch.tensor([[7]])
    with torch.no_grad():
        decode(torch.arange(5)[None])
        reference = copy.deepcopy(cache)
        expected = model(input_ids=ids, past_key_values=copy.deepcopy(cache), use_cache=True)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(decode)(ids)
        for t, s in zip(cache_tensors(cache), cache_tensors(reference), strict=True):
            t.copy_(s)  # explain ran the step once
        compiled = torch.compile(decode, backend="aot_eager", fullgraph=True, dynamic=dynamic)
        got = compiled(ids)
    return explained, got, expected.logits


@pytest.mark.parametrize("family", sorted({**FAMILIES, **MORE_FAMILIES}))
def test_compiled_decode_is_one_graph_and_equals_eager(family: str) -> None:
    # dynamic=True for one family: the attention scale then reaches the op as a SymFloat
    dynamic = family == "llama"
    explained, got, expected = _compiled_decode({**FAMILIES, **MORE_FAMILIES}[family](), dynamic)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_compiled_sliding_window_layers_carry_their_reason(family: str) -> None:
    """Compiled, a sliding-window layer still traces to one graph (bcg's sliding-window breaks
    stay out of traced code), and its sdpa op carries the reason the capture will refuse it
    with: dynamo traces the cache's Python int position (tested end to end on CUDA, where
    captures run the compiled code: test_cuda_compile.py)."""
    from bcg_core._capture import opaque  # noqa: PLC2701

    before = set(opaque._layouts)
    explained, _, _ = _compiled_decode(WINDOWED[family]())
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    reasons = {
        leaf
        for key, layout in opaque._layouts.items()
        if key not in before
        for leaf in layout.leaves
        if isinstance(leaf, str) and ("sliding" in leaf or "chunked" in leaf)
    }
    assert reasons, "no sdpa op of this model carries a sliding-window reason"
