"""Is bcg host-bound or device-bound on the ``hf-llama`` decode step? (CUDA only)

``PYTHONPATH=packages/bcg-core/src python3 benchmarks/bench_host_vs_device.py``
(needs transformers; prints lines, writes nothing)

The ``hf-llama`` model of ``bcg bench`` (16 layers, hidden 1024, bf16, StaticCache of 1024,
``bcg_sdpa`` attention), batch 1 and 8. For the full CUDA graph, the bcg runner and eager:

- ``host-loop`` and ``total``: 50 steps back to back, the time until the host has issued them
  and until the device is done, per step, for 5 repeats (sorted by total). A host-loop close to
  the total means the host is the bound (or the launch queue is full);
- ``device with host ahead``: the device first sleeps about 50 ms so that the host queues the
  50 steps ahead of it; CUDA events then time the device alone. The ratio of these two figures
  (bcg / full graph) is what a host that is never the bound would see;
- a cProfile of 200 runner calls: where the host time of a replay goes.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time
from collections.abc import Callable

import torch
import transformers

from bcg_core import BreakableGraphRunner
from bcg_core.bench import _hf_llama  # noqa: PLC2701


def _loop(fn: Callable[[], object], steps: int = 50) -> tuple[float, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (issued - start) / steps * 1e6, (done - start) / steps * 1e6


def _device_time(fn: Callable[[], object], steps: int = 50) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # about 50 ms of device time: the host runs ahead
    begin.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / steps * 1e3


def main() -> None:
    model, context, batches = _hf_llama._llama(transformers, torch.device("cuda"), smoke=False)
    print("load average", os.getloadavg(), "cpus", os.cpu_count(), flush=True)
    with torch.no_grad():
        for batch in batches:
            step = _hf_llama._decode_step(transformers, model, batch, context)
            runner = BreakableGraphRunner(step, device="cuda", return_views=True)
            runner.capture()
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                step()
            contenders = {"full": graph.replay, "bcg": runner, "eager": step}
            for name, fn in contenders.items():
                for _ in range(5):
                    fn()
                runs = sorted((_loop(fn) for _ in range(5)), key=lambda r: r[1])
                shown = [(round(a), round(b)) for a, b in runs]
                print(f"b{batch} {name}: host-loop, total us/step: {shown}", flush=True)
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(200):
                runner()
            profile.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(8)
            print(text.getvalue(), flush=True)
            for name in ("full", "bcg"):
                device = _device_time(contenders[name])
                print(f"b{batch} {name}: device us/step with host ahead: {device:.0f}", flush=True)
            runner.reset()


if __name__ == "__main__":
    main()
