"""50-step denoise loop of the toy DiT: eager vs DiTRunner replay vs one full CUDA graph.

Run on a GPU machine (sources on PYTHONPATH, see tools/device_tests.sh):
    python3 benchmarks/bench_dit.py --out DIR
Writes DIR/bench_dit.json and prints a Markdown table. Ratios are computed within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bcg_core.bench import environment
from bcg_diffusion import DiTRunner
from bcg_diffusion._toy_dit import DiTConfig, DiTSelfAttention, ToyDiT  # noqa: PLC2701

STEPS = 50


def _time_loop(loop: Callable[[], torch.Tensor], repeats: int) -> dict[str, float]:
    for _ in range(2):
        loop()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        loop()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = DiTConfig(hidden=384, depth=12, heads=6, text_dim=256)
    model = ToyDiT(cfg).cuda().eval()
    latents0 = torch.randn(1, 4, 32, 32, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(1, 16, cfg.text_dim, device="cuda", dtype=torch.bfloat16)
    timesteps = [torch.full((1,), 1000.0 - 20 * i, device="cuda") for i in range(STEPS)]

    def denoise(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        x = latents0.clone()
        for t in timesteps:
            x = x - 0.02 * step(x, t)
        return x

    results: dict[str, Any] = {}
    with torch.no_grad():
        eager = _time_loop(lambda: denoise(lambda x, t: model(x, t, text)), args.repeats)
        ref = denoise(lambda x, t: model(x, t, text))

        # One full CUDA graph of the same model, attention captured too.
        static_x, static_t = latents0.clone(), timesteps[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(static_x, static_t, text)
        torch.cuda.current_stream().wait_stream(side)
        full_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(full_graph):
            static_out = model(static_x, static_t, text)

        def full_step(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            static_x.copy_(x)
            static_t.copy_(t)
            full_graph.replay()
            return static_out

        full = _time_loop(lambda: denoise(full_step), args.repeats)
        full_out = denoise(full_step)

        runner = DiTRunner(model, attention_classes=(DiTSelfAttention,))
        runner.capture(latents0, timesteps[0], text)
        bcg = _time_loop(lambda: denoise(lambda x, t: runner(x, t, text)), args.repeats)
        bcg_out = denoise(lambda x, t: runner(x, t, text))
        entry = runner.stats.entries[0]

    results = {
        **environment(),
        "config": {
            "hidden": cfg.hidden,
            "depth": cfg.depth,
            "latents": [1, 4, 32, 32],
            "text_tokens": 16,
            "steps": STEPS,
            "dtype": "bfloat16",
        },
        "eager": eager,
        "full_graph": full,
        "bcg_runner": bcg,
        "segments": entry.segments,
        "breaks": entry.breaks,
        "pool_bytes": entry.pool_bytes,
        "speedup_vs_eager": eager["median_s"] / bcg["median_s"],
        "ratio_to_full_graph": bcg["median_s"] / full["median_s"],
        "full_graph_speedup_vs_eager": eager["median_s"] / full["median_s"],
        "bcg_equals_eager": bool(torch.equal(bcg_out, ref)),
        "bcg_max_abs_diff_vs_eager": float((bcg_out.float() - ref.float()).abs().max()),
        "full_graph_equals_eager": bool(torch.equal(full_out, ref)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_dit.json").write_text(json.dumps(results, indent=2))
    print(f"\n## DiT denoise loop ({STEPS} steps), {results['gpu']}, torch {results['torch']}")
    print("| contender | median s/loop | min | max |")
    print("| --- | --- | --- | --- |")
    for key in ("eager", "full_graph", "bcg_runner"):
        r = results[key]
        print(f"| {key} | {r['median_s']:.4f} | {r['min_s']:.4f} | {r['max_s']:.4f} |")
    print(
        f"runner speedup vs eager {results['speedup_vs_eager']:.2f}x; runner / full graph "
        f"{results['ratio_to_full_graph']:.3f}; segments {entry.segments}, breaks {entry.breaks}; "
        f"bcg == eager: {results['bcg_equals_eager']} "
        f"(max abs diff {results['bcg_max_abs_diff_vs_eager']:.3g})"
    )


if __name__ == "__main__":
    main()
