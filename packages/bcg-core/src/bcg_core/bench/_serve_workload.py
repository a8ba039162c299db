"""The ``serve`` workload: transformers' continuous batching engine serving 64 requests.

64 requests, prompt lengths 16-1024 and output lengths 32-128 tokens (seeded), greedy, all
submitted at once to one ``ContinuousBatchingManager`` (transformers 5.17, ``paged|sdpa``, the
KV cache sized explicitly: 256-token blocks, enough for every request at once, 2048 tokens per
batch). Models: a Llama of the ``hf-llama`` size (16 layers, hidden 1024) in float32 and one at
Llama-3-8B dims (32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocabulary 128256,
CUDA only) in bf16, random weights (nothing downloaded). Graphs run the projections on the
query bucket's padded rows, where cuBLAS may pick other kernels than for eager's row count: in
float32 that cannot move a greedy choice of random weights in practice, in bf16 it can (random
weights give near-ties), so the float32 case is the exactness check and the bf16 one reports
how many tokens agree (``tokens equal %``).

Contenders: ``eager`` (the engine without graphs), ``transformers graphs`` (the engine's own
CUDA graphs with its default padding: queries to 64-token buckets, the KV read to 16384-token
buckets, one graph per (query, KV) key) and ``bcg``
(:func:`bcg_core.enable_continuous_batching`: one graph per recurring query bucket, paged
attention as the break, no KV padding) and ``bcg varlen`` (the same with torch's
``varlen_attn`` as the break's kernel: no dense mask over the packed batch), and ``eager
varlen`` (bcg's varlen integration with graphs disabled, ``BCG_DISABLE=1``: the engine eager
with the same kernel on the same query-padded batches, which is the reference ``bcg varlen``
must equal token for token, in every dtype). Each contender runs the whole workload in its own
manager, twice, interleaved.

Columns: ``us/step`` is wall time per generated token (first submission to last finish, divided
by every request's output tokens), ``x eager`` and ``x full graph`` (against transformers'
graphs) its ratios; ``capture ms`` is start-up (manager creation and warm-up, which captures
the largest graph); ``pool MB`` is graph memory: what the engine holds (``memory_reserved()``
with every request done, minus the same once the engine and its graphs are gone, both
collected and the cache emptied: what earlier runs left reserved in the process cancels out)
minus what the same engine holds without graphs (eager's; for ``bcg varlen``, eager varlen's:
the varlen engine holds a few hundred MB more than the paged one with no graph at all;
``engine held MB`` in the figures); ``segments`` is the number of graphs captured. The
``figures`` column adds output tokens/s, time to first token (median, p90, ms) and, for the
graph contenders, ``pool MB counted``: the graphs' pool alone, counted the same way for both
(what the allocator newly reserves while the graphs capture and warm up into their pool,
which never gives memory back: bcg's ``ContinuousBatchingStats.graph_bytes``; for
transformers, the growth across each ``ModelRunner._capture_graph``), free of what the
ordinary allocator keeps reserved after ``empty_cache()`` from fragmentation, which moves
``pool MB`` by a few hundred MB at 8B (eager runs of the varlen engine, no graph at all, show
+288 and +384 MB). ``correct``:
every request's tokens identical to eager's (float32 cases only; bf16 leaves it blank and the
figures say how many tokens agree); for ``bcg varlen``, identical to ``eager varlen``'s.
``--smoke``: a tiny model and 8 short requests on the CPU (transformers' graphs need CUDA);
skipped with the reason without transformers.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

import bcg_core
from bcg_core.bench._harness import EAGER, BenchContext, Measurement, Stats

WORKLOAD = "serve"
TF_GRAPHS = "transformers graphs"
BCG_VARLEN = "bcg varlen"
EAGER_VARLEN = "eager varlen"
CONTENDERS = (EAGER, TF_GRAPHS, "bcg", EAGER_VARLEN, BCG_VARLEN)
CUDA_ONLY = (TF_GRAPHS, EAGER_VARLEN, BCG_VARLEN)
VARLEN = (EAGER_VARLEN, BCG_VARLEN)
REQUESTS = 64
BLOCK = 256
BATCH_TOKENS = 2048


@dataclass
class _Run:
    """One contender serving the workload once."""

    tokens: dict[int, list[int]]
    seconds: float
    ttft_ms: list[float]
    startup_ms: float
    held: int | None  # reserved with the engine alive minus after it is gone (both collected)
    graphs: int | None
    pool_bytes: int | None = None  # bcg's own count of its pool (ContinuousBatchingStats)


def serve_workload(ctx: BenchContext) -> list[Measurement]:
    try:
        import transformers
    except ImportError:
        why = 'transformers is not installed (pip install "bcg-core[transformers]")'
        return [Measurement(WORKLOAD, "-", c, None, skipped=why) for c in CONTENDERS]
    out: list[Measurement] = []
    for case, config, dtype in _configs(transformers, ctx.smoke, ctx.device):
        out += _case(ctx, transformers, case, config, dtype)
    return out


def _configs(
    transformers: Any, smoke: bool, device: torch.device
) -> list[tuple[str, Any, torch.dtype]]:
    if smoke:
        tiny = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
        )  # fmt: skip
        return [("tiny, 8 requests", tiny, torch.float32)]
    hf_llama = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    llama_8b = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096,
    )  # fmt: skip
    cases = [(f"hf-llama size fp32, {REQUESTS} requests", hf_llama, torch.float32)]
    if device.type == "cuda":
        cases.append((f"8B bf16, {REQUESTS} requests", llama_8b, torch.bfloat16))
    return cases


def _requests(smoke: bool, vocab: int) -> list[tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(0)
    count, prompt, new = (8, (4, 24), (4, 8)) if smoke else (REQUESTS, (16, 1024), (32, 128))
    out = []
    for _ in range(count):
        n = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=gen))
        m = int(torch.randint(new[0], new[1] + 1, (1,), generator=gen))
        out.append((torch.randint(0, vocab, (n,), generator=gen).tolist(), m))
    return out


def _model(transformers: Any, config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    torch.manual_seed(0)
    llama: Any = transformers.LlamaForCausalLM  # untyped library
    with torch.device(device):  # initialise on the device: an 8B model on the host takes minutes
        model = llama._from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def _case(
    ctx: BenchContext, transformers: Any, case: str, config: Any, dtype: torch.dtype
) -> list[Measurement]:
    cuda = ctx.device.type == "cuda"
    model = _model(transformers, config, ctx.device, dtype)
    requests = _requests(ctx.smoke, config.vocab_size)
    names = [c for c in CONTENDERS if c not in ctx.skip and (cuda or c not in CUDA_ONLY)]
    skipped = []
    for name in VARLEN:
        if dtype not in (torch.float16, torch.bfloat16) and name in names:
            names.remove(name)  # its flash kernel takes half precision only
            why = f"varlen_attn's flash kernel takes float16 and bfloat16, not {dtype}"
            skipped.append(Measurement(WORKLOAD, case, name, None, skipped=why))
    runs: dict[str, list[_Run]] = {c: [] for c in names}
    repeats = 1 if ctx.smoke else max(1, min(ctx.repeats, 2))
    try:
        for r in range(repeats):
            for name in names:
                ctx.progress(f"{WORKLOAD} {case}: {name} (repeat {r + 1}/{repeats})")
                runs[name].append(_serve(ctx, transformers, model, requests, name))
    finally:
        del model
        gc.collect()
    # bf16 near-ties make the padded-row kernels of any graph move greedy tokens: only float32
    # is judged for exactness; bf16 reports the agreement ("tokens equal %").
    return _measurements(case, runs, cuda, judged=dtype == torch.float32) + skipped


def _serve(
    ctx: BenchContext,
    transformers: Any,
    model: Any,
    requests: list[tuple[list[int], int]],
    name: str,
) -> _Run:
    tf_pool: list[int] = []  # transformers' graphs: what each capture reserved (its pool)
    counted = _tf_pool_counted(tf_pool) if name == TF_GRAPHS and ctx.device.type == "cuda" else None
    # For the whole run: start-up and serving.
    with _graphs_disabled(name == EAGER_VARLEN), counted or nullcontext():
        return _serve_once(ctx, transformers, model, requests, name, tf_pool)


def _serve_once(
    ctx: BenchContext,
    transformers: Any,
    model: Any,
    requests: list[tuple[list[int], int]],
    name: str,
    tf_pool: list[int],
) -> _Run:
    cuda = ctx.device.type == "cuda"
    gen = transformers.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    longest = max(len(p) + n for p, n in requests)
    blocks = len(requests) * (-(-longest // BLOCK)) + 8
    cb = transformers.ContinuousBatchingConfig(
        block_size=BLOCK if cuda else 16,
        num_blocks=blocks if cuda else 64,
        max_batch_tokens=BATCH_TOKENS if cuda else 32,
        max_requests_per_batch=len(requests),
        use_async_batching=False,
        use_cuda_graph=name == TF_GRAPHS,
        q_padding_interval_size=64 if cuda else 8,
        # transformers' default KV padding (64 blocks of 256 tokens) for its own graphs.
    )
    handle = None
    if name in ("bcg", *VARLEN):
        handle = bcg_core.enable_continuous_batching(
            model, attention="varlen" if name in VARLEN else "paged"
        )
    try:
        with _memory_query(ctx.device):
            start = time.perf_counter()
            manager = model.init_continuous_batching(
                generation_config=gen, continuous_batching_config=cb
            )
            manager.warmup()
            manager.start()
            startup_ms = (time.perf_counter() - start) * 1e3
        try:
            submitted = time.perf_counter()
            ids = {
                manager.add_request(
                    p, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True
                ): i
                for i, (p, n) in enumerate(requests)
            }
            results: dict[int, Any] = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError(f"{name}: the engine produced nothing for 60 s")
                if result.is_finished():
                    results[ids[result.request_id]] = result
            seconds = time.perf_counter() - submitted
            errors = [r.error for r in results.values() if r.error is not None]
            if errors:
                raise RuntimeError(f"{name}: {errors[0]}")
            reserved = _reserved() if cuda else None
            graphs = _graph_count(manager, handle)
            pool_bytes = sum(tf_pool) if tf_pool else None
            if handle is not None:
                pool_bytes = handle.stats().graph_bytes
        finally:
            manager.stop(block=True)
            manager.destroy()
    finally:
        if handle is not None:
            handle.remove()
    del manager
    held = None if reserved is None else reserved - _reserved()
    return _Run(
        tokens={i: list(r.generated_tokens) for i, r in results.items()},
        seconds=seconds,
        ttft_ms=[(r.timestamps[0] - submitted) * 1e3 for r in results.values() if r.timestamps],
        startup_ms=startup_ms,
        held=held,
        graphs=graphs,
        pool_bytes=pool_bytes,
    )


def _graphs_disabled(disabled: bool) -> AbstractContextManager[Any]:
    """``BCG_DISABLE=1`` around a run (the engine's own thread reads it at every batch)."""
    return mock.patch.dict(os.environ, {"BCG_DISABLE": "1"}) if disabled else nullcontext()


@contextlib.contextmanager
def _memory_query(device: torch.device) -> Iterator[None]:
    """On the CPU the cache is sized explicitly, but the engine still asks how much memory is
    free, which a CPU reports as none: answer 1 GiB there (only that query)."""
    if device.type != "cpu":
        yield
        return
    from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler

    handler: Any = PagedAttentionMemoryHandler  # untyped library
    saved = handler.get_available_memory
    handler.get_available_memory = lambda _self: 1 << 30
    try:
        yield
    finally:
        handler.get_available_memory = saved


@contextlib.contextmanager
def _tf_pool_counted(grown: list[int]) -> Iterator[None]:
    """transformers' graphs: what the allocator newly reserves in each of the engine's graph
    captures (its warm-up run and capture both allocate in the graphs' shared pool, which never
    gives memory back), the way bcg counts its own pool; the engine thread is the only one
    allocating then. Each capture starts with the cache emptied, as ``torch.cuda.graph`` does
    itself, so what is counted is what the capture added."""
    from transformers.generation.continuous_batching import model_runner

    runner: Any = model_runner.ModelRunner  # untyped library
    capture = runner._capture_graph

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        # torch.cuda.graph empties the allocator's cache as it begins: emptied first here, so
        # that release does not hide the pool's growth (it made the count 0 MB at hf-llama size).
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        capture(self, *args, **kwargs)
        grown.append(max(0, torch.cuda.memory_reserved() - before))

    with mock.patch.object(runner, "_capture_graph", counted):
        yield


def _graph_count(manager: Any, handle: bcg_core.ContinuousBatchingHandle | None) -> int | None:
    if handle is not None:
        return handle.stats().graphs
    processor = manager.batch_processor
    graphs = getattr(getattr(processor, "inputs_and_outputs", None), "graphs", None)
    storage = getattr(graphs, "_storage", None)
    return None if storage is None else len(storage)


def _reserved() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _measurements(
    case: str, runs: dict[str, list[_Run]], cuda: bool, judged: bool
) -> list[Measurement]:
    def per_token(run: _Run) -> float:
        return run.seconds * 1e6 / sum(len(t) for t in run.tokens.values())

    eager = runs.get(EAGER, [None])[0]
    out = []
    for name, done in runs.items():
        # bcg varlen is held to the engine eager with its kernel; everything else to eager.
        reference = runs.get(EAGER_VARLEN, [None])[0] if name == BCG_VARLEN else eager
        times = [per_token(r) for r in done]
        last = done[-1]

        def ratio(base: str, done: list[_Run] = done, name: str = name) -> Stats | None:
            if base not in runs:
                return None
            return Stats.of(
                [per_token(a) / per_token(b) for a, b in zip(done, runs[base], strict=True)]
            )

        # What graphs add over the same engine without them: bcg varlen against eager varlen.
        base = reference if name == BCG_VARLEN and reference is not None else eager
        base_held = None if base is None else base.held
        graph_mb = None
        if cuda and last.held is not None and base_held is not None:
            graph_mb = max(0, last.held - base_held) / 2**20
        # Padded rows move bf16 near-ties against unpadded eager; eager varlen pads the same.
        correct = None
        if reference is not None and (judged or name == BCG_VARLEN) and name != EAGER:
            correct = all(r.tokens == reference.tokens for r in done)
        tokens = sum(len(t) for t in last.tokens.values())
        figures = {
            "tokens/s": tokens / statistics.median(r.seconds for r in done),
            "ttft median ms": statistics.median(last.ttft_ms),
            "ttft p90 ms": _p90(last.ttft_ms),
        }
        if last.held is not None:
            figures["engine held MB"] = last.held / 2**20
        if last.pool_bytes is not None:  # the pool alone (no allocator noise), both counted alike
            figures["pool MB counted"] = last.pool_bytes / 2**20
        if eager is not None and name != EAGER:
            same = sum(
                a == b
                for i, ref in eager.tokens.items()
                for a, b in zip(last.tokens.get(i, []), ref, strict=False)
            )
            figures["tokens equal %"] = 100.0 * same / sum(len(t) for t in eager.tokens.values())
        out.append(
            Measurement(
                WORKLOAD,
                case,
                name,
                Stats.of(times),
                capture_ms=statistics.median(r.startup_ms for r in done),
                pool_mb=0.0 if name == EAGER and cuda else graph_mb,
                segments=last.graphs,
                correct=correct,
                ratio_to_full_graph=ratio(TF_GRAPHS),
                ratio_to_eager=ratio(EAGER),
                figures=figures,
            )
        )
    return out
