"""Every ```python block of README.md and the package READMEs runs, on CPU, as written.

A sample elides what is not its point (the model, the prompt, the latents): a prelude, keyed by
a line that is in the block, builds those from tiny configs, and a check after it asserts what
the sample claims (replays happened, replay equals eager). CPU substitutions, the only edits:
``"cuda"`` is ``"cpu"``, bfloat16 is float32, a 4096-token cache holds 16, and
``BreakableCUDAGraph``, ``BreakableGraphRunner`` and ``DiTRunner`` default to the CPU graph
backend. A block with no
prelude fails: a new sample gets one, so no sample can rot unseen.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import bcg_core

ROOT = Path(__file__).resolve().parents[1]
READMES = ["README.md", "packages/bcg-core/README.md", "packages/bcg-diffusion/README.md"]


def _blocks() -> list[tuple[str, int, str]]:
    found = []
    for name in READMES:
        text = (ROOT / name).read_text(encoding="utf-8")
        for i, match in enumerate(re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S)):
            found.append((name, i, match.group(1)))
    return found


TRANSFORMERS = """
import torch
import transformers
config = transformers.LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
)
prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
steps = 3
"""

RECIPE = TRANSFORMERS  # the recipe itself builds model and cache

RECIPE_CHECK = """
assert runner.stats.hits == steps, runner.stats
assert runner.stats.entries[0].breaks == config.num_hidden_layers
"""

DIVERGENCE_TRANSFORMERS = (
    TRANSFORMERS
    + """
import bcg_core
model = transformers.AutoModelForCausalLM.from_config(
    config, attn_implementation=bcg_core.breakable_attention("sdpa")
).eval()
cache = transformers.StaticCache(config=model.config, max_cache_len=16)
ids0, ids1, ids2 = (torch.tensor([[i]]) for i in (3, 7, 11))
"""
)

DIVERGENCE_CHECK = """
_report = bcg_core.check_divergence(step, [at_prompt_end(ids) for ids in (ids0, ids1, ids2)])
assert _report.ok, str(_report)
"""

DIFFUSERS = """
import torch
import diffusers
model = diffusers.FluxTransformer2DModel(
    patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
    axes_dims_rope=(4, 6, 6),
).eval()
_gen = torch.Generator().manual_seed(1)
latents = torch.randn(1, 16, 4, generator=_gen)
cond = {
    "encoder_hidden_states": torch.randn(1, 8, 32, generator=_gen),
    "pooled_projections": torch.randn(1, 32, generator=_gen),
    "img_ids": torch.zeros(16, 3),
    "txt_ids": torch.zeros(8, 3),
}
timesteps = torch.linspace(1.0, 0.25, 4)[:, None]
dt = 0.25
"""

DIFFUSERS_CHECK = """
_stats = runner.stats_at_reset
assert _stats.hits == len(timesteps) and _stats.misses == 0, _stats
"""

GENERIC_DIVERGENCE = """
import torch
import bcg_core

@bcg_core.eager_on_graph
def _attention(h, pos):
    return h + pos

def step(tokens, pos):
    return _attention(tokens * 2, pos) + 1

tokens0, tokens1, tokens2 = (torch.full((2, 4), float(i)) for i in range(3))
pos0, pos1, pos2 = (torch.full((2, 1), float(i)) for i in range(3))
"""

OWN_MODEL = """
import torch

def model(x):
    return torch.nn.functional.relu(x @ x.T)

static_in = torch.randn(4, 4)
new_input = torch.randn(4, 4)
"""

OWN_MODEL_CHECK = """
assert torch.equal(static_out, model(new_input))
"""

CORE_RUNNER = """
import torch

def varlen_attention(q, k, v, seq_lens_host):
    return q + k.sum() * v.mean() * len(seq_lens_host)

class Model(torch.nn.Module):
    def forward(self, tokens, positions):
        h = tokens * 2 + positions
        return attention(h, h, h, [4, 4]) * 3

model = Model()
tokens, positions = torch.randn(2, 4), torch.randn(2, 4)
"""

CORE_RUNNER_CHECK = """
assert runner.stats.hits == 1
assert torch.equal(logits, Model()(tokens, positions))
"""

COMPILE = """
import torch
from bcg_core import BreakableCUDAGraph, BreakableCUDAGraphCapture, enable_breakable_cuda_graph
from bcg_core import eager_on_graph

@eager_on_graph
def _attention(h):
    return h.softmax(-1)

def model(x):
    return _attention(x * 2) + 1

x = torch.randn(4, 4)
"""

COMPILE_CHECK = """
assert graph.num_breaks == 1
graph.replay()
assert torch.equal(out, model(x))
"""

DIFFUSION_RUNNER = """
import torch

class MyAttention(torch.nn.Module):
    def forward(self, h):
        return (h @ h.transpose(-1, -2)).softmax(-1) @ h

class DiT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.attn = MyAttention()

    def forward(self, latents, t, text):
        h = self.proj(latents) + t + text.mean()
        return self.attn(h)

model = DiT()
_gen = torch.Generator().manual_seed(3)
latents, text = torch.randn(1, 4, 8, generator=_gen), torch.randn(1, 2, 8, generator=_gen)
timesteps = torch.linspace(1.0, 0.25, 4)[:, None]
t = timesteps[0]
warmup_shapes = [(latents, t, text)]
"""

DIFFUSION_RUNNER_CHECK = """
_stats = runner.stats_at_reset
assert _stats.hits == len(timesteps) and _stats.misses == 0, _stats
"""

CONTINUOUS_BATCHING = (
    TRANSFORMERS
    + """
from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler
# A CPU reports no free device memory; the engine sizes a small cache from this instead (the
# check puts the query back).
_memory_query = PagedAttentionMemoryHandler.get_available_memory
PagedAttentionMemoryHandler.get_available_memory = lambda self: 16 << 20
prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
gen = transformers.GenerationConfig(
    max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0
)
"""
)

CONTINUOUS_BATCHING_CHECK = """
PagedAttentionMemoryHandler.get_available_memory = _memory_query
assert len(out) == len(prompts) and all(len(o.generated_tokens) == 4 for o in out.values())
assert handle.stats().graphs >= 1 and handle.stats().eager_calls == 0, handle.stats()
"""

# torch.compile's eager backend without fullgraph: CPU captures run compiled frames uncompiled
# under the CPU recorder, which fullgraph refuses (DESIGN.md, "Breaks over compiled code").
EAGER_COMPILE = """
import torch
_compile = torch.compile
torch.compile = lambda fn, **kwargs: _compile(fn, backend="eager")
"""

COMPILE_TRANSFORMERS = (
    TRANSFORMERS
    + EAGER_COMPILE
    + """
from bcg_core import BreakableGraphRunner, breakable_attention
model = transformers.AutoModelForCausalLM.from_config(
    config, attn_implementation=breakable_attention("sdpa")
).eval()
cache = transformers.StaticCache(config=model.config, max_cache_len=16)
with torch.no_grad():
    next_ids = model(input_ids=prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
"""
)

COMPILE_DIFFUSERS = (
    DIFFUSERS
    + EAGER_COMPILE
    + """
from bcg_diffusion import DiTRunner, make_attention_ops_breakable
"""
)

COMPILE_RUNNER_CHECK = """
torch.compile = _compile
assert runner.stats.captures == 1 and runner.stats.failed_captures == 0, runner.stats
assert runner.stats.entries[0].breaks >= 1, runner.stats
"""

# (a line that is in the block, prelude, check after)
PRELUDES: list[tuple[str, str, str]] = [
    ('name = breakable_attention("sdpa")', RECIPE, RECIPE_CHECK),
    ("make_attention_ops_breakable(model))", DIFFUSERS, DIFFUSERS_CHECK),
    ("bcg_core.check_divergence(step, [(tokens0, pos0)", GENERIC_DIVERGENCE, ""),
    ("def at_prompt_end(ids):", DIVERGENCE_TRANSFORMERS, DIVERGENCE_CHECK),
    ("def attention(q, k, v, metadata):", OWN_MODEL, OWN_MODEL_CHECK),
    ("def attention(q, k, v, seq_lens_host):", CORE_RUNNER, CORE_RUNNER_CHECK),
    ('torch.compile(model, backend="eager")', COMPILE, COMPILE_CHECK),
    ("attention_classes=(MyAttention,)", DIFFUSION_RUNNER, DIFFUSION_RUNNER_CHECK),
    ("# transformers: the recipe's bcg_sdpa model", COMPILE_TRANSFORMERS, COMPILE_RUNNER_CHECK),
    ("# diffusers: a DiT's step compiled", COMPILE_DIFFUSERS, COMPILE_RUNNER_CHECK),
    ("enable_continuous_batching(model) as handle", CONTINUOUS_BATCHING, CONTINUOUS_BATCHING_CHECK),
]
NEEDS = {
    DIFFUSERS: "diffusers",
    RECIPE: "transformers",
    DIVERGENCE_TRANSFORMERS: "transformers",
    CONTINUOUS_BATCHING: "transformers",
    COMPILE_TRANSFORMERS: "transformers",
    COMPILE_DIFFUSERS: "diffusers",
}


def _on_cpu(source: str) -> str:
    source = source.replace('"cuda"', '"cpu"').replace("torch.bfloat16", "torch.float32")
    return source.replace("max_cache_len=4096", "max_cache_len=16")  # a tiny cache


class _CpuGraph(bcg_core.BreakableCUDAGraph):
    def __init__(self, pool: Any = None, *, backend: str = "cpu", **kwargs: Any) -> None:
        super().__init__(pool, backend=backend, **kwargs)


class _CpuRunner(bcg_core.BreakableGraphRunner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("device", "cpu")
        super().__init__(*args, **kwargs)

    def reset(self) -> None:
        self.stats_at_reset = self.stats  # a sample's close() comes before its check
        super().reset()


@pytest.fixture()
def cpu_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bcg_core, "BreakableCUDAGraph", _CpuGraph)
    monkeypatch.setattr(bcg_core, "BreakableGraphRunner", _CpuRunner)
    try:
        import bcg_diffusion
    except ImportError:
        return

    class CpuDiTRunner(bcg_diffusion.DiTRunner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("device", "cpu")
            super().__init__(*args, **kwargs)

        def reset(self) -> None:
            self.stats_at_reset = self.stats
            super().reset()

    monkeypatch.setattr(bcg_diffusion, "DiTRunner", CpuDiTRunner)


BLOCKS = _blocks()


def test_every_sample_has_a_prelude() -> None:
    assert len(BLOCKS) >= len(PRELUDES)
    for name, i, block in BLOCKS:
        keys = [key for key, _, _ in PRELUDES if key in block]
        assert len(keys) == 1, f"{name} python block {i}: add one prelude keyed by its lines"


@pytest.mark.usefixtures("cpu_defaults")
@pytest.mark.parametrize(("name", "index", "block"), BLOCKS, ids=[f"{n}#{i}" for n, i, _ in BLOCKS])
def test_sample_runs_on_cpu(name: str, index: int, block: str) -> None:
    matches = [(p, c) for key, p, c in PRELUDES if key in block]
    if len(matches) != 1:
        pytest.fail(f"{name} python block {index} has no prelude (see PRELUDES)")
    prelude, check = matches[0]
    if prelude in NEEDS:
        pytest.importorskip(NEEDS[prelude])
    source = "\n".join(textwrap.dedent(s) for s in (prelude, _on_cpu(block), check))
    namespace: dict[str, Any] = {"__name__": f"readme_sample_{index}"}
    torch.manual_seed(0)
    with torch.no_grad():
        exec(compile(source, f"{name} python block {index}", "exec"), namespace)
    close = getattr(namespace.get("runner"), "close", None)
    if callable(close):
        close()
