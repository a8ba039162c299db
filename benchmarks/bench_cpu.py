"""The CPU graph backend against eager PyTorch: one decode step of the toy decoder on the CPU.

``PYTHONPATH=packages/bcg-core/src python3 benchmarks/bench_cpu.py --out DIR``

The toy decoder (``tiny_config()``, float32, 8 layers, hidden 256), batch 1, one decode step:
eager (flag off: the attention core is a direct call) against the replay of a breakable graph
captured with ``BreakableCUDAGraph(backend="cpu")`` (flag on: the attention core of every layer
is a break, so a replay is 9 recorded segments and 8 eager breaks). Two models with the same
weights, each with its own KV cache, run the same tokens and positions; after warm-up the replay's
logits are checked bitwise against the eager step's. Each repeat times ``--steps`` steps of each
variant (interleaved, garbage collector off) with ``time.perf_counter``; every figure is the
median over ``--repeats`` repeats, and the ratio is taken per repeat, then the median.
Target: replay / eager <= 2.0 (the CPU backend is for running and checking graphs without a GPU,
not for speed).

Writes ``DIR/bench_cpu.json`` and prints one line. Needs only torch and bcg_core.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, enable_breakable_cuda_graph
from bcg_core.bench import ToyDecoder, environment, tiny_config

TARGET = 2.0
BATCH = 1


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _time_ms(fn: Callable[[], object], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) * 1e3 / steps


def bench(repeats: int, steps: int) -> dict[str, Any]:
    cfg = tiny_config(dtype=torch.float32)
    eager = ToyDecoder(cfg, seed=0, device="cpu")
    graphed = ToyDecoder(cfg, seed=0, device="cpu")
    eager.allocate_cache(BATCH)
    graphed.allocate_cache(BATCH)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (BATCH,), generator=gen)
    positions = torch.zeros(BATCH, dtype=torch.long)

    for _ in range(3):  # warm-up (lazy initialisation, allocator)
        eager(tokens, positions)
    graph = BreakableCUDAGraph(backend="cpu")
    start = time.perf_counter()
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        logits = graphed(tokens, positions)
    capture_s = time.perf_counter() - start

    # Same tokens and positions through both models: the replay must match eager bitwise.
    for model in (eager, graphed):
        for block in model.blocks:
            assert block.attn.k_cache is not None and block.attn.v_cache is not None
            block.attn.k_cache.zero_()
            block.attn.v_cache.zero_()
    bitwise = True
    for step in range(4):
        new_tokens = torch.randint(0, cfg.vocab, (BATCH,), generator=gen)
        tokens.copy_(new_tokens)
        positions.fill_(step)
        graph.replay()
        bitwise = bitwise and torch.equal(logits, eager(new_tokens, positions.clone()))

    static_tokens, static_positions = tokens.clone(), positions.clone()

    def eager_step() -> object:
        return eager(static_tokens, static_positions)

    eager_ms: list[float] = []
    replay_ms: list[float] = []
    ratios: list[float] = []
    for _ in range(3):  # settle clocks and caches
        eager_step()
        graph.replay()
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            e = _time_ms(eager_step, steps)
            r = _time_ms(graph.replay, steps)
            eager_ms.append(e)
            replay_ms.append(r)
            ratios.append(r / e)
    finally:
        gc.enable()
    ratio = _summary(ratios)
    return {
        "config": {
            k: str(v) if isinstance(v, torch.dtype) else v
            for k, v in dataclasses.asdict(cfg).items()
        },
        "batch": BATCH,
        "segments": graph.num_segments,
        "breaks": graph.num_breaks,
        "capture_s": capture_s,
        "bitwise_equal": bitwise,
        "steps_per_repeat": steps,
        "repeats": repeats,
        "ms_per_step": {"eager": _summary(eager_ms), "replay": _summary(replay_ms)},
        "ratio_replay_to_eager": ratio,
        "target": TARGET,
        "meets_target": ratio["median"] <= TARGET,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_cpu.json")
    parser.add_argument("--repeats", type=int, default=30, help="repeats per figure (>= 20)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per repeat (>= 1)")
    args = parser.parse_args(argv)
    if args.repeats < 20 or args.steps < 1:
        parser.error("use --repeats >= 20 and --steps >= 1")
    with torch.no_grad():
        result = bench(args.repeats, args.steps)
    report = {"environment": environment(), "decoder": result}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_cpu.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    ms, ratio = result["ms_per_step"], result["ratio_replay_to_eager"]["median"]
    verdict = "ok" if result["meets_target"] else "MISSED"
    print(
        f"bench_cpu: toy decoder tiny_config float32 batch {BATCH}: eager "
        f"{ms['eager']['median']:.3f} ms/step, CPU-backend replay {ms['replay']['median']:.3f} "
        f"ms/step, replay/eager {ratio:.3f} (target <= {TARGET:.1f}: {verdict}), "
        f"{result['segments']} segments, {result['breaks']} breaks, "
        f"bitwise {'equal' if result['bitwise_equal'] else 'DIFFERENT'}; wrote {path}"
    )
    return 0 if result["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
