# ruff: noqa: PLC2701  (a probe builds the bench's own model and step)
"""GPU probe for issue 20: where a break's device time goes between compiled segments.

``python3 benchmarks/probe_break_gap.py [synthetic] [profile] [host] [backends]`` (sources on
PYTHONPATH, CUDA only; every part by default):

1. Synthetic, plain torch: 16 "layers" of small bf16 GEMVs around an sdpa decode kernel, the
   device time per step (the host queued far ahead behind a sleep kernel, so only the device
   counts) of one CUDA graph, and of the same work split into a graph per stretch between
   attention calls with, between them: nothing, the sdpa kernel eagerly, eagerly plus a copy
   into a bridge, or sdpa plus copy as a graph of its own. Differences per break tell what a
   graph boundary, an eager launch and the bridge copy each cost on the device.
2. The ``hf-llama`` bench step compiled (batch 1): ``compiled_graph`` and ``bcg+compile``
   (the runner over the compiled step) profiled with torch.profiler, per step: kernels, their
   busy time, the span, the idle time, and the kernel names that differ in count.
3. ``host``: at batch 1 and 8, each contender's device time with only 8 steps queued (so the
   launch queue never fills and blocks the host) beside its host time, and the host cost of a
   segment launch, a break's function, its bridge update and the kernel op its sdpa ends in.
4. ``backends``: bcg+compile against compiled_graph, interleaved, with torch's own sdpa backend
   choice (cuDNN attention on the H200) and with cuDNN attention off.
"""

from __future__ import annotations

import collections
import functools
import itertools
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

LAYERS, HIDDEN, HEADS, CONTEXT, PER_SIDE = 16, 1024, 16, 1024, 6
Step = Callable[[], object]


def queued_device_us(step: Step, steps: int = 30, rounds: int = 7) -> tuple[float, float]:
    """Device us per step (host queued ahead behind a sleep) and host us per step."""
    device_times, host_times = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000_000)  # ~100 ms: everything below is queued before it ends
        start.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        host = (time.perf_counter() - t0) * 1e6 / steps
        end.record()
        torch.cuda.synchronize()
        device_times.append(start.elapsed_time(end) * 1e3 / steps)
        host_times.append(host)
    return statistics.median(device_times), statistics.median(host_times)


def warmed_graph(fn: Step, pool: object, keep: bool = False) -> torch.cuda.CUDAGraph:
    """``fn`` run twice on a side stream, then captured into one torch graph in ``pool``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=keep)
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph


def synthetic() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    weights = [
        torch.randn(HIDDEN, HIDDEN, device=dev, dtype=dt, generator=g) / 32
        for _ in range(2 * PER_SIDE)
    ]
    x = torch.randn(1, HIDDEN, device=dev, dtype=dt, generator=g)
    q = torch.zeros(1, HEADS, 1, HIDDEN // HEADS, device=dev, dtype=dt)
    k = torch.randn(1, HEADS, CONTEXT, HIDDEN // HEADS, device=dev, dtype=dt, generator=g)
    v = torch.randn_like(k)
    bridge = torch.zeros(1, HEADS, 1, HIDDEN // HEADS, device=dev, dtype=dt)

    def pre() -> None:
        h = x
        for w in weights[:PER_SIDE]:
            h = torch.tanh(h @ w)
        q.copy_(h.view_as(q))

    def post() -> None:
        h = bridge.view(1, HIDDEN)
        for w in weights[PER_SIDE:]:
            h = torch.tanh(h @ w)
        x.copy_(h)

    def attention() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)

    def attention_bridged() -> None:
        bridge.copy_(attention())

    def whole() -> None:
        for _ in range(LAYERS):
            pre()
            attention_bridged()
            post()

    pool = torch.cuda.graph_pool_handle()
    graph_of = functools.partial(warmed_graph, pool=pool)

    full = graph_of(whole)
    full_no_copy_graph = graph_of(lambda: [(pre(), attention(), post()) for _ in range(LAYERS)])
    first = graph_of(pre)
    middle = [graph_of(lambda: (post(), pre())) for _ in range(LAYERS - 1)]
    last = graph_of(post)
    mini = [graph_of(attention_bridged) for _ in range(LAYERS)]
    segments = [first, *middle, last]

    def split(between: Callable[[int], object]) -> Step:
        def run() -> None:
            for i, seg in enumerate(segments):
                seg.replay()
                if i < LAYERS:
                    between(i)

        return run

    spare = torch.zeros_like(bridge)
    tiny = torch.zeros(16, device=dev)

    def kernel_copy() -> None:
        torch._foreach_copy_([bridge], [attention()])

    variants: dict[str, Step] = {
        "one graph": full.replay,
        "one graph, no bridge copy": full_no_copy_graph.replay,
        "split, nothing between": split(lambda i: None),
        "split, eager sdpa": split(lambda i: attention()),
        "split, eager sdpa + copy (bcg)": split(lambda i: attention_bridged()),
        "split, eager sdpa + _foreach_copy_": split(lambda i: kernel_copy()),
        "split, eager tiny kernel": split(lambda i: tiny.add_(1)),
        "split, eager memcpy DtoD": split(lambda i: bridge.copy_(spare)),
        "split, sdpa + copy as a graph": split(lambda i: mini[i].replay()),
        "eager, no graph": whole,
    }
    for fn in variants.values():
        fn()
    torch.cuda.synchronize()
    results = {name: queued_device_us(fn) for name, fn in variants.items()}
    base = results["one graph"][0]
    print(f"synthetic: {LAYERS} layers, {PER_SIDE} GEMV+tanh each side, sdpa over {CONTEXT}")
    for name, (device_us, host_us) in results.items():
        per_break = (device_us - base) / LAYERS
        print(
            f"  {name:34s} device {device_us:8.1f} us/step  host {host_us:8.1f}  "
            f"(+{per_break:5.2f} us per break over one graph)"
        )


def _profile_steps(step: Step, steps: int = 5) -> list[list[tuple[str, float, float]]]:
    """Per step: (kernel name, start us, duration us) for every device kernel, in order."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("probe.step"):
                step()
            torch.cuda.synchronize()
    events = prof.events()
    marks = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "probe.step")
    kernels = sorted(
        (e.time_range.start, e.time_range.end - e.time_range.start, e.name)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    per_step: list[list[tuple[str, float, float]]] = [[] for _ in marks]
    for start, duration, name in kernels:
        for i, (a, _) in enumerate(marks):
            nxt = marks[i + 1][0] if i + 1 < len(marks) else float("inf")
            if a <= start < nxt:
                per_step[i].append((name, start, duration))
                break
    return per_step


def _summarise(label: str, per_step: list[list[tuple[str, float, float]]]) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    rows = []
    for ks in per_step[1:]:  # the first profiled step warms the profiler
        if not ks:
            continue
        busy = sum(d for _, _, d in ks)
        span = ks[-1][1] + ks[-1][2] - ks[0][1]
        gaps = [b[1] - (a[1] + a[2]) for a, b in itertools.pairwise(ks)]
        rows.append((len(ks), busy, span, span - busy, statistics.median(gaps) if gaps else 0.0))
    if not rows:
        print(f"  {label}: no kernels recorded")
        return counts
    n, busy, span, idle, gap = (statistics.median(c) for c in zip(*rows, strict=True))
    print(
        f"  {label:16s} kernels {n:5.0f}  busy {busy:8.1f} us  span {span:8.1f}  "
        f"idle {idle:7.1f}  median gap {gap:5.2f}"
    )
    for name, _, _ in per_step[-1]:
        counts[name[:90]] += 1
    return counts


def _listing(label: str, ks: list[tuple[str, float, float]], count: int = 45) -> None:
    """The first ``count`` kernels of a step: gap before, duration, name."""
    print(f"  {label}: first {count} kernels of a step (gap before us, duration us, name)")
    for j, (name, start, duration) in enumerate(ks[:count]):
        gap = start - (ks[j - 1][1] + ks[j - 1][2]) if j else 0.0
        print(f"    {gap:7.2f} {duration:7.2f}  {name[:110]}")


def _compiled_graph(step: Step) -> tuple[Step, torch.cuda.CUDAGraph]:
    """``torch.compile(step)`` (default mode, ``fullgraph``), warmed up, and one plain CUDA
    graph of it (the bench's ``compiled_graph``)."""
    compiled = torch.compile(step, fullgraph=True)
    for _ in range(3):
        compiled()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # as the bench's graph contenders do
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled()
    return compiled, graph


def compiled_llama() -> None:
    import transformers

    from bcg_core import BreakableGraphRunner
    from bcg_core.bench._hf_llama import _decode_step, _llama

    model, context, _ = _llama(transformers, torch.device("cuda"), smoke=False)
    with torch.no_grad():
        step = _decode_step(transformers, model, 1, context)
        compiled, graph = _compiled_graph(step)
        runner = BreakableGraphRunner(compiled, device="cuda", return_views=True)
        runner.capture()
        (entry,) = runner._entries.values()
        contenders: dict[str, Step] = {
            "compiled_graph": graph.replay,
            "bcg+compile": runner,
            "its graph, hand": entry.graph.replay,
        }
        print("hf-llama batch 1, compiled, device us per step (host queued ahead):")
        for name, fn in contenders.items():
            device_us, host_us = queued_device_us(fn)
            print(f"  {name:16s} device {device_us:8.1f} us/step  host {host_us:8.1f}")
        print("profiled (5 steps, medians of the last 4):")
        profiles = {name: _profile_steps(fn) for name, fn in contenders.items()}
        counts = {name: _summarise(name, p) for name, p in profiles.items()}
        a, b = counts["compiled_graph"], counts["bcg+compile"]
        print("  kernel names whose count differs (compiled_graph -> bcg+compile):")
        for name in sorted(set(a) | set(b)):
            if a[name] != b[name]:
                print(f"    {a[name]:3d} -> {b[name]:3d}  {name}")
        for name in ("compiled_graph", "bcg+compile"):
            _listing(name, profiles[name][-1])
        # The bridge copies as copy kernels instead of DtoD memcpys (Tensor.copy_ of the
        # bridges, patched for the measurement only: nothing else calls it while replaying).
        plain_copy = torch.Tensor.copy_

        def as_kernel(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):
            torch._foreach_copy_([dst], [src])
            return dst

        torch.Tensor.copy_ = as_kernel  # type: ignore[method-assign]
        try:
            device_us, host_us = queued_device_us(runner)
            print(
                f"  bcg+compile, bridge copies as _foreach_copy_ kernels: device {device_us:8.1f}"
            )
            _listing("bcg+compile (kernel copies)", _profile_steps(runner)[-1], 25)
        finally:
            torch.Tensor.copy_ = plain_copy  # type: ignore[method-assign]
        device_us, _ = queued_device_us(runner)
        print(f"  bcg+compile again, memcpy copies: device {device_us:8.1f}")


def _host_us(fn: Step, calls: int = 200, every: int = 10) -> float:
    """Host us per call, the device synchronised every ``every`` calls (never a full queue)."""
    rounds = []
    for _ in range(calls // every):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(every):
            fn()
        rounds.append((time.perf_counter() - start) * 1e6 / every)
    torch.cuda.synchronize()
    return statistics.median(rounds)


class _KernelCall(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the fused attention kernel op an sdpa call ends in, with its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.call: tuple[object, tuple, dict] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if "scaled_dot_product" in str(func) and self.call is None:
            self.call = (func, args, kwargs)
        return func(*args, **kwargs)


def host_costs() -> None:
    """Whether bcg+compile is host-bound: a replay's host time against its device time, and
    the host cost of each piece of a break."""
    import transformers

    from bcg_core import BreakableGraphRunner
    from bcg_core._capture.graph import BreakStep, SegmentStep
    from bcg_core.bench._hf_llama import _decode_step, _llama

    model, context, _ = _llama(transformers, torch.device("cuda"), smoke=False)
    for batch in (1, 8):
        step = _decode_step(transformers, model, batch, context)
        compiled, graph = _compiled_graph(step)
        runners = {
            "bcg+compile": BreakableGraphRunner(compiled, device="cuda", return_views=True),
            "bcg (eager kernels)": BreakableGraphRunner(step, device="cuda", return_views=True),
        }
        print(f"hf-llama batch {batch}: device us per step (8 steps queued), host us per step")
        d, h = queued_device_us(graph.replay, steps=8)
        print(f"  {'compiled_graph':22s} device {d:8.1f}  host {h:8.1f}")
        for name, runner in runners.items():
            runner.capture()
            (entry,) = runner._entries.values()
            d, h = queued_device_us(entry.graph.replay, steps=8)
            print(
                f"  {name:22s} device {d:8.1f}  host {h:8.1f}  host per replay, device "
                f"synchronised every 10: {_host_us(entry.graph.replay):8.1f}"
            )
            steps = entry.graph._steps
            brk = next(s for s in steps if isinstance(s, BreakStep))
            seg = next(s for s in steps if isinstance(s, SegmentStep))
            fn = functools.partial(brk.fn, *brk.args, **brk.kwargs)
            pieces: dict[str, Step] = {
                "segment launch": seg.segment.launcher(),
                "break fn": fn,
                "break run (fn + bridge)": brk.run,
                "bridge update": functools.partial(brk.bridge.update, fn()),
            }
            if name == "bcg+compile":
                with _KernelCall() as rec:
                    fn()
                if rec.call is not None:
                    op, a, kw = rec.call
                    pieces[f"  its kernel op alone ({str(op)[:40]})"] = functools.partial(
                        op, *a, **kw
                    )
                    pieces["  torch._fused_sdp_choice"] = functools.partial(
                        torch._fused_sdp_choice, *brk.args, **brk.kwargs
                    )
            for label, piece in pieces.items():
                print(f"    {label:48s} {_host_us(piece, 400, 20):7.2f} us host")
            runner.reset()


def backends() -> None:
    """bcg+compile against compiled_graph with torch's default sdpa backend choice (cuDNN on
    the H200) and with cuDNN attention turned off (memory-efficient attention): device time
    per step, the two contenders interleaved round by round, ratio per round."""
    import transformers

    from bcg_core import BreakableGraphRunner
    from bcg_core.bench._hf_llama import _decode_step, _llama

    model, context, _ = _llama(transformers, torch.device("cuda"), smoke=False)
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for batch in (1, 8):
            torch._dynamo.reset()
            step = _decode_step(transformers, model, batch, context)
            compiled, graph = _compiled_graph(step)
            runner = BreakableGraphRunner(compiled, device="cuda", return_views=True)
            runner.capture()
            (entry,) = runner._entries.values()
            plain, ours = [], []
            for _ in range(9):
                plain.append(queued_device_us(graph.replay, steps=8, rounds=1)[0])
                ours.append(queued_device_us(entry.graph.replay, steps=8, rounds=1)[0])
            ratios = sorted(b / a for a, b in zip(plain, ours, strict=True))
            breaks = entry.graph.num_breaks
            print(
                f"sdpa {'default (cuDNN allowed)' if cudnn else 'cuDNN off'}, batch {batch}: "
                f"compiled_graph {statistics.median(plain):7.1f} us, bcg+compile "
                f"{statistics.median(ours):7.1f} us, ratio {statistics.median(ratios):.3f} "
                f"[{ratios[0]:.3f}-{ratios[-1]:.3f}], "
                f"{(statistics.median(ours) - statistics.median(plain)) / breaks:5.2f} us per "
                f"break ({breaks} breaks)"
            )
            runner.reset()
    torch.backends.cuda.enable_cudnn_sdp(True)


def main() -> None:
    if not torch.cuda.is_available():
        print("probe_break_gap: CUDA is not available")
        return
    parts = sys.argv[1:] or ["synthetic", "profile", "host", "backends"]
    torch.set_grad_enabled(False)
    if "synthetic" in parts:
        synthetic()
    for part, run in (("profile", compiled_llama), ("host", host_costs), ("backends", backends)):
        if part not in parts:
            continue
        try:
            run()
        except Exception as exc:  # a probe reports and ends
            print(f"{part} part failed: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
