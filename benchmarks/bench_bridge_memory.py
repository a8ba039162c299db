"""Graph memory of breakable graphs against plain CUDA graphs, all shapes in one pool (CUDA only).

``PYTHONPATH=packages/bcg-core/src python3 benchmarks/bench_bridge_memory.py --out DIR``

The block is ``gelu(x @ w1) @ w2`` with the gelu an eager break; one graph per row count
(default 2048, 1024, ..., 16; hidden 4096, bf16), captured largest first into one pool, as
serving engines capture their batch sizes. Three variants, each from a clean allocator:

- ``plain``: ``torch.cuda.graph`` per shape (the gelu captured), the reference;
- ``bcg``: breakable graphs, a break's capture-time allocations routed to the pool and its
  bridge held through a non-owning alias (the memory of a graph intermediate);
- ``bcg_strong_bridges``: breakable graphs with routing switched off, so every bridge is
  allocated outside the pool and held for the graph's lifetime (the behaviour before routing).

For each: the pool's reserved bytes, bytes left allocated outside the pool by the captures
(strong bridges), their sum (``total``), ``total`` relative to ``plain``, and the growth of
``torch.cuda.memory_reserved()`` once every graph has replayed once (eager breaks allocate their
fresh outputs from the general allocator at replay). Then every graph is replayed in three
orders (forward, reversed, seeded random) with fresh inputs and compared bitwise with eager
code. Writes ``DIR/bench_bridge_memory.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, eager_on_graph
from bcg_core._backends import backend_for  # noqa: PLC2701 (the "before" variant's switch)
from bcg_core.bench import environment as bench_environment

MiB = float(1 << 20)
VARIANTS = ("plain", "bcg", "bcg_strong_bridges")


@eager_on_graph(name="gelu")
def gelu_break(h: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(h)


def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = x @ w1
    h = gelu_break(h)
    return h @ w2


def pool_usage(pool_id: Any) -> tuple[int, int]:
    """(reserved, allocated) bytes of one pool, from the allocator's snapshot."""
    want = tuple(pool_id)
    snapshot: list[dict[str, Any]] = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
    segments = [s for s in snapshot if tuple(s["segment_pool_id"]) == want]
    return sum(s["total_size"] for s in segments), sum(s["allocated_size"] for s in segments)


@contextlib.contextmanager
def routing_off() -> Iterator[None]:
    """Breaks run without pool routing: bridges allocated outside the pool, held strongly."""
    backend: Any = backend_for("cuda")
    backend.allocate_to_pool = lambda pool, device: contextlib.nullcontext(False)
    try:
        yield
    finally:
        del backend.allocate_to_pool


def clean_allocator() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run_variant(
    variant: str, rows: list[int], weights: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype
) -> dict[str, Any]:
    clean_allocator()
    hidden = weights[0].shape[0]
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # library workspaces for this stream exist before capture
        block(torch.randn(rows[-1], hidden, device="cuda", dtype=dtype), *weights)
    xs = [torch.randn(n, hidden, device="cuda", dtype=dtype) for n in rows]
    first = BreakableCUDAGraph()
    pool = torch.cuda.graph_pool_handle() if variant == "plain" else first.pool().id
    clean_allocator()
    allocated_before = torch.cuda.memory_allocated()
    reserved_before = torch.cuda.memory_reserved()
    graphs: list[tuple[torch.Tensor, Callable[[], None], torch.Tensor]] = []
    per_shape: list[dict[str, Any]] = []
    with routing_off() if variant == "bcg_strong_bridges" else contextlib.nullcontext():
        for i, x in enumerate(xs):
            if variant == "plain":
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    out = block(x, *weights)
                replay = g.replay
            else:
                bg = first if i == 0 else BreakableCUDAGraph(pool=first.pool())
                with BreakableCUDAGraphCapture(bg, stream=stream):
                    out = block(x, *weights)
                replay = bg.replay
            graphs.append((x, replay, out))
            torch.cuda.synchronize()
            reserved, _ = pool_usage(pool)
            per_shape.append({"rows": rows[i], "pool_reserved_mib": reserved / MiB})
    clean_allocator()
    pool_reserved, pool_allocated = pool_usage(pool)
    outside = torch.cuda.memory_allocated() - allocated_before - pool_allocated

    # What replays add (eager breaks allocate their fresh outputs from the general allocator),
    # before any eager reference computation allocates too.
    for _, replay, _ in graphs:
        replay()
    torch.cuda.synchronize()
    reserved_after_replays = torch.cuda.memory_reserved() - reserved_before

    mismatches = []
    orders = {
        "forward": list(range(len(graphs))),
        "reversed": list(reversed(range(len(graphs)))),
        "random": random.Random(0).sample(range(len(graphs)), len(graphs)),
    }
    for name, order in orders.items():
        for i in order:
            x, replay, out = graphs[i]
            x.copy_(torch.randn_like(x))
            replay()
            if not torch.equal(out, block(x, *weights)):
                mismatches.append(f"{name}: rows {rows[i]}")
    return {
        "pool_reserved_mib": pool_reserved / MiB,
        "outside_pool_allocated_mib": outside / MiB,
        "total_mib": (pool_reserved + outside) / MiB,
        "reserved_delta_after_one_replay_each_mib": reserved_after_replays / MiB,
        "per_shape": per_shape,
        "bitwise_correct": not mismatches,
        "mismatches": mismatches,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument(
        "--rows", default="2048,1024,512,256,128,64,32,16", help="row counts, largest first"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_bridge_memory needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = sorted((int(r) for r in args.rows.split(",")), reverse=True)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1, w2 = (
        torch.randn(args.hidden, args.hidden, device="cuda", dtype=dtype, generator=gen)
        / args.hidden**0.5
        for _ in range(2)
    )
    results = {v: run_variant(v, rows, (w1, w2), dtype) for v in VARIANTS}
    plain = results["plain"]["total_mib"]
    for r in results.values():
        r["total_vs_plain"] = r["total_mib"] / plain if plain else None
    report = {
        "environment": bench_environment(),
        "config": {"rows": rows, "hidden": args.hidden, "dtype": args.dtype},
        "variants": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_bridge_memory.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print("| variant | pool MiB | outside pool MiB | total MiB | vs plain | bitwise |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['pool_reserved_mib']:.1f} | {r['outside_pool_allocated_mib']:.1f} | "
            f"{r['total_mib']:.1f} | {r['total_vs_plain']:.3f} | {r['bitwise_correct']} |"
        )
    print(f"wrote {path}")
    return 0 if all(r["bitwise_correct"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
