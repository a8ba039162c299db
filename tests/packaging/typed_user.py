"""A typed user of bcg_core and bcg_diffusion: every public name, used as README shows.

Not a test module (pytest does not collect it): tests/packaging/test_typing_review39.py runs
``mypy --strict`` over it. An annotation that makes this file need a cast or an ignore is a bug
in the public API's types.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import assert_type

import torch

import bcg_core
import bcg_diffusion
from bcg_core import (
    BCG_FAILURE_HINT,
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakableGraphError,
    BreakableGraphRunner,
    BreakOutputError,
    CaptureCheck,
    CaptureError,
    CaptureReport,
    ConcurrentCaptureError,
    ContinuousBatchingHandle,
    ContinuousBatchingStats,
    DivergenceReport,
    EntryStats,
    GraphMemory,
    PatchHandle,
    ReplayError,
    RunnerStats,
    TensorDiff,
    UnjoinedStreamError,
    break_graph,
    breakable_attention,
    breakable_graphs_disabled,
    check_capture,
    check_divergence,
    describe_difference,
    disable_breakable_graphs,
    eager_on_graph,
    enable_breakable_cuda_graph,
    enable_continuous_batching,
    get_current_stream,
    is_breakable_capture_active,
    is_in_breakable_cuda_graph,
    keep_alive_ok,
    patch_attribute,
    signature_of,
)
from bcg_diffusion import (
    AttentionPatch,
    DiTRunner,
    bucket_for,
    get_current_replay_token,
    install_breakable_attention,
    is_breakable_attention_installed,
    make_attention_ops_breakable,
    make_breakable_attention_forward,
    pad_prompt,
    replay_token_scope,
    uninstall_breakable_attention,
)


@eager_on_graph
def attention(q: torch.Tensor, k: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return q @ k.T * scale


@eager_on_graph(name="count", strict=True)
def count(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    return x, 1


@eager_on_graph()
def plain(x: torch.Tensor) -> torch.Tensor:
    return x


assert_type(attention(torch.ones(2, 2), torch.ones(2, 2)), torch.Tensor)
assert_type(attention(torch.ones(2, 2), torch.ones(2, 2), scale=2.0), torch.Tensor)
assert_type(count(torch.ones(2)), tuple[torch.Tensor, int])
assert_type(plain(torch.ones(2)), torch.Tensor)
assert_type(break_graph(), None)


class Block(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attention(x, x) + 1

    @eager_on_graph
    def method_break(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


block = Block()
assert_type(block.method_break(torch.ones(2)), torch.Tensor)


def step(x: torch.Tensor) -> torch.Tensor:
    return block.forward(x)


x0 = torch.ones(2, 2)
assert_type(bcg_core.__version__, str)
assert_type(bcg_diffusion.__version__, str)
assert_type(BCG_FAILURE_HINT, str)

graph = BreakableCUDAGraph(backend="cpu")
with enable_breakable_cuda_graph(), graph.warmup():
    step(x0)
with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(graph) as cap:
    assert_type(cap, BreakableCUDAGraphCapture)
    out = step(x0)
graph.replay()
assert_type(is_in_breakable_cuda_graph(), bool)
assert_type(is_breakable_capture_active(), bool)
assert_type(breakable_graphs_disabled(), bool)
with disable_breakable_graphs():
    pass


@disable_breakable_graphs()
def eager_only(x: torch.Tensor) -> torch.Tensor:
    return x


assert_type(eager_only(x0), torch.Tensor)
get_current_stream("cpu")
assert_type(keep_alive_ok(x0), torch.Tensor)

runner = BreakableGraphRunner(step, device="cpu", as_tensor=("t",))
runner.capture(x0)
y = runner(x0)
report = runner.capture_many([((x0,), {})])
assert_type(report, CaptureReport)
assert_type(report.captured, tuple[EntryStats, ...])
assert_type(report.memory, GraphMemory)
assert_type(report.memory.total_bytes, int | None)
assert_type(report.seconds, float)
for sig, reason in report.failed:
    assert_type(reason, str)
    describe_difference(sig, [signature_of((x0,), {})])
stats = runner.stats
assert_type(stats, RunnerStats)
assert_type(stats.hits, int)
assert_type(runner.graph_memory(), GraphMemory)
with runner.warmup() as r:
    assert_type(r, BreakableGraphRunner)
div = runner.check_divergence(x0)
assert_type(div, DivergenceReport)
assert_type(div.diffs, tuple[TensorDiff, ...])
assert_type(check_divergence(step, [(x0,), (x0 + 1,)]), DivergenceReport)
check = check_capture(step, x0)
assert_type(check, CaptureCheck)
assert_type(check.ok, bool)
assert_type(check.error, str | None)

assert_type(breakable_attention("sdpa"), str)
handle = enable_continuous_batching(block)
assert_type(handle, ContinuousBatchingHandle)
assert_type(handle.stats(), ContinuousBatchingStats)
with enable_continuous_batching(block) as h2:
    assert_type(h2, ContinuousBatchingHandle)

patch = patch_attribute(torch.nn.functional, "relu", lambda f: f)
assert_type(patch, PatchHandle)
with patch_attribute(torch.nn.functional, "gelu", lambda f: f) as p2:
    assert_type(p2, PatchHandle)
patch.remove()

errors: tuple[type[BreakableGraphError], ...] = (
    BreakOutputError,
    CaptureError,
    ConcurrentCaptureError,
    ReplayError,
    UnjoinedStreamError,
)

# bcg_diffusion
assert_type(bcg_diffusion.PatchHandle, type[PatchHandle])
assert bcg_diffusion.patch_attribute is patch_attribute
ap = install_breakable_attention(Block)
assert_type(ap, AttentionPatch)
with install_breakable_attention(Block) as ap2:
    assert_type(ap2, AttentionPatch)
assert_type(is_breakable_attention_installed(Block), bool)
uninstall_breakable_attention(Block)
fwd = make_breakable_attention_forward(Block.forward)
ops = make_attention_ops_breakable(block)
assert_type(ops, PatchHandle)
dit = DiTRunner(block, breakable_attention=ops, device="cpu")
dit.capture(hidden_states=x0)
v = dit(hidden_states=x0)
with dit.warmup() as dw:
    assert_type(dw, DiTRunner)


class MyRunner(BreakableGraphRunner):
    def served(self) -> int:
        return self.stats.hits


with MyRunner(step, device="cpu").warmup() as mine:
    assert_type(mine.served(), int)
dit.close()
assert_type(bucket_for(3, [4, 8]), int)
ids, mask = pad_prompt(torch.ones(1, 3, 2), None, [4, 8])
assert_type(ids, torch.Tensor)
with replay_token_scope() as token:
    assert_type(token, int)
assert_type(get_current_replay_token(), int | None)

# Start-up list built ahead, as engines do.
sizes = [1, 2, 4]
calls: list[tuple[tuple[torch.Tensor], dict[str, object]]]
calls = [((torch.zeros(b, 2),), {}) for b in sizes]
runner.capture_many(calls)
shared = BreakableGraphRunner(step, device="cpu", pool=runner.pool)
shared2 = BreakableGraphRunner(step, device="cpu", pool=graph.pool())


def at_prompt_end(ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        return ids

    return load


check_divergence(step, [at_prompt_end(i) for i in (x0, x0 + 1)])


@replay_token_scope()
def replay_by_hand() -> int | None:
    graph.replay()
    return get_current_replay_token()


assert_type(replay_by_hand(), int | None)


class MyAttention(torch.nn.Module):
    @make_breakable_attention_forward
    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q @ k.T, q


def attend(attn: MyAttention, q: torch.Tensor) -> torch.Tensor:
    out, _lse = attn.forward(q, q)
    return out


assert_type(MyAttention().forward(x0, x0), tuple[torch.Tensor, torch.Tensor])


def _collect(x: torch.Tensor) -> list[int]:
    return [int(v) for v in x.tolist()]


# Wrapping an existing function with options, in one call (as the project's own tests do).
collect = eager_on_graph(_collect, name="collect", strict=True)
assert_type(collect(x0), list[int])
