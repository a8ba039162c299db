"""The ``memory`` workload: what graph memory costs when a server captures many batch sizes.

Eight batch sizes (1, 2, 4, ... 128) of a decoder block — 4 layers of the CLI decoder's shape
(hidden 1024, 16 heads, 8 KV heads, ffn 2816, bfloat16), the attention core as the break — are
captured two ways:

- ``full_graph``: one plain ``torch.cuda.CUDAGraph`` per batch size, all in one pool
  (``torch.cuda.graph_pool_handle()``), largest first, with static inputs per size (attention
  captured too: the flag is off);
- ``bcg``: one :class:`bcg_core.BreakableGraphRunner` (one pool), ``capture_many`` largest
  first (the runner makes its own static input buffers).

The figure is total graph memory: the growth of ``torch.cuda.memory_reserved()`` from before
the first capture to after the last, each measured after ``gc.collect()`` and
``torch.cuda.empty_cache()``, so it counts pools, bridges and static input buffers, and nothing
that was freed. It is reported as ``pool MB``, and bcg's as a ratio to the plain graphs in the
``x full graph`` column (goal: <= 1.10). Example inputs, weights and the KV cache exist before
the baselines; each capture stream is made and has run the block before its baseline (its cuBLAS
workspace is not graph memory: bcg's lives in its capture lane's pool, made by a first
capture and reset before the baseline). ``correct``: every batch size replayed by both, bitwise
equal.
Nothing is timed. CUDA only: elsewhere both contenders are reported as skipped, with the reason.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable

import torch

from bcg_core import BreakableGraphRunner
from bcg_core.bench._harness import FULL_GRAPH, BenchContext, Measurement, Stats
from bcg_core.bench._toy_decoder import ToyDecoder
from bcg_core.bench._workloads import cli_decoder_config

WORKLOAD = "memory"
LAYERS = 4
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
Inputs = tuple[torch.Tensor, torch.Tensor]


def memory_workload(ctx: BenchContext) -> list[Measurement]:
    """Graph memory of 8 batch sizes through the runner against plain graphs in one pool."""
    case = f"batch {BATCHES[0]}-{BATCHES[-1]}, {len(BATCHES)} shapes, {LAYERS} layers"
    if ctx.device.type != "cuda":
        why = "needs CUDA (graph memory is a CUDA caching-allocator figure)"
        return [Measurement(WORKLOAD, case, c, None, skipped=why) for c in (FULL_GRAPH, "bcg")]
    cfg = dataclasses.replace(cli_decoder_config(), layers=LAYERS, vocab=256)
    model = ToyDecoder(cfg, seed=0, device=ctx.device)
    model.allocate_cache(max(BATCHES))
    step = _block_step(model)
    gen = torch.Generator(device="cpu").manual_seed(0)
    examples = {
        b: (
            torch.randn(b, cfg.hidden, generator=gen).to(ctx.device, cfg.dtype),
            torch.full((b,), cfg.max_context - 1, device=ctx.device),
        )
        for b in BATCHES
    }
    largest_first = sorted(BATCHES, reverse=True)
    with torch.no_grad():
        ctx.progress(f"{WORKLOAD}: {FULL_GRAPH}")
        plain_bytes, plain = _plain_graphs(step, examples, largest_first)
        ctx.progress(f"{WORKLOAD}: bcg")
        runner = BreakableGraphRunner(step, device=ctx.device)
        # A first capture makes the runner's capture lane (a stream and the pool that holds its
        # cuBLAS workspace); reset() keeps it for the next pool. The plain graphs' stream is
        # warmed up before their baseline too: neither side counts a workspace.
        runner.capture(*examples[1])
        runner.reset()
        before = _reserved()
        runner.capture_many([(examples[b], {}) for b in BATCHES])
        bcg_bytes = _reserved() - before
        correct = all(
            bool(torch.equal(runner(*examples[b]), replay())) for b, replay in plain.items()
        )
        captured = len(runner.stats.entries) == len(BATCHES)
        runner.reset()
    mb = 2**20
    return [
        Measurement(WORKLOAD, case, FULL_GRAPH, None, pool_mb=plain_bytes / mb, segments=1),
        Measurement(
            WORKLOAD,
            case,
            "bcg",
            None,
            pool_mb=bcg_bytes / mb,
            segments=LAYERS + 1,
            correct=correct and captured,
            ratio_to_full_graph=Stats.of([bcg_bytes / plain_bytes]),
        ),
    ]


def _block_step(model: ToyDecoder) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The decoder's layers alone: hidden states ``[B, hidden]`` at ``positions`` -> hidden."""

    def step(h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = model.rope_cos.index_select(0, positions)
        sin = model.rope_sin.index_select(0, positions)
        for block in model.blocks:
            h = block(h, positions, cos, sin)
        return h

    return step


def _reserved() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def _warm_stream(
    stream: torch.cuda.Stream,
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: Inputs,
) -> None:
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(*inputs)
    torch.cuda.current_stream().wait_stream(stream)


@dataclasses.dataclass
class _PlainGraph:
    graph: torch.cuda.CUDAGraph
    inputs: Inputs  # the static inputs it reads: held as long as the graph
    out: torch.Tensor

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out.clone()


def _plain_graphs(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    examples: dict[int, Inputs],
    order: list[int],
) -> tuple[int, dict[int, Callable[[], torch.Tensor]]]:
    """Capture one plain graph per batch size into one pool; return the memory they added and,
    per size, a function that replays it and returns a copy of its output."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    _warm_stream(stream, step, examples[1])
    pool = torch.cuda.graph_pool_handle()
    before = _reserved()
    replays: dict[int, Callable[[], torch.Tensor]] = {}
    for b in order:
        h, positions = (t.clone() for t in examples[b])
        for _ in range(2):
            _warm_stream(stream, step, (h, positions))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = step(h, positions)
        replays[b] = _PlainGraph(graph, (h, positions), out).replay
    return _reserved() - before, replays
