"""A Llama-style toy decoder with attention as the break: bit-identical to eager over replays."""

from __future__ import annotations

import pytest
import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    enable_breakable_cuda_graph,
)
from bcg_core._toy_decoder import ToyDecoder, tiny_config  # noqa: PLC2701

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("batch", [1, 8])
def test_decoder_replay_is_bit_identical_to_eager(batch: int) -> None:
    cfg = tiny_config()
    assert cfg.layers >= 8 and cfg.dtype is torch.bfloat16
    eager = ToyDecoder(cfg, seed=0, device="cuda")
    graphed = ToyDecoder(cfg, seed=0, device="cuda")
    eager.allocate_cache(batch)
    graphed.allocate_cache(batch)
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (batch,), device="cuda", generator=gen)
    positions = torch.zeros(batch, dtype=torch.long, device="cuda")
    with torch.no_grad():
        # Warm-up on a side stream, then reset the caches so both models start equal.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), enable_breakable_cuda_graph():
            graphed(tokens, positions)
        torch.cuda.current_stream().wait_stream(side)
        graphed.allocate_cache(batch)
        graph = BreakableCUDAGraph()
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
            logits = graphed(tokens, positions)
        assert graph.num_breaks == cfg.layers
        assert graph.break_names == ("toy_decoder.attention",) * cfg.layers
        assert graph.num_segments == cfg.layers + 1
        # The capture ran the breaks (cache writes) once; undo them so both models match.
        for block in graphed.blocks:
            assert block.attn.k_cache is not None and block.attn.v_cache is not None
            block.attn.k_cache.zero_()
            block.attn.v_cache.zero_()
        for step in range(4):
            new_tokens = torch.randint(0, cfg.vocab, (batch,), device="cuda", generator=gen)
            new_positions = (
                torch.full((batch,), step, device="cuda") + torch.arange(batch, device="cuda") % 2
            )
            tokens.copy_(new_tokens)
            positions.copy_(new_positions)
            graph.replay()
            expected = eager(new_tokens, new_positions)
            torch.cuda.synchronize()
            assert torch.equal(logits, expected), f"step {step}"
        for a, b in zip(eager.blocks, graphed.blocks, strict=True):
            assert torch.equal(a.attn.k_cache, b.attn.k_cache)  # type: ignore[arg-type]
