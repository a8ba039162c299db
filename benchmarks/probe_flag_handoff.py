"""GPU probe for issue 20: can a break cost less than a graph boundary?

``python3 benchmarks/probe_flag_handoff.py`` (CUDA and cuda-bindings). The synthetic step of
``probe_segment_boundary.py`` (16 layers of bf16 GEMVs around a cuDNN sdpa decode kernel),
device time per step with the host queued ahead. Today a break ends one graph and starts the
next (17 launches for 16 breaks: about 2.4 us of device time per boundary). Here the whole step
is *one* graph: at each break the graph writes a flag and waits on another (stream memory
operations captured into the graph), while the break runs eagerly on a side stream that waits
for the first flag and writes the second when done (two ways to build that graph: captured in
one piece, or the captured segments composed after capture as child nodes of one graph with a
memory-operation node between each two, which a breakable capture could do without capturing
twice). The question is what that hand-off costs on the device against a graph boundary, and
whether the two streams make progress at all (the driver warns that such waits can deadlock
when the streams share a hardware queue: each variant runs once under a watchdog first; run it
again with ``CUDA_DEVICE_MAX_CONNECTIONS=32`` if one deadlocks).

Were it adopted, a break would have to keep a contract the boundary does not ask for: nothing
in it may wait for the whole device (``torch.cuda.synchronize()``, ``empty_cache()``, an
allocator retry that frees cached blocks), since the graph it would wait for is itself waiting
for the break; and a break that raises must still release every later wait of the graph.

Result (H100, torch 2.11, 2026-12-07, ``probe-flag-handoff-h100-2026-12-07-s23.log``): no
deadlock and bitwise equal to one graph, but an empty hand-off costs 9.7 us of device time
against 2.7 for an empty boundary, and a cuDNN break with its copy 13.4-17.3 us over one graph
against 4.5 for boundaries: breaks stay graph boundaries (core DESIGN.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
from probe_break_gap import queued_device_us
from probe_segment_boundary import LAYERS, Work, split
from torch.nn.attention import SDPBackend, sdpa_kernel

Step = Callable[[], object]


def driver():  # type: ignore[no-untyped-def]
    from cuda.bindings import driver as cu

    return cu


def check(result: tuple[object, ...], what: str) -> None:
    err = result[0]
    if int(err) != 0:  # type: ignore[call-overload]
        raise RuntimeError(f"{what}: {err}")


class Flags:
    """``2 * LAYERS`` int32 flags in device memory, each on its own 128-byte line."""

    def __init__(self) -> None:
        self.mem = torch.zeros(2 * LAYERS * 32, dtype=torch.int32, device="cuda")
        self.base = self.mem.data_ptr()

    def ready(self, i: int) -> int:
        return self.base + 128 * i

    def done(self, i: int) -> int:
        return self.base + 128 * (LAYERS + i)


def write(stream: int, addr: int, value: int) -> None:
    cu = driver()
    check(
        cu.cuStreamWriteValue32(
            cu.CUstream(stream),
            cu.CUdeviceptr(addr),
            value,
            cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT,
        ),
        "cuStreamWriteValue32",
    )


def wait(stream: int, addr: int, value: int) -> None:
    cu = driver()
    check(
        cu.cuStreamWaitValue32(
            cu.CUstream(stream),
            cu.CUdeviceptr(addr),
            value,
            cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ,
        ),
        "cuStreamWaitValue32",
    )


def graph_side(stream: int, flags: Flags, i: int) -> None:
    """The graph's side of break ``i``: write ready_i, wait for done_i, reset done_i."""
    write(stream, flags.ready(i), 1)
    wait(stream, flags.done(i), 1)
    write(stream, flags.done(i), 0)


def handoff_graph(w: Work, flags: Flags) -> torch.cuda.CUDAGraph:
    """One graph: layer i's ``pre``, then write ready_i, wait done_i, reset done_i, ``post``."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        w.pre()
        w.post()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph, pool=w.pool):
        s = torch.cuda.current_stream().cuda_stream
        for i in range(LAYERS):
            w.pre()
            graph_side(s, flags, i)
            w.post()
    return graph


def memop_graph(flags: Flags, i: int) -> object:
    """A captured graph of the three memory operations of break ``i`` (for a child node)."""
    from cuda.bindings import runtime as rt

    stream = torch.cuda.Stream()
    raw = rt.cudaStream_t(stream.cuda_stream)
    mode = rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
    check(rt.cudaStreamBeginCapture(raw, mode), "cudaStreamBeginCapture")
    graph_side(stream.cuda_stream, flags, i)
    err, graph = rt.cudaStreamEndCapture(raw)
    check((err,), "cudaStreamEndCapture")
    return graph


class Composed:
    """The captured segments (kept graphs) as child nodes of one graph, a memory-operation
    child node after each but the last: what a breakable graph could build after capture."""

    def __init__(self, segments: list[torch.cuda.CUDAGraph], flags: Flags) -> None:
        from cuda.bindings import runtime as rt

        self.rt = rt
        self.segments = segments  # their pool memory is what the child nodes address
        err, graph = rt.cudaGraphCreate(0)
        check((err,), "cudaGraphCreate")
        previous: list[object] = []
        self.children = []  # the mem-op graphs, alive while the composed graph is
        for i, seg in enumerate(segments):
            child = rt.cudaGraph_t(init_value=seg.raw_cuda_graph())
            err, node = rt.cudaGraphAddChildGraphNode(graph, previous, len(previous), child)
            check((err,), "cudaGraphAddChildGraphNode")
            previous = [node]
            if i < LAYERS:
                mem = memop_graph(flags, i)
                self.children.append(mem)
                err, node = rt.cudaGraphAddChildGraphNode(graph, previous, 1, mem)
                check((err,), "cudaGraphAddChildGraphNode (mem ops)")
                previous = [node]
        err, self.exe = rt.cudaGraphInstantiate(graph, 0)
        check((err,), "cudaGraphInstantiate")
        self.graph = graph

    def replay(self) -> None:
        stream = self.rt.cudaStream_t(torch.cuda.current_stream().cuda_stream)
        self.rt.cudaGraphLaunch(self.exe, stream)


def handoff_step(
    flags: Flags,
    graph: torch.cuda.CUDAGraph | Composed,
    side: torch.cuda.Stream,
    body: Step,
) -> Step:
    handle = side.cuda_stream

    def run() -> None:
        graph.replay()
        with torch.cuda.stream(side):
            for i in range(LAYERS):
                wait(handle, flags.ready(i), 1)
                write(handle, flags.ready(i), 0)
                body()
                write(handle, flags.done(i), 1)

    return run


def watched(step: Step, what: str, seconds: float = 10.0) -> bool:
    """Run ``step`` once; False (and the reason printed) if the device does not finish."""
    done = torch.cuda.Event()
    step()
    done.record()
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() > deadline:
            print(f"  {what}: DEADLOCK (not done after {seconds} s)", flush=True)
            return False
        time.sleep(0.001)
    return True


def main() -> None:
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', '(default)')}"
    )
    cu = driver()
    dev = torch.cuda.current_device()
    for attr in (
        "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR",
        "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
    ):
        value = cu.cuDeviceGetAttribute(getattr(cu.CUdevice_attribute, attr), dev)
        print(f"  {attr} = {value}")
    w = Work()
    flags = Flags()
    rows: dict[str, float] = {}
    hosts: dict[str, float] = {}

    def record(name: str, step: Step) -> None:
        if not watched(step, name):
            os._exit(3)  # a spinning wait cannot be cancelled: end the process
        device, host = queued_device_us(step)
        rows[name], hosts[name] = device, host
        print(f"  measured {name}: {device:.1f} us/step", flush=True)

    def attention_into_bridge() -> None:
        w.bridge.copy_(w.attention())

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):

        def whole_fn() -> None:
            for _ in range(LAYERS):
                w.pre()
                attention_into_bridge()
                w.post()

        whole = w.graph(whole_fn)
        segs = w.segments()
        nothing = w.graph(lambda: [(w.pre(), w.post()) for _ in range(LAYERS)])
        record("one graph, no attention", nothing.replay)
        record("one graph, cuDNN inside", whole.replay)
        record(
            "17 graphs, eager cuDNN + copy (bcg today)",
            split([g.replay for g in segs], attention_into_bridge),
        )
        record("17 graphs, nothing between", split([g.replay for g in segs], None))

        def measure_handoffs(
            what: str, graph: torch.cuda.CUDAGraph | Composed, side: torch.cuda.Stream, label: str
        ) -> None:
            record(
                f"{what} + hand-offs, nothing on the {label}",
                handoff_step(flags, graph, side, lambda: None),
            )
            record(
                f"{what} + hand-offs, eager cuDNN + copy on the {label}",
                handoff_step(flags, graph, side, attention_into_bridge),
            )

        def equal_to_whole(graph: torch.cuda.CUDAGraph | Composed) -> bool:
            """The same number of steps from the same start, both ways."""
            start = w.x.clone()
            for _ in range(3):
                whole.replay()
            ref = w.x.clone()
            w.x.copy_(start)
            step = handoff_step(flags, graph, torch.cuda.Stream(), attention_into_bridge)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            return torch.equal(ref, w.x)

        try:
            hand = handoff_graph(w, flags)
        except Exception as exc:  # a binding's TypeError too: report it, measure the rest
            print(f"  capturing stream memory operations failed: {exc!r}")
            hand = None
        if hand is not None:
            for label, side in (
                ("side stream", torch.cuda.Stream()),
                ("high-priority side stream", torch.cuda.Stream(priority=-1)),
            ):
                measure_handoffs("one graph", hand, side, label)
            print(f"  hand-off result equal to one graph: {equal_to_whole(hand)}")
        try:
            composed: Composed | None = Composed(w.segments(keep=True), flags)
        except Exception as exc:  # a binding's TypeError too: report it, measure the rest
            print(f"  composing the segments with memory-operation nodes failed: {exc!r}")
            composed = None
        if composed is not None:
            measure_handoffs("composed segments", composed, torch.cuda.Stream(), "side stream")
            print(f"  composed result equal to one graph: {equal_to_whole(composed)}")
    base = rows["one graph, no attention"]
    for name, us in rows.items():
        print(
            f"  {name:62s} device {us:8.1f} us/step ({(us - base) / LAYERS:+6.2f} us/layer)"
            f"  host {hosts[name]:7.1f} us/step"
        )
    limit = rows["one graph, cuDNN inside"]
    for name, us in rows.items():
        if "cuDNN" in name and name != "one graph, cuDNN inside":
            print(
                f"  {name:62s} {us / limit:.3f}x one graph, {(us - limit) / LAYERS:+.2f} us/break"
            )


if __name__ == "__main__":
    main()
