"""GPU probe for issue 20 (breaks over compiled code): what fails when a compiled step with
breaks is captured on CUDA. Each case prints OK/FAIL and the error; never raises."""

from __future__ import annotations

import time
import traceback

import torch

import bcg_core
from bcg_core import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphRunner,
    eager_on_graph,
    enable_breakable_cuda_graph,
)

torch._logging.set_logs(recompiles=True, graph_breaks=True)
print("torch", torch.__version__, "cuda", torch.version.cuda, "bcg", bcg_core.__version__)
print("nonstrict_trace:", hasattr(torch._dynamo, "nonstrict_trace"))


@eager_on_graph(name="probe.host")
def host_side(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.abs().max().item() > -1)  # a host sync: must run as a break


def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.silu(x @ w) * 2 + 1
    h = host_side(h)
    return torch.nn.functional.gelu(h @ w) + h


def case(name: str, fn) -> None:
    t = time.perf_counter()
    try:
        msg = fn()
        print(f"[{name}] OK {msg} ({time.perf_counter() - t:.1f}s)", flush=True)
    except Exception as exc:
        print(f"[{name}] FAIL {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
        traceback.print_exc(limit=25)


x = torch.randn(64, 256, device="cuda")
w = torch.randn(256, 256, device="cuda") / 16


def compiled_capture(fullgraph: bool) -> str:
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=fullgraph)
    for _ in range(3):
        compiled(x, w)
    torch.cuda.synchronize()
    ref = compiled(x, w).clone()
    graph = BreakableCUDAGraph()
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        out = compiled(x, w)
    graph.replay()
    torch.cuda.synchronize()
    ok = torch.equal(out, ref)
    x2 = torch.randn_like(x)
    x.copy_(x2)
    graph.replay()
    ref2 = compiled(x, w)
    same = torch.equal(out, ref2)
    return f"breaks={graph.num_breaks} segments={graph.num_segments} equal {ok} {same}"


def runner_case() -> str:
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    runner = BreakableGraphRunner(compiled)
    runner.capture(x, w)
    ref = compiled(x, w)
    r = runner(x, w)
    return f"stats={runner.stats} equal={torch.equal(r, ref)} disabled={runner.disabled_reason}"


def reduce_overhead_case() -> str:
    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead")
    for _ in range(3):
        compiled(x, w)
    graph = BreakableCUDAGraph()
    with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph):
        compiled(x, w)
    return f"breaks={graph.num_breaks}"


def llama_case() -> str:
    import transformers

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
    )  # fmt: skip
    model = (
        transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation=bcg_core.breakable_attention("sdpa"), dtype=torch.bfloat16
        )
        .cuda()
        .eval()
    )
    cache = transformers.StaticCache(config=cfg, max_cache_len=64)
    ids = torch.randint(0, 512, (1, 8), device="cuda")
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)

    def decode(tok: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tok, past_key_values=cache, use_cache=True).logits

    compiled = torch.compile(decode, fullgraph=True)
    tok = torch.randint(0, 512, (1, 1), device="cuda")
    with torch.no_grad():
        explain = torch._dynamo.explain(decode)(tok)
        print("explain graphs", explain.graph_count, "breaks", explain.graph_break_count)
        runner = BreakableGraphRunner(compiled)
        runner.capture(tok)
        runner(tok)
    return f"stats={runner.stats} disabled={runner.disabled_reason}"


case("capture compiled fullgraph", lambda: compiled_capture(True))
case("capture compiled default", lambda: compiled_capture(False))
case("runner over compiled", runner_case)
case("reduce-overhead under capture", reduce_overhead_case)
case("llama bcg_sdpa compiled", llama_case)
