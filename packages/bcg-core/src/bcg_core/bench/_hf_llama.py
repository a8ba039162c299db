"""The ``hf-llama`` workload of ``bcg bench``: transformers' LlamaForCausalLM decoding with a
StaticCache, attention as the break through :func:`bcg_core.breakable_attention`.

Model: 16 layers, hidden 1024, 16 heads (8 KV heads), FFN 2816, vocabulary 32000, bf16 on CUDA,
random weights from a config (nothing downloaded); cases batch 1 and 8. The cache holds 1024
positions, prefilled with 1023 tokens. A StaticCache advances its position in place on every
forward, so each timed step first rewinds every layer's position to 1023 (one
``_foreach_copy_``, inside the graph for graph contenders) and then decodes one token: every
step is the same decode over the whole cache, and capture's warm-ups leave no trace.

Contenders: eager, one full CUDA graph (flag off, so attention is captured too), bcg through
:class:`bcg_core.BreakableGraphRunner` (``return_views=True``, as a graph replay returns
nothing either) and torch.compile of the same step with transformers' plain ``sdpa`` (the whole
model compiled, as transformers documents for StaticCache; checked to be one dynamo graph), then
the compiled kernels: ``compiled_graph`` (``torch.compile(step)``, default mode, captured in one
plain CUDA graph: the limit) and ``bcg+compile`` (the runner over that compiled step, attention
still the break); both checked against the compiled step (bitwise where it reproduces itself,
see ``compiled_check``), capture ms include compiling.
Skipped with the reason when transformers is not installed.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch

from bcg_core import BreakableGraphRunner, breakable_attention
from bcg_core.bench._harness import EAGER, FULL_GRAPH, BenchContext, Contender, Measurement
from bcg_core.bench._workloads import (
    BCG_COMPILE,
    COMPILE,
    COMPILED_GRAPH,
    bcg_compile_contender,
    compile_contender,
    compiled_graph_contender,
    full_graph_contender,
    runner_contender,
)

WORKLOAD = "hf-llama"
CONTENDERS = (EAGER, FULL_GRAPH, "bcg", COMPILE, COMPILED_GRAPH, BCG_COMPILE)


def hf_llama_workload(ctx: BenchContext) -> list[Measurement]:
    try:
        import transformers
    except ImportError:
        why = 'transformers is not installed (pip install "bcg-core[transformers]")'
        return [Measurement(WORKLOAD, "-", c, None, skipped=why) for c in CONTENDERS]
    model, context, batches = _llama(transformers, ctx.device, ctx.smoke)
    out: list[Measurement] = []
    for batch in batches:
        out += _case(ctx, transformers, model, batch, context)
    return out


def _llama(
    transformers: Any, device: torch.device, smoke: bool
) -> tuple[Any, int, tuple[int, ...]]:
    """The workload's model (``bcg_sdpa`` attention, seeded random weights, on ``device``), its
    cache length and its batch sizes: the bench size, or a tiny one for ``--smoke``."""
    cuda = device.type == "cuda"
    if smoke:
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
        )  # fmt: skip
        dtype, context, batches = (torch.bfloat16 if cuda else torch.float32), 32, (1, 2)
    else:
        config = transformers.LlamaConfig(
            hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
            num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
        )  # fmt: skip
        dtype, context, batches = torch.bfloat16, 1024, (1, 8)
    torch.manual_seed(0)
    llama: Any = transformers.LlamaForCausalLM  # untyped library
    model = llama._from_config(config, attn_implementation=breakable_attention("sdpa"), dtype=dtype)
    return model.to(device).eval(), context, batches


def _decode_step(
    transformers: Any, model: Any, batch: int, context: int
) -> Callable[[], torch.Tensor]:
    """One decode step at position ``context - 1`` over a cache prefilled up to it."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen)
    prompt = prompt.to(device)
    cache = transformers.StaticCache(config=model.config, max_cache_len=context)
    with torch.no_grad():
        model(input_ids=prompt[:, :-1], past_key_values=cache, use_cache=True)
    positions = [layer.cumulative_length for layer in cache.layers]
    start = [positions[0].clone()] * len(positions)
    token = prompt[:, -1:].contiguous()

    def step() -> torch.Tensor:
        torch._foreach_copy_(positions, start)
        logits: torch.Tensor = model(input_ids=token, past_key_values=cache, use_cache=True).logits
        return logits

    return step


def _case(
    ctx: BenchContext, transformers: Any, model: Any, batch: int, context: int
) -> list[Measurement]:
    ctx.progress(f"{WORKLOAD} batch={batch}: building contenders")
    with torch.no_grad():
        step = _decode_step(transformers, model, batch, context)
        runner = BreakableGraphRunner(step, device=ctx.device, return_views=True)

        @functools.cache
        def exact_step() -> Callable[[], torch.Tensor]:
            """The same decode in float32 (built once, only if a compiled contender runs)."""
            return _decode_step(transformers, copy.deepcopy(model).float(), batch, context)

        def exact() -> torch.Tensor:
            return exact_step()()

        def make_compile() -> Contender:
            plain = copy.deepcopy(model)
            plain.set_attn_implementation("sdpa")
            return compile_contender(
                ctx, _decode_step(transformers, plain, batch, context), step, exact
            )

        contenders = [
            Contender(EAGER, step),
            ctx.build(FULL_GRAPH, lambda: full_graph_contender(ctx, step, step)),
            ctx.build("bcg", lambda: runner_contender(ctx, runner, step)),
            ctx.build(COMPILE, make_compile),  # first: its one-graph check resets dynamo
            ctx.build(COMPILED_GRAPH, lambda: compiled_graph_contender(ctx, step, (step, exact))),
            ctx.build(BCG_COMPILE, lambda: bcg_compile_contender(ctx, step, (step, exact))),
        ]
        try:
            return ctx.compare(WORKLOAD, f"batch={batch}", contenders)
        finally:
            runner.reset()
