"""GPU probe for issue 20: what one graph boundary costs on the device, and what lowers it.

``python3 benchmarks/probe_segment_boundary.py`` (CUDA only; cuda-bindings for the
instantiate-flag variants). The synthetic step of ``probe_break_gap.py`` (16 layers of bf16
GEMVs around an sdpa decode kernel), device time per step with the host queued far ahead:

- the same work as one graph with and without the attention, so that "17 graphs with nothing
  between" can be read against a graph of the same kernels (the boundary alone);
- the attention eagerly between segments and inside one graph, per sdpa backend (cuDNN, flash,
  memory-efficient): what taking each backend's kernels out of the graph costs;
- ways of launching the segments: torch's replay, instantiated by hand with the upload or
  device-launch flag, alternating two streams joined by events;
- a profile of each boundary form with the host queued ahead: the gap before the first kernel
  of each segment.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from probe_break_gap import queued_device_us, warmed_graph
from torch.nn.attention import SDPBackend, sdpa_kernel

LAYERS, HIDDEN, HEADS, CONTEXT, PER_SIDE = 16, 1024, 16, 1024, 6
Step = Callable[[], object]


class Work:
    def __init__(self) -> None:
        dev, dt = torch.device("cuda"), torch.bfloat16
        g = torch.Generator(device=dev).manual_seed(0)
        self.weights = [
            torch.randn(HIDDEN, HIDDEN, device=dev, dtype=dt, generator=g) / 32
            for _ in range(2 * PER_SIDE)
        ]
        self.x = torch.randn(1, HIDDEN, device=dev, dtype=dt, generator=g)
        self.q = torch.zeros(1, HEADS, 1, HIDDEN // HEADS, device=dev, dtype=dt)
        self.k = torch.randn(1, HEADS, CONTEXT, HIDDEN // HEADS, device=dev, dtype=dt, generator=g)
        self.v = torch.randn_like(self.k)
        self.bridge = torch.zeros_like(self.q)
        self.pool = torch.cuda.graph_pool_handle()

    def pre(self) -> None:
        h = self.x
        for w in self.weights[:PER_SIDE]:
            h = torch.tanh(h @ w)
        self.q.copy_(h.view_as(self.q))

    def post(self) -> None:
        h = self.bridge.view(1, HIDDEN)
        for w in self.weights[PER_SIDE:]:
            h = torch.tanh(h @ w)
        self.x.copy_(h)

    def attention(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.q, self.k, self.v)

    def graph(self, fn: Step, keep: bool = False) -> torch.cuda.CUDAGraph:
        return warmed_graph(fn, self.pool, keep)

    def segments(self, keep: bool = False) -> list[torch.cuda.CUDAGraph]:
        first = self.graph(self.pre, keep)
        middle = [self.graph(lambda: (self.post(), self.pre()), keep) for _ in range(LAYERS - 1)]
        return [first, *middle, self.graph(self.post, keep)]


def split(launches: list[Step], between: Step | None) -> Step:
    def run() -> None:
        for i, launch in enumerate(launches):
            launch()
            if between is not None and i < LAYERS:
                between()

    return run


def hand_instantiated(graphs: list[torch.cuda.CUDAGraph], flag_name: str) -> list[Step] | str:
    """Launches of the segments instantiated by cuda-bindings with one instantiate flag."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError as exc:
        return f"no cuda-bindings ({exc})"
    flag = getattr(rt.cudaGraphInstantiateFlags, flag_name)
    stream = rt.cudaStream_t(torch.cuda.current_stream().cuda_stream)
    launches: list[Step] = []
    for g in graphs:
        handle = rt.cudaGraph_t(init_value=g.raw_cuda_graph())
        err, exe = rt.cudaGraphInstantiateWithFlags(handle, int(flag))
        if int(err) != 0:
            return f"cudaGraphInstantiateWithFlags({flag_name}): {err}"
        (err,) = rt.cudaGraphUpload(exe, stream)
        if int(err) != 0:
            return f"cudaGraphUpload: {err}"
        launches.append(lambda exe=exe: rt.cudaGraphLaunch(exe, stream))  # keeps exe alive
    return launches


def two_streams(graphs: list[torch.cuda.CUDAGraph]) -> Step:
    main = torch.cuda.current_stream()
    other = torch.cuda.Stream()
    streams = [main, other]

    def run() -> None:
        other.wait_stream(main)
        for i, g in enumerate(graphs):
            s = streams[i % 2]
            s.wait_stream(streams[(i + 1) % 2])
            with torch.cuda.stream(s):
                g.replay()
        main.wait_stream(other)

    return run


def boundary_gaps(step: Step, steps: int = 4) -> str:
    """With the host queued ahead: median of each step's 16 largest gaps between kernels."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(100_000_000)
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and "sleep" not in e.name
    )
    gaps = sorted(b[0] - a[1] for a, b in itertools.pairwise(kernels))
    per_step = len(kernels) // steps
    big = gaps[-LAYERS * steps :]
    return (
        f"{per_step} kernels/step, median gap {statistics.median(gaps):.2f} us, "
        f"largest {LAYERS}/step median {statistics.median(big):.2f} us"
    )


def _device(step: Step) -> float:
    return queued_device_us(step)[0]


def main() -> None:
    w = Work()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"synthetic: {LAYERS} layers, {PER_SIDE} GEMV+tanh each side, sdpa over {CONTEXT}")

    def layers(with_attention: bool, backend: SDPBackend | None = None) -> Step:
        def run() -> None:
            for _ in range(LAYERS):
                w.pre()
                if with_attention:
                    w.bridge.copy_(w.attention())
                w.post()

        if backend is None:
            return run

        def in_backend() -> None:
            with sdpa_kernel(backend):
                run()

        return in_backend

    segs = w.segments()
    torch_launches: list[Step] = [g.replay for g in segs]
    no_attention = w.graph(layers(False))
    rows: dict[str, float] = {}
    rows["one graph, no attention"] = _device(no_attention.replay)
    rows["17 graphs, nothing between"] = _device(split(torch_launches, None))
    rows["17 graphs, eager tiny kernel"] = _device(split(torch_launches, lambda: w.bridge.add_(0)))
    rows["17 graphs, two streams"] = _device(two_streams(segs))
    kept = w.segments(keep=True)
    for flag in ("cudaGraphInstantiateFlagUpload", "cudaGraphInstantiateFlagDeviceLaunch"):
        launches = hand_instantiated(kept, flag)
        if isinstance(launches, str):
            print(f"  {flag}: {launches}")
            continue
        for launch in launches:
            launch()
        torch.cuda.synchronize()
        rows[f"17 graphs, {flag[len('cudaGraphInstantiateFlag') :]}"] = _device(
            split(launches, None)
        )
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        backend = getattr(SDPBackend, name)
        try:
            whole = w.graph(layers(True, backend))
        except RuntimeError as exc:
            print(f"  {name}: {str(exc).splitlines()[0][:120]}")
            continue

        def eager_bridged(backend: SDPBackend = backend) -> None:
            with sdpa_kernel(backend):
                w.bridge.copy_(w.attention())

        def eager_only(backend: SDPBackend = backend) -> None:
            with sdpa_kernel(backend):
                w.attention()

        rows[f"one graph, {name}"] = _device(whole.replay)
        rows[f"17 graphs, eager {name} + copy"] = _device(split(torch_launches, eager_bridged))
        rows[f"17 graphs, eager {name}"] = _device(split(torch_launches, eager_only))
    base = rows["one graph, no attention"]
    for name, us in rows.items():
        print(f"  {name:44s} device {us:8.1f} us/step  ({(us - base) / LAYERS:+6.2f} us per layer)")
    print("gaps, host queued ahead:")
    print(f"  one graph, no attention: {boundary_gaps(no_attention.replay)}")
    print(f"  17 graphs, nothing between: {boundary_gaps(split(torch_launches, None))}")
    print(f"  17 graphs, two streams: {boundary_gaps(two_streams(segs))}")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - t0:.1f} s")
