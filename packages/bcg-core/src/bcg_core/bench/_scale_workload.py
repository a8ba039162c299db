"""The ``capture-scale`` workload: an engine's start-up at real scale, and what it leaves behind.

The bench decoder at Llama-3-8B dimensions (``scale_config``: 32 layers, hidden 4096, 32 heads,
8 KV heads, FFN 14336, vocabulary 128256, bfloat16; about 8 B parameters, random weights),
attention over a static KV cache of 512 positions as the break, is captured at 35 decode batch
sizes (:data:`SIZES`: 256, 248, ... 8 in steps of 8, then 4, 2, 1), largest first, two warm-ups
per size right before its capture, all into one pool, by each contender:

- ``full_graph``: plain ``torch.cuda.CUDAGraph`` per size (flag off: attention captured too),
  warm-ups and capture on one side stream, ``torch.cuda.graph(pool=...)`` (which empties the
  allocator's cache and synchronises at each capture, as torch does);
- ``bcg``: :class:`BreakableCUDAGraph` by hand, warm-ups inside ``graph.warmup()`` (on the
  capture lane, in the pool), then :class:`BreakableCUDAGraphCapture` into the shared pool;
- ``bcg-side-stream``: the same with warm-ups on a side stream, as torch's graph docs write
  them (what they free stays cached outside the pool: the memory the runner used to keep);
- ``bcg-record-only``: the same with ``faithful=False`` (segments are not launched at capture):
  the difference to ``bcg`` is what running the step during the capture costs;
- ``runner``: :meth:`BreakableGraphRunner.capture_many` (warm-ups on the pool's capture lane,
  routed into the pool, then the capture);
- ``breakable-cuda-graphs``: the peer package when installed (its API takes no pool).

Each contender starts up :data:`ROUNDS` times (at most ``--repeats``; once with ``--smoke``),
the contenders interleaved round by round: a start-up is one sample of seconds on a shared host
that moved single runs by a tenth. Times are medians over the rounds and ratios are taken per
round against plain graphs' same round (median, min and max); memory figures are the last
round's (they repeat to the MB).

Rows per contender (``x full graph`` is the ratio to plain graphs):

- ``start-up``: ``us/step`` is the whole start-up (warm-ups, captures) in us, ``capture ms``
  the capture blocks alone, ``pool MB`` the pool, ``correct``: replays bitwise equal to eager
  at :data:`CHECKED` (1, 64, 256);
- ``capture blocks``: the capture blocks alone (us), against plain graphs (goal: <= 1.3);
- ``reserved MB``: growth of ``torch.cuda.memory_reserved()`` over the start-up, read right
  after it (what an engine sees when it sizes its KV cache; goal: <= 1.10x plain graphs);
- ``device MB``: the same through ``torch.cuda.mem_get_info()`` (the driver's view);
- ``held MB``: the growth left after ``gc.collect()`` and ``torch.cuda.empty_cache()``: what the
  graphs really hold. ``reserved - held`` is free memory the allocator kept cached.

``details`` (JSON) break each contender's memory into its parts: the pool, static buffers and
bridges outside the pool (the runner's :meth:`~BreakableGraphRunner.graph_memory`), memory
cached outside the pool, and once per process the first capture lane (its stream's cuBLAS
workspace) and the warm-up stream's workspace, made before the baselines; the runner's per-size
report (capture and warm-up ms, segments, breaks, pool after). Between contenders every graph
is dropped and the cache emptied, so each starts from the same baseline.

``--smoke`` runs a 2-layer tiny decoder at two sizes on any device (on CPU: the bcg contenders on
the CPU backend, no memory figures).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    enable_breakable_cuda_graph,
)
from bcg_core.bench._harness import FULL_GRAPH, BenchContext, Measurement, Stats
from bcg_core.bench._toy_decoder import DecoderConfig, ToyDecoder, tiny_config
from bcg_core.bench._workloads import PEER, peer_attention, peer_module, peer_unavailable

WORKLOAD = "capture-scale"
SIZES = (*range(256, 7, -8), 4, 2, 1)
"""35 decode batch sizes, largest first: 256 down to 8 in steps of 8, then 4, 2, 1."""
CHECKED = (1, 64, 256)
SMOKE_SIZES = (2, 1)
WARMUPS = 2
ROUNDS = 3  # start-ups per contender, interleaved (at most --repeats)
RUNNER = "runner"
RECORD_ONLY = "bcg-record-only"
SIDE_STREAM = "bcg-side-stream"
CONTENDERS = (FULL_GRAPH, "bcg", SIDE_STREAM, RECORD_ONLY, RUNNER, PEER)
MB = 2**20

Inputs = tuple[torch.Tensor, torch.Tensor]


def scale_config(dtype: torch.dtype = torch.bfloat16) -> DecoderConfig:
    """The bench decoder at Llama-3-8B dimensions, context 512."""
    return DecoderConfig(
        vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336,
        max_context=512, dtype=dtype, rope_theta=500000.0,
    )  # fmt: skip


@dataclass
class _StartUp:
    """One contender's start-up: times, its replays (batch -> output), memory parts (bytes)."""

    total_s: float
    blocks_s: float
    replays: dict[int, Callable[[], torch.Tensor]]
    segments: int | None
    pool_bytes: int | None
    parts: dict[str, Any] = field(default_factory=dict)
    keep: list[Any] = field(default_factory=list)


_Measured = tuple[_StartUp, dict[str, float], bool]  # one start-up: figures, memory, correct


def capture_scale_workload(ctx: BenchContext) -> list[Measurement]:
    """Start-up of 35 batch sizes of an 8B-dims decoder per contender; see the module text."""
    cuda = ctx.device.type == "cuda"
    sizes: tuple[int, ...]
    checked: tuple[int, ...]
    if ctx.smoke:
        tiny = tiny_config(torch.bfloat16 if cuda else torch.float32)
        cfg = dataclasses.replace(tiny, layers=2, max_context=64)
        sizes, checked = SMOKE_SIZES, SMOKE_SIZES
    else:
        cfg, sizes, checked = scale_config(), SIZES, CHECKED
    case = f"{len(sizes)} batch sizes {sizes[-1]}-{sizes[0]}, {cfg.layers} layers"
    ctx.progress(f"{WORKLOAD}: building the model ({cfg.layers} layers, hidden {cfg.hidden})")
    with torch.no_grad():
        model = ToyDecoder(cfg, seed=0, device=ctx.device, draw_on_device=True)
        model.allocate_cache(max(sizes))
        inputs = {
            b: (
                torch.arange(b, device=ctx.device) % cfg.vocab,
                torch.full((b,), cfg.max_context - 1, device=ctx.device),
            )
            for b in sizes
        }
        expected = {b: model(*inputs[b]).clone() for b in checked}
        warm_stream = _new_stream() if cuda else None
        once = _prime(ctx, model, inputs[sizes[-1]], warm_stream) if cuda else {}
        makers: dict[str, Callable[[], _StartUp] | str] = {
            FULL_GRAPH: (lambda: _plain(model, inputs, warm_stream)) if cuda else "needs CUDA",
            "bcg": lambda: _by_hand(ctx, model, inputs, None, faithful=True),
            SIDE_STREAM: (lambda: _by_hand(ctx, model, inputs, warm_stream, faithful=True))
            if cuda
            else "needs CUDA (streams)",
            RECORD_ONLY: (lambda: _by_hand(ctx, model, inputs, None, faithful=False))
            if cuda
            else "CUDA only (the CPU backend executes what it records)",
            RUNNER: lambda: _runner(ctx, model, inputs),
        }
        peer = peer_module()
        makers[PEER] = (
            (lambda: _peer(peer, model, inputs, warm_stream))
            if peer is not None and cuda
            else peer_unavailable(peer)
        )
        results: dict[str, list[_Measured] | str] = {}  # start-ups, or why there are none
        for name in CONTENDERS:
            make = makers[name]
            skipped = "excluded by --skip" if name in ctx.skip else make
            results[name] = skipped if isinstance(skipped, str) else []
        rounds = 1 if ctx.smoke else max(1, min(ctx.repeats, ROUNDS))
        for r in range(rounds):  # interleaved: a slow stretch of the host hits every contender
            for name in CONTENDERS:
                done, make = results[name], makers[name]
                if isinstance(done, str) or isinstance(make, str):
                    continue  # skipped, unavailable, or failed in an earlier round
                ctx.progress(f"{WORKLOAD}: {name} (round {r + 1}/{rounds})")
                try:
                    done.append(_measured(ctx, make, expected))
                except Exception as exc:
                    results[name] = f"failed: {type(exc).__name__}: {exc}"[:160]
    return _rows(case, results, once)


def _measured(
    ctx: BenchContext, make: Callable[[], _StartUp], expected: dict[int, torch.Tensor]
) -> _Measured:
    """Run one start-up between memory readings; check its replays; drop its graphs."""
    cuda = ctx.device.type == "cuda"
    memory: dict[str, float] = {}
    if cuda:
        _settle()
        reserved, free = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
    run = make()
    if cuda:
        torch.cuda.synchronize()
        memory["reserved"] = torch.cuda.memory_reserved() - reserved
        memory["device"] = free - torch.cuda.mem_get_info()[0]
    # A size whose capture failed is served eagerly, which would pass the check: not correct.
    correct = not run.parts.get("failed") and all(
        bool(torch.equal(run.replays[b](), want)) for b, want in expected.items()
    )
    ctx.synchronize()
    if cuda:
        _settle()
        memory["held"] = torch.cuda.memory_reserved() - reserved
        memory["cached_outside_pool"] = memory["reserved"] - memory["held"]
    summary = (
        _StartUp(run.total_s, run.blocks_s, {}, run.segments, run.pool_bytes, run.parts),
        memory,
        correct,
    )
    del run
    if cuda:
        _settle()
    return summary


def _rows(
    case: str,
    results: dict[str, list[_Measured] | str],
    once: dict[str, float],
) -> list[Measurement]:
    base = results.get(FULL_GRAPH)
    plain = base if not isinstance(base, str) else None

    def ratio(values: list[float], of: list[float] | None) -> Stats | None:
        """Per round against plain graphs' same round (their median, min and max)."""
        if of is None or len(of) != len(values) or not all(of):
            return None
        return Stats.of([v / o for v, o in zip(values, of, strict=True)])

    out: list[Measurement] = []
    for name, result in results.items():
        if isinstance(result, str):
            out.append(Measurement(WORKLOAD, f"start-up: {case}", name, None, skipped=result))
            continue
        run, memory, _ = result[-1]  # memory figures: the last round (they repeat exactly)
        totals = [r[0].total_s for r in result]
        blocks = [r[0].blocks_s for r in result]
        correct = all(r[2] for r in result)
        pool_mb = None if run.pool_bytes is None else run.pool_bytes / MB
        details: dict[str, Any] = {
            "startup_s": statistics.median(totals),
            "capture_blocks_s": statistics.median(blocks),
            "startup_s_per_round": totals,
            "capture_blocks_s_per_round": blocks,
            "warmups": WARMUPS,
            **{f"{k}_mb": v / MB for k, v in memory.items()},
            **run.parts,
        }
        if name == FULL_GRAPH:
            details.update(once)
        p_totals = [r[0].total_s for r in plain] if plain is not None else None
        p_blocks = [r[0].blocks_s for r in plain] if plain is not None else None
        p_mem = plain[-1][1] if plain is not None else {}
        out.append(
            Measurement(
                WORKLOAD, f"start-up: {case}", name, Stats.of([t * 1e6 for t in totals]),
                capture_ms=statistics.median(blocks) * 1e3, pool_mb=pool_mb,
                segments=run.segments, correct=correct,
                ratio_to_full_graph=ratio(totals, p_totals), details=details,
            )
        )  # fmt: skip
        out.append(
            Measurement(
                WORKLOAD, "capture blocks", name, Stats.of([b * 1e6 for b in blocks]),
                ratio_to_full_graph=ratio(blocks, p_blocks),
            )
        )  # fmt: skip
        for key, label in (
            ("reserved", "reserved MB"),
            ("device", "device MB"),
            ("held", "held MB"),
        ):
            if key in memory:
                out.append(
                    Measurement(
                        WORKLOAD, label, name, None, pool_mb=memory[key] / MB,
                        ratio_to_full_graph=ratio(
                            [memory[key]], [p_mem[key]] if key in p_mem else None
                        ),
                    )
                )  # fmt: skip
    return out


# -- the contenders -------------------------------------------------------------------------


def _plain(
    model: ToyDecoder, inputs: dict[int, Inputs], stream: torch.cuda.Stream | None
) -> _StartUp:
    assert stream is not None
    pool = torch.cuda.graph_pool_handle()
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outs: dict[int, torch.Tensor] = {}
    blocks = 0.0
    started = time.perf_counter()
    for b, (tokens, positions) in inputs.items():
        with _on(stream):
            for _ in range(WARMUPS):
                model(tokens, positions)
        graphs[b] = torch.cuda.CUDAGraph()
        with _timed() as block, torch.cuda.graph(graphs[b], pool=pool, stream=stream):
            outs[b] = model(tokens, positions)
        blocks += block()
    torch.cuda.synchronize()
    total = time.perf_counter() - started
    return _StartUp(
        total, blocks, {b: _replaying(graphs[b].replay, outs[b]) for b in outs}, 1,
        _pool_bytes(pool), keep=[graphs],
    )  # fmt: skip


def _by_hand(
    ctx: BenchContext,
    model: ToyDecoder,
    inputs: dict[int, Inputs],
    stream: torch.cuda.Stream | None,
    *,
    faithful: bool,
) -> _StartUp:
    backend = ctx.device.type
    first = BreakableCUDAGraph(backend=backend)
    pool = first.pool()
    graphs: dict[int, BreakableCUDAGraph] = {}
    outs: dict[int, torch.Tensor] = {}
    blocks = 0.0
    started = time.perf_counter()
    with enable_breakable_cuda_graph():
        for b, (tokens, positions) in inputs.items():
            graph = first if not graphs else BreakableCUDAGraph(pool, backend=backend)
            # Without a side stream: in the graph's warm-up block (its lane, its pool).
            with _on(stream) if stream is not None else graph.warmup():
                for _ in range(WARMUPS):
                    model(tokens, positions)
            graphs[b] = graph
            with _timed(ctx) as block, BreakableCUDAGraphCapture(graph, faithful=faithful):
                outs[b] = model(tokens, positions)
            blocks += block()
    ctx.synchronize()
    total = time.perf_counter() - started
    pool_bytes = first.pool_bytes()
    return _StartUp(
        total, blocks, {b: _replaying(graphs[b].replay, outs[b]) for b in outs},
        first.num_segments, pool_bytes, {"pool_mb": _mb(pool_bytes)}, keep=[graphs],
    )  # fmt: skip


def _runner(ctx: BenchContext, model: ToyDecoder, inputs: dict[int, Inputs]) -> _StartUp:
    # One entry per size (the default max_entries, 8, would evict all but the last 8).
    runner = BreakableGraphRunner(
        model, device=ctx.device, warmup_iters=WARMUPS, max_entries=len(inputs)
    )
    started = time.perf_counter()
    report = runner.capture_many([(i, {}) for i in inputs.values()], order="given")
    ctx.synchronize()
    total = time.perf_counter() - started
    memory = report.memory
    sizes = list(inputs)
    parts: dict[str, Any] = {
        "pool_mb": _mb(memory.pool_bytes),
        "static_buffers_mb": memory.static_bytes / MB,
        "bridges_outside_pool_mb": memory.bridge_bytes / MB,
        "warmups_s": sum(e.warmup_ms for e in report.captured) / 1e3,
        "failed": [why for _, why in report.failed],
        "per_size": [
            {
                "batch": b, "capture_ms": e.capture_ms, "warmup_ms": e.warmup_ms,
                "segments": e.segments, "breaks": e.breaks, "pool_mb_after": _mb(e.pool_bytes),
            }
            for b, e in zip(sizes, report.captured, strict=False)
        ],
    }  # fmt: skip

    def replay(b: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            misses = runner.stats.misses
            out: torch.Tensor = runner(*inputs[b])
            if runner.stats.misses != misses:  # served eagerly: no graph was checked
                raise RuntimeError(f"the runner has no graph for batch {b}")
            return out

        return run

    return _StartUp(
        total, sum(e.capture_ms for e in report.captured) / 1e3,
        {b: replay(b) for b in inputs},
        report.captured[0].segments if report.captured else None, memory.pool_bytes, parts,
        keep=[runner],
    )  # fmt: skip


def _peer(
    peer: Any, model: ToyDecoder, inputs: dict[int, Inputs], stream: torch.cuda.Stream | None
) -> _StartUp:
    graphs: dict[int, Any] = {}
    outs: dict[int, torch.Tensor] = {}
    blocks = 0.0
    model.set_attention(peer_attention(peer))
    try:
        started = time.perf_counter()
        for b, (tokens, positions) in inputs.items():
            with _on(stream):
                for _ in range(WARMUPS):
                    model(tokens, positions)
            graphs[b] = peer.BreakableCUDAGraph()
            with _timed() as block, peer.breakable_graph(graphs[b]):
                outs[b] = model(tokens, positions)
            blocks += block()
        torch.cuda.synchronize()
        total = time.perf_counter() - started
    finally:
        model.set_attention(None)
    # The peer's graphs read the attention of their capture: replays need no switch back.
    return _StartUp(
        total, blocks, {b: _replaying(graphs[b].replay, outs[b]) for b in outs}, None, None,
        keep=[graphs],
    )  # fmt: skip


# -- helpers ----------------------------------------------------------------------------------


def _prime(
    ctx: BenchContext, model: ToyDecoder, inputs: Inputs, stream: torch.cuda.Stream | None
) -> dict[str, float]:
    """Make, before any baseline, what a process makes once: the warm-up stream's cuBLAS
    workspace and bcg's first capture lane (a stream and the pool of its workspace, reused by
    every later pool once the previous one is gone). Returns their sizes in MB."""
    _settle()
    reserved = torch.cuda.memory_reserved()
    with _on(stream):
        model(*inputs)
    _settle()
    stream_mb = (torch.cuda.memory_reserved() - reserved) / MB
    reserved = torch.cuda.memory_reserved()
    graph = BreakableCUDAGraph()
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        model(*inputs)
    del graph
    _settle()
    lane_mb = (torch.cuda.memory_reserved() - reserved) / MB
    return {"warmup_stream_workspace_mb": stream_mb, "first_capture_lane_mb": lane_mb}


def _settle() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _new_stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]


@contextmanager
def _on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the block on ``stream`` (CUDA), ordered after the current stream and before its
    next work, as torch's graph docs write warm-ups; on the CPU, as it is."""
    if stream is None:
        yield
        return
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield
    current.wait_stream(stream)


@contextmanager
def _timed(ctx: BenchContext | None = None) -> Iterator[Callable[[], float]]:
    """Seconds the block takes with the device synchronised around it; read after the block."""
    sync = torch.cuda.synchronize if ctx is None else ctx.synchronize
    sync()
    started = time.perf_counter()
    elapsed: list[float] = []
    yield lambda: elapsed[0]
    sync()
    elapsed.append(time.perf_counter() - started)


def _replaying(replay: Callable[[], object], out: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        replay()
        return out

    return run


def _pool_bytes(pool: Any) -> int:
    want = tuple(pool)
    snapshot: Callable[[], list[dict[str, Any]]] = torch.cuda.memory_snapshot
    segments = [s for s in snapshot() if tuple(s.get("segment_pool_id", ())) == want]
    return sum(int(s["total_size"]) for s in segments)


def _mb(n: int | None) -> float | None:
    return None if n is None else n / MB
