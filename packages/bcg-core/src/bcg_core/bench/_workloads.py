"""Workloads of ``bcg bench``: discovered through the ``bcg.workloads`` entry-point group.

A workload is a callable ``(BenchContext) -> list[Measurement]``. bcg-core registers the two
below; bcg-diffusion registers its DiT workload the same way, so core never imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
from collections.abc import Callable
from typing import Any

import torch

from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    eager_on_graph,
    enable_breakable_cuda_graph,
)
from bcg_core.bench._harness import EAGER, FULL_GRAPH, BenchContext, Contender, Measurement
from bcg_core.bench._toy_decoder import DecoderConfig, ToyDecoder, attention_core, tiny_config

WORKLOAD_GROUP = "bcg.workloads"
Workload = Callable[[BenchContext], list[Measurement]]

PEER = "breakable-cuda-graphs"
COMPILE = "torch.compile"
COMPILED_GRAPH = "compiled_graph"
BCG_COMPILE = "bcg+compile"


def discover() -> dict[str, Workload]:
    """Every installed workload by name (core's own first, then entry points)."""
    found: dict[str, Workload] = {
        "decoder": decoder_workload,
        "break-overhead": break_overhead,
        "hf-llama": _lazy("bcg_core.bench._hf_llama", "hf_llama_workload"),
        "capture": _lazy("bcg_core.bench._capture_workload", "capture_workload"),
        "memory": _lazy("bcg_core.bench._memory_workload", "memory_workload"),
        "capture-scale": _lazy("bcg_core.bench._scale_workload", "capture_scale_workload"),
        "serve": _lazy("bcg_core.bench._serve_workload", "serve_workload"),
    }
    for ep in importlib.metadata.entry_points(group=WORKLOAD_GROUP):
        if ep.name not in found:
            found[ep.name] = _plugin(ep)
    return found


def _plugin(ep: importlib.metadata.EntryPoint) -> Workload:
    """An entry point's workload, loaded when it runs. Loaded up front, one installed plugin
    that failed to import made every ``bcg bench`` a traceback; now only its own run is one
    row, skipped with the import error, next to the other workloads' figures."""

    def run(ctx: BenchContext) -> list[Measurement]:
        try:
            workload: Workload = ep.load()
        except Exception as exc:
            why = f"cannot load {ep.value}: {type(exc).__name__}: {exc}"
            return [Measurement(ep.name, "-", "-", None, skipped=why)]
        return workload(ctx)

    return run


def _lazy(module: str, name: str) -> Workload:
    """A workload imported only when it runs (its module may need an optional library)."""

    def run(ctx: BenchContext) -> list[Measurement]:
        workload: Workload = getattr(importlib.import_module(module), name)
        return workload(ctx)

    return run


def cli_decoder_config(dtype: torch.dtype = torch.bfloat16) -> DecoderConfig:
    """A decoder big enough to be launch-bound like a real one, small enough to build fast."""
    return DecoderConfig(
        vocab=32000, hidden=1024, layers=16, heads=16, kv_heads=8, ffn=2816,
        max_context=1024, dtype=dtype,
    )  # fmt: skip


def _warm(fn: Callable[[], object], device: torch.device, iters: int = 2) -> None:
    """Warm up on a side stream (CUDA) before a capture, as torch's graph docs ask."""
    if device.type != "cuda":
        for _ in range(iters):
            fn()
        return
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(iters):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)


Reference = torch.Tensor | Callable[[], torch.Tensor]


def runner_contender(
    ctx: BenchContext,
    runner: BreakableGraphRunner,
    step: Callable[[], torch.Tensor],
    *args: Any,
    **kwargs: Any,
) -> Contender:
    """The ``bcg`` contender of a runner-based workload.

    It calls ``runner.capture(*args, **kwargs)``, then every timed step is
    ``runner(*args, **kwargs)``; capture ms are the capture alone (warm-ups excluded, as for
    ``full_graph``), and after timing one more call must equal the eager ``step()`` bitwise.

    Args:
        ctx: the bench context.
        runner: a fresh :class:`~bcg_core.BreakableGraphRunner` wrapping the model.
        step: the eager step (the reference), which the contender also keeps alive.
        *args: positional arguments of the runner's call.
        **kwargs: keyword arguments of the runner's call.

    Returns:
        The ``"bcg"`` :class:`Contender`; skipped, with the blocked signature's reason, when
        the capture failed.
    """
    runner.capture(*args, **kwargs)
    if not runner.stats.entries:
        return Contender("bcg", None, skipped=f"capture failed: {runner.blocked_signatures}")
    entry = runner.stats.entries[0]

    def call() -> torch.Tensor:
        out: torch.Tensor = runner(*args, **kwargs)
        return out

    return Contender(
        "bcg",
        call,
        capture_ms=entry.capture_ms,
        pool_mb=None if entry.pool_bytes is None else entry.pool_bytes / 2**20,
        segments=entry.segments,
        keep_alive=step,
        check=replay_check(ctx, call, step),
    )


def replay_check(
    ctx: BenchContext,
    run: Callable[[], torch.Tensor],
    reference: Reference,
    *,
    prepare: Callable[[], None] | None = None,
) -> Callable[[], bool]:
    """A :attr:`Contender.check`: one more run must equal the eager output bitwise.

    Args:
        ctx: the bench context (its device is synchronised before comparing).
        run: one more replay, returning the contender's output.
        reference: the eager step (a callable, run at check time, after the timing) or a
            tensor (an eager output of the same inputs computed earlier).
        prepare: for steps with state (e.g. a counter they advance): run before the eager
            step and again before ``run``, so both start from the same state (default None).

    Returns:
        The check: a zero-argument callable returning whether the outputs are equal.
    """

    def check() -> bool:
        if callable(reference):
            if prepare is not None:
                prepare()
            expected = reference().clone()
        else:
            expected = reference
        if prepare is not None:
            prepare()
        got = run()
        ctx.synchronize()
        return _equal(got, expected)

    return check


def _replaying(replay: Callable[[], object], out: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        replay()
        return out

    return run


def full_graph_contender(
    ctx: BenchContext,
    step: Callable[[], torch.Tensor],
    reference: Reference,
    *,
    prepare: Callable[[], None] | None = None,
) -> Contender:
    """One plain ``torch.cuda.CUDAGraph`` of the whole step, checked after timing.

    CUDA only; the caller makes sure the step is fully capturable (e.g. with the flag off).
    The step is warmed up on a side stream, then captured; capture ms are the capture alone.

    Args:
        ctx: the bench context.
        step: the step to capture, returning its output tensor.
        reference: what the replay must equal (see :func:`replay_check`).
        prepare: resets the step's state before each side of the check (default None).

    Returns:
        The ``FULL_GRAPH`` :class:`Contender`; skipped when the device is not CUDA.
    """
    device = ctx.device
    if device.type != "cuda":
        return Contender(FULL_GRAPH, None, skipped="needs CUDA")
    _warm(step, device)
    # torch's capture stream is shared by every plain graph of the process: cleared of cuBLAS
    # workspaces (the warm-ups ran elsewhere), it makes one inside this graph's pool, which
    # lives as long as the graph. Otherwise the graph bakes one an earlier graph made, which
    # torch.compile's clears free once that graph is gone: an illegal address at replay.
    torch._C._cuda_clearCublasWorkspaces()
    graph = torch.cuda.CUDAGraph()

    def capture() -> torch.Tensor:
        with torch.cuda.graph(graph):
            return step()

    out, ms = ctx.timed(capture)
    graph.replay()
    assert isinstance(out, torch.Tensor)
    return Contender(
        FULL_GRAPH,
        graph.replay,
        capture_ms=ms,
        segments=1,
        keep_alive=step,
        check=replay_check(ctx, _replaying(graph.replay, out), reference, prepare=prepare),
    )


def bcg_contender(
    ctx: BenchContext,
    step: Callable[[], torch.Tensor],
    reference: Reference,
    *,
    prepare: Callable[[], None] | None = None,
) -> Contender:
    """A breakable graph of the step with the flag on (breaks at the model's break points),
    checked after timing against ``reference`` (see :func:`replay_check`)."""
    device = ctx.device
    graph = BreakableCUDAGraph(backend=device.type)
    with enable_breakable_cuda_graph():
        _warm(step, device)

        def capture() -> torch.Tensor:
            with BreakableCUDAGraphCapture(graph):
                return step()

        out, ms = ctx.timed(capture)
    graph.replay()
    assert isinstance(out, torch.Tensor)
    pool = graph.pool_bytes()
    return Contender(
        "bcg",
        graph.replay,
        capture_ms=ms,
        pool_mb=None if pool is None else pool / 2**20,
        segments=graph.num_segments,
        keep_alive=step,
        check=replay_check(ctx, _replaying(graph.replay, out), reference, prepare=prepare),
    )


def compile_contender(
    ctx: BenchContext,
    step: Callable[[], torch.Tensor],
    reference: Reference,
    exact: Callable[[], torch.Tensor],
) -> Contender:
    """The ``torch.compile(mode="reduce-overhead")`` contender of the step.

    The caller makes the break a graph break. CUDA only, and not in ``--smoke`` (compiling takes
    minutes on small hosts).

    Inductor fuses and reorders low-precision arithmetic, so it is not checked bitwise:
    ``exact()`` runs the same model in float32, and after timing the contender's next output is
    correct when its error against that is at most twice eager's (``reference``, a tensor or the
    eager step). ``exact`` is only called when the contender runs. Its capture ms are the three
    calls that compile and record it.

    Args:
        ctx: the bench context.
        step: the step to compile, returning its output tensor.
        reference: eager's output, a tensor or the eager step.
        exact: a zero-argument callable that runs the same model in float32.

    Returns:
        The ``"torch.compile"`` :class:`Contender`; skipped off CUDA or under ``--smoke``.
    """
    if ctx.device.type != "cuda" or ctx.smoke:
        return Contender(COMPILE, None, skipped="needs CUDA and a full run (not --smoke)")
    graphs = _dynamo_graphs(step)
    if graphs != 1:  # a fair torch.compile is one graph: no bcg patch or break in the step
        return Contender(COMPILE, None, skipped=f"the step traces to {graphs} dynamo graphs")
    compiled = torch.compile(step, mode="reduce-overhead")
    # Its "capture" is compiling plus cudagraph-trees recording: the three calls it takes.
    _, ms = ctx.timed(lambda: [compiled() for _ in range(3)][-1])
    ctx.synchronize()
    truth = exact().clone()

    def check() -> bool:
        eager = reference() if callable(reference) else reference
        eager_error = _max_error(eager, truth)
        out = compiled()
        ctx.synchronize()
        return _max_error(out, truth) <= 2 * eager_error + 1e-6

    return Contender(COMPILE, compiled, capture_ms=ms, check=check)


def _dynamo_graphs(step: Callable[[], torch.Tensor]) -> int:
    """How many graphs dynamo cuts the step into (runs the step once, uncompiled kernels)."""
    # explain resets dynamo before and after: call it before compiling anything the timing uses
    graphs: int = torch._dynamo.explain(step)().graph_count
    return graphs


def _compiled_only(ctx: BenchContext, name: str) -> Contender | None:
    if ctx.device.type != "cuda" or ctx.smoke:
        return Contender(name, None, skipped="needs CUDA and a full run (not --smoke)")
    return None


Exact = tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]] | None
COMPILED_RUNS = 5  # compiled-step calls a compiled contender's check compares against


def compiled_check(
    ctx: BenchContext,
    name: str,
    run: Callable[[], torch.Tensor],
    compiled: Callable[[], torch.Tensor],
    exact: Exact = None,
) -> Callable[[], bool]:
    """A :attr:`Contender.check` for a graph of compiled code: bitwise against the compiled step
    run without a graph, unless that step does not reproduce itself.

    Inductor's code is not always bitwise reproducible: on the H200 (torch 2.11) the
    ``hf-llama`` step compiled at batch 8 gave one of two results, 0.0156 apart, in plain calls
    with no graph (three of five calls differed from the first one:
    ``benchmarks/probe_compiled_bits.py``), so two calls may agree by chance. The check runs
    the compiled step :data:`COMPILED_RUNS` times and then ``run()`` once: the replay is right
    when it equals one of those results bitwise; wrong when it equals none and they all agree
    (the step looked reproducible); otherwise it is held to torch.compile's tolerance (its
    error against the float32 step at most twice eager's, with ``exact`` = ``(eager step,
    float32 step)``; without ``exact``, it fails). What was applied is logged.
    """

    def check() -> bool:
        runs = [compiled().clone() for _ in range(COMPILED_RUNS)]
        got = run()
        ctx.synchronize()
        if any(_equal(got, r) for r in runs):
            return True
        spread = max(_max_error(runs[0], r) for r in runs[1:])
        if spread == 0:
            ctx.progress(f"{name}: differs from the compiled step, which reproduced itself")
            return False
        if exact is None:
            ctx.progress(f"{name}: the compiled step differs from itself by {spread:.3g}")
            return False
        eager, truth = (f().clone() for f in exact)
        bound = 2 * _max_error(eager, truth) + 1e-6
        error = _max_error(got, truth)
        ctx.progress(
            f"{name}: the compiled step differs from itself by {spread:.3g} and the replay "
            f"equals none of its {COMPILED_RUNS} results, so checked against float32: error "
            f"{error:.3g}, bound {bound:.3g}"
        )
        return error <= bound

    return check


def compiled_graph_contender(
    ctx: BenchContext, step: Callable[[], torch.Tensor], exact: Exact = None
) -> Contender:
    """The limit for compiled kernels: ``torch.compile(step)`` in one plain CUDA graph.

    Default mode, ``fullgraph``; its breaks, with the flag off, run inside it. Checked against
    the compiled step run without a graph (:func:`compiled_check`); capture ms are the compile
    (warm-ups) plus the capture.

    Args:
        ctx: the bench context.
        step: the step to compile and capture, returning its output tensor.
        exact: ``(eager step, float32 step)``, for the check's tolerance (see
            :func:`compiled_check`); default None.

    Returns:
        The ``compiled_graph`` contender (skipped without CUDA and in ``--smoke``).
    """
    skipped = _compiled_only(ctx, COMPILED_GRAPH)
    if skipped is not None:
        return skipped
    compiled = torch.compile(step, fullgraph=True)
    graph = torch.cuda.CUDAGraph()

    def build() -> torch.Tensor:
        _warm(compiled, ctx.device, iters=3)
        torch._C._cuda_clearCublasWorkspaces()  # see full_graph_contender
        with torch.cuda.graph(graph):
            out: torch.Tensor = compiled()
        return out

    out, ms = ctx.timed(build)
    graph.replay()
    assert isinstance(out, torch.Tensor)
    return Contender(
        COMPILED_GRAPH,
        graph.replay,
        capture_ms=ms,
        segments=1,
        keep_alive=(step, compiled),
        check=compiled_check(ctx, COMPILED_GRAPH, _replaying(graph.replay, out), compiled, exact),
    )


def bcg_compile_contender(
    ctx: BenchContext,
    step: Callable[[], torch.Tensor],
    exact: Exact = None,
    **runner_options: Any,
) -> Contender:
    """bcg over compiled kernels: a runner over ``torch.compile(step)``.

    Default mode, ``fullgraph``; the breaks stay breaks (opaque ops). Checked against the
    compiled step run without a graph (:func:`compiled_check`); capture ms are the compile (the
    runner's warm-ups) plus the capture.

    Args:
        ctx: the bench context.
        step: the step to compile, returning its output tensor.
        exact: ``(eager step, float32 step)``, for the check's tolerance (see
            :func:`compiled_check`); default None.
        **runner_options: passed to :class:`bcg_core.BreakableGraphRunner`.

    Returns:
        The ``bcg+compile`` contender (skipped without CUDA and in ``--smoke``).
    """
    skipped = _compiled_only(ctx, BCG_COMPILE)
    if skipped is not None:
        return skipped
    compiled = torch.compile(step, fullgraph=True)
    runner = BreakableGraphRunner(compiled, device=ctx.device, return_views=True, **runner_options)
    _, ms = ctx.timed(runner.capture)
    if not runner.stats.entries:
        return Contender(BCG_COMPILE, None, skipped=f"capture failed: {runner.blocked_signatures}")
    entry = runner.stats.entries[0]

    def call() -> torch.Tensor:
        out: torch.Tensor = runner()
        return out

    return Contender(
        BCG_COMPILE,
        call,
        capture_ms=ms,
        pool_mb=None if entry.pool_bytes is None else entry.pool_bytes / 2**20,
        segments=entry.segments,
        keep_alive=(step, compiled, runner),
        check=compiled_check(ctx, BCG_COMPILE, call, compiled, exact),
    )


def _max_error(a: torch.Tensor, exact: torch.Tensor) -> float:
    return float((a.float() - exact.float()).abs().max())


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.float(), b.float()))


def peer_module() -> Any:
    try:
        import breakable_cuda_graphs  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None
    return breakable_cuda_graphs


def decoder_workload(ctx: BenchContext) -> list[Measurement]:
    """Decode steps of the toy decoder (attention is the break), batch 1, 8 and 32."""
    cuda = ctx.device.type == "cuda"
    if ctx.smoke:
        cfg = tiny_config(torch.bfloat16 if cuda else torch.float32)
        batches: tuple[int, ...] = (1, 2)
    else:
        cfg = cli_decoder_config()
        batches = (1, 8, 32)
    # Contenders that route attention differently get their own (identical) model, so a
    # routing change never invalidates another contender's capture or compiled code.
    model, compiled_model, peer_model = (ToyDecoder(cfg, seed=0, device=ctx.device) for _ in "abc")
    compiled_model.set_attention(torch.compiler.disable(attention_core))  # type: ignore[no-untyped-call]

    @functools.cache
    def exact_model() -> ToyDecoder:
        """The same weights in float32, built once and only if torch.compile runs."""
        return ToyDecoder(dataclasses.replace(cfg, dtype=torch.float32), seed=0, device=ctx.device)

    out: list[Measurement] = []
    for batch in batches:
        out += _decoder_case(ctx, model, compiled_model, peer_model, exact_model, batch)
    return out


def _decoder_case(
    ctx: BenchContext,
    model: ToyDecoder,
    compiled_model: ToyDecoder,
    peer_model: ToyDecoder,
    exact_model: Callable[[], ToyDecoder],
    batch: int,
) -> list[Measurement]:
    ctx.progress(f"decoder batch={batch}: building contenders")
    with torch.no_grad():
        step = decode_step(model, batch)
        exact = (step, lambda: decode_step(exact_model(), batch)())
        # torch.compile last: with the peer captured after its cudagraph trees had recorded,
        # one H200 run hit an illegal address while timing (each of the two alone ran clean).
        contenders = [
            Contender(EAGER, step),
            ctx.build(FULL_GRAPH, lambda: full_graph_contender(ctx, step, step)),
            ctx.build("bcg", lambda: bcg_contender(ctx, step, step)),
            ctx.build(
                PEER,
                lambda: _peer_decoder(ctx, peer_model, decode_step(peer_model, batch), step),
            ),
            ctx.build(
                COMPILE,
                lambda: compile_contender(
                    ctx,
                    decode_step(compiled_model, batch),
                    step,
                    lambda: decode_step(exact_model(), batch)(),
                ),
            ),
            ctx.build(COMPILED_GRAPH, lambda: compiled_graph_contender(ctx, step, exact)),
            ctx.build(BCG_COMPILE, lambda: bcg_compile_contender(ctx, step, exact)),
        ]
        return ctx.compare("decoder", f"batch={batch}", contenders)


def decode_step(model: ToyDecoder, batch: int) -> Callable[[], torch.Tensor]:
    """A decode step of ``batch`` sequences attending over the whole cache (fresh caches)."""
    cfg = model.config
    device = model.embed_weight.device
    model.allocate_cache(batch)
    tokens = torch.arange(batch, device=device) % cfg.vocab
    positions = torch.full((batch,), cfg.max_context - 1, device=device)

    def step() -> torch.Tensor:
        logits: torch.Tensor = model(tokens, positions)
        return logits

    return step


def _peer_decoder(
    ctx: BenchContext, model: ToyDecoder, step: Callable[[], torch.Tensor], ref: Reference
) -> Contender:
    peer = peer_module()
    if peer is None or ctx.device.type != "cuda":
        return Contender(PEER, None, skipped=peer_unavailable(peer))
    model.set_attention(peer_attention(peer))
    graph = peer.BreakableCUDAGraph()
    _warm(step, ctx.device)

    def capture() -> torch.Tensor:
        with peer.breakable_graph(graph):
            return step()

    result, ms = ctx.timed(capture)
    graph.replay()
    assert isinstance(result, torch.Tensor)
    return Contender(
        PEER,
        graph.replay,
        capture_ms=ms,
        keep_alive=step,
        check=replay_check(ctx, _replaying(graph.replay, result), ref),
    )


def peer_unavailable(peer: Any) -> str:
    """Why the peer contender is skipped on this machine."""
    return "needs CUDA" if peer is not None else f"not installed (pip install {PEER})"


def peer_attention(peer: Any) -> Callable[..., torch.Tensor]:
    """The toy decoder's attention as a break of the peer package (see ``set_attention``)."""

    # The peer's breaks may not return CUDA tensors: attention writes into a graph buffer.
    @peer.no_graph  # type: ignore[untyped-decorator,unused-ignore]
    def attention_into(out: torch.Tensor, *args: torch.Tensor) -> None:
        out.copy_(attention_core(*args))

    def attention(*args: torch.Tensor) -> torch.Tensor:
        q = args[0]
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], device=q.device, dtype=q.dtype)
        attention_into(out, *args)
        return out

    return attention


def break_overhead(ctx: BenchContext) -> list[Measurement]:
    """K one-kernel segments split by K no-op breaks: bcg against K+1 raw graph launches."""
    k = 8 if ctx.smoke else 64
    x = torch.zeros(16, device=ctx.device)

    def noop() -> None:
        return None

    brk = eager_on_graph(name="noop")(noop)

    def with_breaks() -> torch.Tensor:
        for _ in range(k):
            x.add_(1)
            brk()
        return x.add_(1)

    def kernels_only() -> torch.Tensor:
        for _ in range(k):
            x.add_(1)
        return x.add_(1)

    def restart() -> None:
        x.zero_()

    # x counts up at every step, so each check starts eager and the replay from zero.
    contenders = [Contender(EAGER, with_breaks)]
    if ctx.device.type == "cuda":
        contenders.append(
            ctx.build(
                FULL_GRAPH,
                lambda: full_graph_contender(ctx, kernels_only, with_breaks, prepare=restart),
            )
        )
        raw = []
        _warm(lambda: x.add_(1), ctx.device)

        def capture_raw() -> None:
            for _ in range(k + 1):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    x.add_(1)
                raw.append(g.replay)

        _, raw_ms = ctx.timed(capture_raw)

        def raw_launches() -> None:
            for launch in raw:
                launch()

        contenders.append(
            Contender(
                "raw_launches",
                raw_launches,
                capture_ms=raw_ms,
                segments=k + 1,
                check=replay_check(ctx, _replaying(raw_launches, x), with_breaks, prepare=restart),
            )
        )
    else:
        contenders.append(Contender(FULL_GRAPH, None, skipped="needs CUDA"))
    contenders.append(
        ctx.build("bcg", lambda: bcg_contender(ctx, with_breaks, with_breaks, prepare=restart))
    )
    return ctx.compare("break-overhead", f"breaks={k}", contenders)
