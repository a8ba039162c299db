"""Core benchmarks of bcg on one CUDA GPU, all measured in one run.

``PYTHONPATH=packages/bcg-core/src python3 benchmarks/bench_core.py --out DIR``

(a) Break overhead. A breakable graph of ``K + 1`` one-kernel segments separated by ``K`` no-op
    breaks is replayed against a breakable graph holding the same ``K + 1`` kernels in one
    segment; ``(T_K - T_0) / K`` is the cost of one break (one more segment launch plus the eager
    call), compared with one raw ``torch.cuda.CUDAGraph.replay()`` of a one-kernel graph. Times
    are host time per replay (``time.perf_counter`` around a short burst of replays on an idle
    GPU, so launches never wait for a full queue), with CUDA-event times alongside. The three
    are measured interleaved after a second of warm-up (host clocks settle), with the garbage
    collector off, and every figure is the median over ``--overhead-repeats`` repeats of
    per-repeat values. Target: per-break cost / raw launch <= 1.10.

(b) The toy decoder (``bench_config()``, bf16) for one decode step attending over the full
    1024-slot KV cache, batch 1 and 8: eager (flag off), one full ``torch.cuda.CUDAGraph`` of the
    step (flag off), and bcg (flag on, the attention core of every layer is a break). Each is
    warmed up on a side stream before capture. Per-step times come from CUDA events around
    ``--steps`` steps, repeated ``--repeats`` times, the three variants interleaved; ratios are
    per-repeat pairs, then the median. After capture new tokens are copied into the static input
    and the bcg replay's output is checked bitwise against the full graph's and the eager step's.

Writes ``DIR/bench_core.json`` (environment and every figure) and prints Markdown tables. Needs
only torch and bcg_core.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    eager_on_graph,
    enable_breakable_cuda_graph,
)
from bcg_core.bench import ToyDecoder, bench_config

# The toy decoder is a private module of bcg_core, kept out of the public API on purpose.
from bcg_core.bench import environment as bench_environment

BREAK_COUNTS = (16, 64)
BATCHES = (1, 8)
OVERHEAD_TARGET = 1.10
# Graph launches per timed burst in (a): few enough that the launch queue never fills, so the
# host time is the time to issue the launches, not the time the GPU takes to run them.
LAUNCHES_PER_BURST = 512
WARMUP_S = 1.0


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@contextlib.contextmanager
def _gc_off() -> Iterator[None]:
    """Collect once, then keep the garbage collector from pausing the timed loops."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@eager_on_graph(name="bench.noop")
def _noop_break(x: torch.Tensor) -> None:
    """A break point that does no work."""


def _chain(x: torch.Tensor, kernels: int, breaks: int) -> None:
    """``kernels`` one-element-kernel adds on ``x``, with a no-op break after each of the first
    ``breaks`` of them."""
    for i in range(kernels):
        x.add_(1.0)
        if i < breaks:
            _noop_break(x)


def _capture_chain(x: torch.Tensor, kernels: int, breaks: int) -> BreakableCUDAGraph:
    graph = BreakableCUDAGraph()
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        _chain(x, kernels, breaks)
    expected = breaks + 1
    if graph.num_segments != expected:
        raise RuntimeError(f"expected {expected} segments, captured {graph.num_segments}")
    return graph


def _time_burst(replay: Callable[[], None], n: int) -> tuple[float, float]:
    """Host and CUDA-event microseconds per call over ``n`` back-to-back calls from an idle GPU."""
    start = torch.Event("cuda", enable_timing=True)
    end = torch.Event("cuda", enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        replay()
    t1 = time.perf_counter()
    end.record()
    end.synchronize()
    return (t1 - t0) * 1e6 / n, start.elapsed_time(end) * 1e3 / n


def bench_break_overhead(repeats: int) -> list[dict[str, Any]]:
    """Part (a): per-break cost of a no-op break against one raw CUDA graph launch."""
    x = torch.zeros(256, device="cuda")
    raw = torch.cuda.CUDAGraph()
    side = torch.Stream("cuda")
    side.wait_stream(torch.cuda.current_stream())
    with side:
        x.add_(1.0)  # warm-up before capture, as torch.cuda.graph recommends
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(raw):
        x.add_(1.0)

    results = []
    for k in BREAK_COUNTS:
        with_breaks = _capture_chain(x, k + 1, k)
        without = _capture_chain(x, k + 1, 0)
        n_bcg = max(4, LAUNCHES_PER_BURST // (k + 1))
        variants: dict[str, tuple[Callable[[], None], int]] = {
            "raw": (raw.replay, LAUNCHES_PER_BURST),
            "bcg_0": (without.replay, n_bcg),
            "bcg_k": (with_breaks.replay, n_bcg),
        }
        warm_until = time.perf_counter() + WARMUP_S
        while time.perf_counter() < warm_until:
            for replay, n in variants.values():
                _time_burst(replay, n)
        host: dict[str, list[float]] = {name: [] for name in variants}
        device: dict[str, list[float]] = {name: [] for name in variants}
        per_break_host, per_break_device, ratio = [], [], []
        for _ in range(repeats):
            for name, (replay, n) in variants.items():
                h, d = _time_burst(replay, n)
                host[name].append(h)
                device[name].append(d)
            per_break_host.append((host["bcg_k"][-1] - host["bcg_0"][-1]) / k)
            per_break_device.append((device["bcg_k"][-1] - device["bcg_0"][-1]) / k)
            ratio.append(per_break_host[-1] / host["raw"][-1])
        median_ratio = statistics.median(ratio)
        results.append(
            {
                "breaks": k,
                "segments": with_breaks.num_segments,
                "replays_per_burst": {name: n for name, (_, n) in variants.items()},
                "host_us_per_replay": {name: _summary(v) for name, v in host.items()},
                "device_us_per_replay": {name: _summary(v) for name, v in device.items()},
                "per_break_host_us": _summary(per_break_host),
                "per_break_device_us": _summary(per_break_device),
                "raw_launch_host_us": _summary(host["raw"]),
                "ratio_per_break_to_raw_launch": _summary(ratio),
                "target": OVERHEAD_TARGET,
                "meets_target": median_ratio <= OVERHEAD_TARGET,
            }
        )
        print(
            f"[a] K={k}: per-break {statistics.median(per_break_host):.2f} us, raw launch "
            f"{statistics.median(host['raw']):.2f} us, ratio {median_ratio:.3f}",
            flush=True,
        )
        del with_breaks, without
    return results


def _time_steps(step: Callable[[], object], steps: int) -> float:
    """CUDA-event microseconds per step over ``steps`` back-to-back steps."""
    start = torch.Event("cuda", enable_timing=True)
    end = torch.Event("cuda", enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / steps


def bench_decoder(repeats: int, steps: int) -> dict[str, Any]:
    """Part (b): eager vs full CUDA graph vs bcg decode steps of the toy decoder."""
    config = bench_config()
    t0 = time.perf_counter()
    model = ToyDecoder(config, seed=0, device="cuda")
    print(f"[b] built bench_config() decoder in {time.perf_counter() - t0:.1f} s", flush=True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for k_cache, v_cache in model.allocate_cache(max(BATCHES)):
        k_cache.normal_(generator=generator)
        v_cache.normal_(generator=generator)

    per_batch = []
    for batch in BATCHES:
        tokens = torch.randint(
            config.vocab, (batch,), generator=generator, device="cuda", dtype=torch.long
        )
        # Every sequence sits near the end of the window, so attention reads ~max_context slots.
        positions = config.max_context - 1 - torch.arange(batch, device="cuda")

        def eager_step(tokens: torch.Tensor = tokens, positions: torch.Tensor = positions) -> None:
            model(tokens, positions)

        side = torch.Stream("cuda")
        side.wait_stream(torch.cuda.current_stream())
        with side:
            for _ in range(3):
                eager_step()
            with enable_breakable_cuda_graph():
                for _ in range(3):
                    eager_step()
        torch.cuda.current_stream().wait_stream(side)

        full = torch.cuda.CUDAGraph()
        with torch.cuda.graph(full):
            full_out: torch.Tensor = model(tokens, positions)
        bcg = BreakableCUDAGraph()
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(bcg):
            bcg_out: torch.Tensor = model(tokens, positions)

        # New tokens into the static input: both graphs must follow it like the eager step.
        tokens.copy_(torch.randint(config.vocab, (batch,), generator=generator, device="cuda"))
        eager_ref: torch.Tensor = model(tokens, positions).clone()
        full.replay()
        full_ref = full_out.clone()
        bcg.replay()
        bcg_ref = bcg_out.clone()
        bitwise = {
            "bcg_vs_full_graph": torch.equal(bcg_ref, full_ref),
            "bcg_vs_eager": torch.equal(bcg_ref, eager_ref),
            "full_graph_vs_eager": torch.equal(full_ref, eager_ref),
        }
        print(f"[b] B={batch}: bitwise equal {bitwise}", flush=True)

        variants: dict[str, Callable[[], object]] = {
            "eager": eager_step,
            "full_graph": full.replay,
            "bcg": bcg.replay,
        }
        for step in variants.values():
            _time_steps(step, steps)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, step in variants.items():
                times[name].append(_time_steps(step, steps))
        pairs = {
            "bcg_to_full_graph": ("bcg", "full_graph"),
            "bcg_to_eager": ("bcg", "eager"),
            "full_graph_to_eager": ("full_graph", "eager"),
        }
        ratios = {
            key: _summary([a / b for a, b in zip(times[num], times[den], strict=True)])
            for key, (num, den) in pairs.items()
        }
        per_batch.append(
            {
                "batch": batch,
                "positions": positions.tolist(),
                "bcg_segments": bcg.num_segments,
                "bcg_breaks": bcg.num_breaks,
                "us_per_step": {name: _summary(v) for name, v in times.items()},
                "ratios": ratios,
                "bitwise_equal": bitwise,
            }
        )
        print(
            f"[b] B={batch}: eager {statistics.median(times['eager']):.1f} us, full graph "
            f"{statistics.median(times['full_graph']):.1f} us, bcg "
            f"{statistics.median(times['bcg']):.1f} us per step",
            flush=True,
        )
        del full, bcg, full_out, bcg_out
        torch.cuda.empty_cache()

    fields = dataclasses.asdict(config)
    fields["dtype"] = str(config.dtype)
    return {
        "config": fields,
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps_per_repeat": steps,
        "repeats": repeats,
        "batches": per_batch,
    }


def _markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"bcg core benchmarks: {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, "
        f"driver {env['driver']}, {env['date']}",
        "",
        "| breaks K | per-break host us | raw launch host us | ratio (target ≤ "
        f"{OVERHEAD_TARGET:.2f}) | per-break device us |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in report["break_overhead"]:
        ok = "ok" if row["meets_target"] else "MISSED"
        lines.append(
            f"| {row['breaks']} | {row['per_break_host_us']['median']:.2f} "
            f"| {row['raw_launch_host_us']['median']:.2f} "
            f"| {row['ratio_per_break_to_raw_launch']['median']:.3f} {ok} "
            f"| {row['per_break_device_us']['median']:.2f} |"
        )
    lines += [
        "",
        "| batch | eager us | full graph us | bcg us | bcg / full | bcg / eager | bitwise |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | :--- |",
    ]
    for row in report["decoder"]["batches"]:
        us, ratios = row["us_per_step"], row["ratios"]
        same = "equal" if all(row["bitwise_equal"].values()) else str(row["bitwise_equal"])
        lines.append(
            f"| {row['batch']} | {us['eager']['median']:.1f} | {us['full_graph']['median']:.1f} "
            f"| {us['bcg']['median']:.1f} | {ratios['bcg_to_full_graph']['median']:.3f} "
            f"| {ratios['bcg_to_eager']['median']:.3f} | {same} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_core.json")
    parser.add_argument("--repeats", type=int, default=30, help="repeats per figure (>= 20)")
    parser.add_argument("--steps", type=int, default=50, help="decode steps per repeat (>= 50)")
    parser.add_argument(
        "--overhead-repeats", type=int, default=200, help="repeats of the break-overhead bursts"
    )
    args = parser.parse_args(argv)
    if args.repeats < 20 or args.steps < 50 or args.overhead_repeats < 20:
        parser.error("use --repeats >= 20, --steps >= 50 and --overhead-repeats >= 20")
    if not torch.cuda.is_available():
        print("bench_core needs a CUDA GPU; torch.cuda.is_available() is False", file=sys.stderr)
        return 2

    with torch.no_grad():
        environment = bench_environment()
        with _gc_off():
            overhead = bench_break_overhead(args.overhead_repeats)
            decoder = bench_decoder(args.repeats, args.steps)
    report = {"environment": environment, "break_overhead": overhead, "decoder": decoder}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_core.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
