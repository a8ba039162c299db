# ruff: noqa: PLC2701  (a profiler times the runtime's private phases by wrapping them)
"""Where a capture block's time goes (issue 23): plain torch graphs against bcg graphs.

Captures a few batch sizes of the bench decoder (8B dims by default) as plain
``torch.cuda.CUDAGraph`` blocks and as ``BreakableCUDAGraphCapture`` blocks, each with the
device synchronised around it, and writes to ``$OUT``:

- ``phases.txt``: wall seconds per phase summed over the captured sizes, with call counts:
  torch's ``capture_begin``/``capture_end``, bcg's segment begin/end and breaks, the CUDA
  runtime queries (capture info, node count), and a plain capture split with
  ``keep_graph=True`` into end-capture and ``instantiate``, so instantiation is measured apart;
- ``profile-<contender>-tottime.txt`` / ``-cumtime.txt``: cProfile top 40 of the capture blocks.

Run from the repo root with the sources on PYTHONPATH (tools/device_run.sh probes does).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    eager_on_graph,
    enable_breakable_cuda_graph,
)
from bcg_core._backends import cuda as cuda_backend
from bcg_core._backends import cuda_pool
from bcg_core._backends.cudart import RUNTIME
from bcg_core._capture import capture as capture_mod
from bcg_core.bench import _toy_decoder as toy_decoder
from bcg_core.bench._scale_workload import scale_config
from bcg_core.bench._toy_decoder import ToyDecoder

TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)
SEGMENTS: dict[int, int] = {}


def _timing(owner: Any, attr: str, label: str) -> None:
    """Replace ``owner.attr`` with a wrapper that adds its wall time under ``label``."""
    inner = getattr(owner, attr)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - started
            COUNTS[label] += 1

    setattr(owner, attr, wrapped)


def _instrument() -> None:
    _timing(torch.cuda.CUDAGraph, "capture_begin", "torch CUDAGraph.capture_begin")
    _timing(torch.cuda.CUDAGraph, "capture_end", "torch CUDAGraph.capture_end (+instantiate)")
    _timing(torch.cuda.CUDAGraph, "instantiate", "torch CUDAGraph.instantiate (keep_graph)")
    _timing(torch.cuda.CUDAGraph, "replay", "torch CUDAGraph.replay (faithful + first replays)")
    _timing(RUNTIME, "capture_info", "cudart capture_info query")
    _timing(RUNTIME, "capture_node_count", "cudart capture_node_count query")
    _timing(cuda_backend.CudaSegment, "capture_begin", "bcg CudaSegment.capture_begin")
    _timing(cuda_backend.CudaSegment, "capture_end", "bcg CudaSegment.capture_end")
    _timing(capture_mod.CaptureState, "begin_segment", "bcg CaptureState.begin_segment")
    _timing(capture_mod.CaptureState, "end_segment", "bcg CaptureState.end_segment")
    _timing(capture_mod.CaptureState, "record_break", "bcg CaptureState.record_break (all)")
    _timing(capture_mod.BreakableCUDAGraphCapture, "__enter__", "bcg capture __enter__")
    _timing(capture_mod.BreakableCUDAGraphCapture, "__exit__", "bcg capture __exit__")
    # Inside record_break: the fresh-storage tracker's per-op handler, the bridge, the aliases.
    _timing(capture_mod.FreshTensorTracker, "__torch_dispatch__", "bcg fresh tracker, per op")
    _timing(capture_mod, "Bridge", "bcg Bridge(...)")
    _timing(capture_mod, "alias_tree", "bcg alias_tree (break arguments)")
    _timing(capture_mod, "copy_into_pool", "bcg copy_into_pool (fresh outputs)")
    _timing(capture_mod, "BreakStep", "bcg BreakStep(...)")
    _timing(cuda_pool, "reserved_bytes", "bcg reserved_bytes (pool count reads)")
    _timing(cuda_backend, "allocate_to_pool", "bcg allocate_to_pool (making the block)")
    # The break's own body, in both contenders (plain graphs call it directly): what is left of
    # record_break beyond it is bcg's per-break cost.
    core = toy_decoder.attention_core

    def timed_core(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return core(*args, **kwargs)
        finally:
            TIMES["break body (attention_core)"] += time.perf_counter() - started
            COUNTS["break body (attention_core)"] += 1

    toy_decoder._attention_break = eager_on_graph(name="toy_decoder.attention", gated=True)(
        timed_core
    )


@contextmanager
def _block(label: str) -> Iterator[None]:
    torch.cuda.synchronize()
    started = time.perf_counter()
    yield
    torch.cuda.synchronize()
    TIMES[label] += time.perf_counter() - started
    COUNTS[label] += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--sizes", default="256,128,64,8,1")
    args = parser.parse_args()
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    cfg = dataclasses.replace(scale_config(), layers=args.layers)
    with torch.no_grad():
        model = ToyDecoder(cfg, seed=0, device=torch.device("cuda"), draw_on_device=True)
        model.allocate_cache(max(sizes))
        inputs = {
            b: (torch.arange(b, device="cuda") % cfg.vocab,
                torch.full((b,), cfg.max_context - 1, device="cuda"))
            for b in sizes
        }  # fmt: skip
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        for tokens, positions in inputs.values():  # warm kernels and cuBLAS before timing
            with torch.cuda.stream(side):
                model(tokens, positions)
        torch.cuda.synchronize()
        _instrument()
        keep: list[Any] = []
        runs: dict[str, Callable[[], None]] = {
            "plain": lambda: _plain(model, inputs, side, keep, split=False),
            "plain-keep-graph": lambda: _plain(model, inputs, side, keep, split=True),
            "bcg": lambda: _bcg(model, inputs, keep, faithful=True),
            "bcg-record-only": lambda: _bcg(model, inputs, keep, faithful=False),
        }
        lines = [f"{cfg.layers} layers, hidden {cfg.hidden}, sizes {sizes}"]
        for name, run in runs.items():
            TIMES.clear()
            COUNTS.clear()
            profiler = cProfile.Profile()
            profiler.enable()
            run()
            profiler.disable()
            for key in ("tottime", "cumtime"):
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(40)
                with open(f"{out}/profile-{name}-{key}.txt", "w") as f:
                    f.write(text.getvalue())
            lines.append(f"\n== {name} (cProfile on; compare blocks across contenders)")
            if SEGMENTS:
                lines.append(f"  segments per graph: {list(SEGMENTS.values())}")
                SEGMENTS.clear()
            for label in sorted(TIMES, key=lambda k: -TIMES[k]):
                lines.append(f"  {TIMES[label] * 1e3:10.2f} ms  x{COUNTS[label]:5d}  {label}")
            keep.clear()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        # Without cProfile (it inflates Python-heavy paths): the blocks, and the phases inside
        # them as the timing wrappers alone see them.
        lines.append("\n== without cProfile: blocks, then phases")
        for name, run in runs.items():
            TIMES.clear()
            COUNTS.clear()
            run()
            for label in sorted(TIMES, key=lambda k: (not k.startswith("block"), -TIMES[k])):
                value = TIMES[label] * 1e3
                lines.append(f"  {name:18s} {value:10.2f} ms  x{COUNTS[label]:5d}  {label}")
            keep.clear()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    report = "\n".join(lines)
    print(report)
    with open(f"{out}/phases.txt", "w") as f:
        f.write(report + "\n")


def _plain(model: ToyDecoder, inputs: dict[int, Any], side: Any, keep: list[Any], *,
           split: bool) -> None:  # fmt: skip
    pool = torch.cuda.graph_pool_handle()
    for tokens, positions in inputs.values():
        graph = torch.cuda.CUDAGraph(keep_graph=split)
        keep.append(graph)
        with _block("block (capture)"), torch.cuda.graph(graph, pool=pool, stream=side):
            out = model(tokens, positions)
        keep.append(out)
        if split:
            with _block("block (instantiate)"):
                graph.instantiate()
        with _block("block (first replay)"):
            graph.replay()


def _bcg(model: ToyDecoder, inputs: dict[int, Any], keep: list[Any], *, faithful: bool) -> None:
    first = BreakableCUDAGraph()
    pool = first.pool()
    keep.append(first)
    with enable_breakable_cuda_graph():
        for i, (tokens, positions) in enumerate(inputs.values()):
            graph = first if i == 0 else BreakableCUDAGraph(pool)
            keep.append(graph)
            with graph.warmup():
                model(tokens, positions)
            with _block("block (capture)"), BreakableCUDAGraphCapture(graph, faithful=faithful):
                out = model(tokens, positions)
            keep.append(out)
            with _block("block (first replay)"):
                graph.replay()
            SEGMENTS[len(SEGMENTS)] = graph.num_segments


if __name__ == "__main__":
    main()
