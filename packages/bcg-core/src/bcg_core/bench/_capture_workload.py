"""The ``capture`` workload: how long start-up capture takes, the way a serving engine does it.

An engine captures one graph per batch size before serving: largest first, all into one shared
pool (a smaller batch then reuses the larger one's blocks). This workload captures the bench
decoder (``cli_decoder_config``) at 16 batch sizes that way, per contender: a full
``torch.cuda.CUDAGraph`` of each step (flag off, CUDA only), bcg (flag on, attention is the
break) and the peer ``breakable-cuda-graphs`` package when installed (CUDA only; it gets no
shared pool, its API takes none). Every step is warmed up once beforehand; only the capture
blocks are timed.

One "step" of this workload is the whole start-up capture of all sizes: ``us/step`` is its
total time, repeated ``repeats`` times with the contenders interleaved (new graphs and a new
pool each repeat), the ratio columns compare those totals, and ``capture ms`` is the median
total. ``--smoke`` captures the tiny decoder at three sizes (on CPU: bcg on the CPU backend).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, enable_breakable_cuda_graph
from bcg_core.bench._harness import FULL_GRAPH, BenchContext, Measurement, Stats
from bcg_core.bench._toy_decoder import ToyDecoder, tiny_config
from bcg_core.bench._workloads import (
    PEER,
    cli_decoder_config,
    peer_attention,
    peer_module,
    peer_unavailable,
)

BATCH_SIZES = (128, 112, 96, 80, 64, 56, 48, 40, 32, 24, 16, 12, 8, 4, 2, 1)
SMOKE_SIZES = (4, 2, 1)

Step = Callable[[], torch.Tensor]
StartUp = Callable[[], float]
"""Captures every size once into new graphs; returns the summed capture-block seconds."""


def capture_workload(ctx: BenchContext) -> list[Measurement]:
    """Start-up capture of 16 batch sizes (largest first, one pool) per contender."""
    cuda = ctx.device.type == "cuda"
    if ctx.smoke:
        sizes: tuple[int, ...] = SMOKE_SIZES
        cfg = tiny_config(torch.bfloat16 if cuda else torch.float32)
    else:
        cfg, sizes = cli_decoder_config(), BATCH_SIZES
    case = f"{len(sizes)} batch sizes, largest first"
    startups: dict[str, StartUp | str] = {}
    with torch.no_grad():
        model = ToyDecoder(cfg, seed=0, device=ctx.device)
        model.allocate_cache(max(sizes))
        steps = [_step(model, b) for b in sizes]
        if FULL_GRAPH not in ctx.skip:
            startups[FULL_GRAPH] = _full_graph(ctx, steps) if cuda else "needs CUDA"
        if "bcg" not in ctx.skip:
            startups["bcg"] = _bcg(ctx, steps)
        peer = peer_module()
        if PEER not in ctx.skip:
            if peer is None or not cuda:
                startups[PEER] = peer_unavailable(peer)
            else:
                peer_model = ToyDecoder(cfg, seed=0, device=ctx.device)
                peer_model.allocate_cache(max(sizes))
                peer_model.set_attention(peer_attention(peer))
                startups[PEER] = _peer(ctx, peer, [_step(peer_model, b) for b in sizes])
        totals: dict[str, list[float]] = {
            n: [] for n, s in startups.items() if not isinstance(s, str)
        }
        for r in range(ctx.repeats):
            ctx.progress(f"capture: repeat {r + 1}/{ctx.repeats}")
            for name in totals:
                startup = startups[name]
                assert not isinstance(startup, str)
                totals[name].append(startup() * 1e6)
    out = []
    base = totals.get(FULL_GRAPH)
    for name, startup in startups.items():
        if isinstance(startup, str):
            out.append(Measurement("capture", case, name, None, skipped=startup))
            continue
        mine = totals[name]
        stats = Stats.of(mine)
        ratio = Stats.of([m / b for m, b in zip(mine, base, strict=True)]) if base else None
        out.append(
            Measurement(
                "capture", case, name, stats, capture_ms=stats.median / 1e3,
                ratio_to_full_graph=ratio,
            )
        )  # fmt: skip
    return out


def _step(model: ToyDecoder, batch: int) -> Step:
    device = model.embed_weight.device
    tokens = torch.arange(batch, device=device) % model.config.vocab
    positions = torch.full((batch,), model.config.max_context - 1, device=device)

    def step() -> torch.Tensor:
        logits: torch.Tensor = model(tokens, positions)
        return logits

    return step


def _timed(ctx: BenchContext, capture: Callable[[], object]) -> float:
    ctx.synchronize()
    start = time.perf_counter()
    capture()
    ctx.synchronize()
    return time.perf_counter() - start


def _warm(steps: list[Step]) -> None:
    for step in steps:
        step()


def _full_graph(ctx: BenchContext, steps: list[Step]) -> StartUp:
    _warm(steps)
    kept: list[torch.cuda.CUDAGraph] = []

    def startup() -> float:
        kept.clear()  # the previous repeat's graphs (and so its pool) go first
        pool = torch.cuda.graph_pool_handle()
        total = 0.0
        for step in steps:
            graph = torch.cuda.CUDAGraph()
            kept.append(graph)

            def capture(graph: torch.cuda.CUDAGraph = graph, step: Step = step) -> None:
                with torch.cuda.graph(graph, pool=pool):
                    step()

            total += _timed(ctx, capture)
        return total

    return startup


def _bcg(ctx: BenchContext, steps: list[Step]) -> StartUp:
    backend = ctx.device.type
    with enable_breakable_cuda_graph():
        _warm(steps)
    kept: list[BreakableCUDAGraph] = []

    def startup() -> float:
        kept.clear()
        first = BreakableCUDAGraph(backend=backend)
        pool = first.pool()
        total = 0.0
        with enable_breakable_cuda_graph():
            for i, step in enumerate(steps):
                graph = first if i == 0 else BreakableCUDAGraph(pool, backend=backend)
                kept.append(graph)

                def capture(graph: BreakableCUDAGraph = graph, step: Step = step) -> None:
                    with BreakableCUDAGraphCapture(graph):
                        step()

                total += _timed(ctx, capture)
        return total

    return startup


def _peer(ctx: BenchContext, peer: Any, steps: list[Step]) -> StartUp:
    _warm(steps)
    kept: list[Any] = []

    def startup() -> float:
        kept.clear()
        total = 0.0
        for step in steps:
            graph = peer.BreakableCUDAGraph()
            kept.append(graph)

            def capture(graph: Any = graph, step: Step = step) -> None:
                with peer.breakable_graph(graph):
                    step()

            total += _timed(ctx, capture)
        return total

    return startup
