"""A Llama-style toy decoder for tests, the demo and the benchmarks.

The model runs *decode steps*: every call takes one new token per sequence for a batch of ``B``
sequences and returns the next-token logits. Keys and values live in a preallocated per-layer KV
cache (:meth:`ToyDecoder.allocate_cache`), so the tensors a step touches keep their addresses
from one step to the next, which is what a CUDA graph replay needs.

Each layer is RMSNorm -> q/k/v projections -> RoPE -> attention -> o-projection -> residual ->
RMSNorm -> SwiGLU MLP -> residual; a final RMSNorm and an (untied) LM head give the logits.

The attention core (:func:`attention_core`: write the new key/value into the cache at
``positions``, then attend the single query over the cache window) is the model's break point.
:meth:`Attention.core` routes it through an :func:`bcg_core.eager_on_graph` break when
:func:`bcg_core.is_in_breakable_cuda_graph` is true and calls the same function directly
otherwise. The core is capturable in both modes: the cache writes are ``scatter_`` with device
index tensors and the causal mask is built on the device from ``positions``, so a step does no
host synchronisation and the whole step can also be captured in one plain
``torch.cuda.CUDAGraph`` (the "full graph" baseline).

Everything runs on CPU as well; the CPU tests use :func:`tiny_config`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bcg_core import eager_on_graph

__all__ = [
    "Attention",
    "AttentionFn",
    "DecoderBlock",
    "DecoderConfig",
    "RMSNorm",
    "ToyDecoder",
    "attention_core",
    "bench_config",
    "tiny_config",
]

_INIT_STD = 0.02


@dataclass(frozen=True)
class DecoderConfig:
    """Shape and numerics of a :class:`ToyDecoder`.

    ``hidden`` must be divisible by ``heads`` (``head_dim = hidden // heads``, which must be even
    for RoPE) and ``heads`` by ``kv_heads`` (grouped-query attention when ``kv_heads < heads``).
    ``max_context`` is the KV-cache window: positions run from 0 to ``max_context - 1`` and every
    step attends over the whole window, masking the slots after each sequence's position.

    Attributes:
        vocab: vocabulary size (embedding rows and logits).
        hidden: model width.
        layers: decoder layers.
        heads: query heads per layer.
        kv_heads: key/value heads per layer (a divisor of ``heads``).
        ffn: SwiGLU inner width.
        max_context: KV-cache slots per sequence.
        dtype: parameter and activation dtype (default ``torch.bfloat16``).
        rope_theta: RoPE base (default 10000.0).
        norm_eps: RMSNorm epsilon (default 1e-5).

    Raises:
        ValueError: a size is not positive, ``hidden`` is not divisible by ``heads`` or
            ``heads`` by ``kv_heads``, or ``head_dim`` is odd.
    """

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    max_context: int
    dtype: torch.dtype = torch.bfloat16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        sizes = {
            "vocab": self.vocab,
            "hidden": self.hidden,
            "layers": self.layers,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "ffn": self.ffn,
            "max_context": self.max_context,
        }
        for field, size in sizes.items():
            if size <= 0:
                raise ValueError(f"DecoderConfig.{field} must be positive, got {size}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) is not divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) is not divisible by kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``hidden // heads``."""
        return self.hidden // self.heads


def tiny_config(dtype: torch.dtype = torch.bfloat16) -> DecoderConfig:
    """A decoder small enough for CPU tests: 8 layers, hidden 256, 4 heads (2 KV heads).

    Vocabulary 1024, FFN width 512, 256 cache slots.

    Args:
        dtype: the model's dtype (default ``torch.bfloat16``).

    Returns:
        The :class:`DecoderConfig`.
    """
    return DecoderConfig(
        vocab=1024,
        hidden=256,
        layers=8,
        heads=4,
        kv_heads=2,
        ffn=512,
        max_context=256,
        dtype=dtype,
    )


def bench_config(dtype: torch.dtype = torch.bfloat16) -> DecoderConfig:
    """The benchmark decoder (about 1.6 B parameters): 32 layers, hidden 2048, 16 heads, 8 KV heads.

    ``max_context`` is 1024, so a decode step attends over 1024 cache slots. Vocabulary 32000,
    FFN width 5632.

    Args:
        dtype: the model's dtype (default ``torch.bfloat16``).

    Returns:
        The :class:`DecoderConfig`.
    """
    return DecoderConfig(
        vocab=32000,
        hidden=2048,
        layers=32,
        heads=16,
        kv_heads=8,
        ffn=5632,
        max_context=1024,
        dtype=dtype,
    )


def _weight(
    shape: tuple[int, ...],
    std: float,
    generator: torch.Generator,
    device: torch.device | str | None,
    dtype: torch.dtype,
) -> nn.Parameter:
    """A parameter drawn from N(0, std²) on ``generator``'s device, then cast and moved.

    Drawing on the CPU (the default) makes the weights depend on the seed only, never on the
    device.
    """
    values = torch.randn(shape, generator=generator, dtype=torch.float32, device=generator.device)
    values.mul_(std)
    return nn.Parameter(values.to(device=device, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 (Llama style)."""

    def __init__(
        self, width: int, eps: float, device: torch.device | str | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(width, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, n, head_dim]`` by the per-sequence angles ``cos``/``sin``.

    ``cos`` and ``sin`` are ``[B, head_dim / 2]``; rotate-half convention, computed in float32.
    """
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Write this step's key/value into the cache and attend the query over the cache window.

    Shapes: ``q`` ``[B, heads, head_dim]``; ``k``, ``v`` ``[B, kv_heads, head_dim]``;
    ``k_cache``, ``v_cache`` ``[B_max, kv_heads, window, head_dim]`` with ``B <= B_max`` (rows
    ``B..B_max`` are left alone); ``positions`` ``[B]`` int64 with ``0 <= positions < window``
    (not checked: checking would sync with the host).

    ``k``/``v`` are written into slot ``positions[b]`` of row ``b`` in place, then the query of
    sequence ``b`` attends (``scaled_dot_product_attention``, scale ``1/sqrt(head_dim)``) over
    slots ``0..positions[b]`` of its row; later slots are masked on the device. Returns the
    attention output ``[B, heads * head_dim]`` in ``q``'s dtype, a fresh tensor (a break
    bridges it into the next graph segment).

    Every operation is a device kernel on fixed shapes: no ``.item()``, no host synchronisation,
    no allocation that depends on values, so the function is capturable in a plain CUDA graph
    and can be re-run unchanged at every replay of a breakable one.
    """
    batch, heads, head_dim = q.shape
    kv_heads, window = k_cache.shape[1], k_cache.shape[2]
    k_rows, v_rows = k_cache[:batch], v_cache[:batch]
    slot = positions.view(batch, 1, 1, 1).expand(batch, kv_heads, 1, head_dim)
    k_rows.scatter_(2, slot, k.unsqueeze(2))
    v_rows.scatter_(2, slot, v.unsqueeze(2))

    # The heads // kv_heads query heads that share a KV head attend as one group of queries
    # against it: grouped-query attention without repeating the cache.
    queries = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    visible = torch.arange(window, device=q.device) <= positions.view(batch, 1)
    out = F.scaled_dot_product_attention(
        queries, k_rows, v_rows, attn_mask=visible.view(batch, 1, 1, window)
    )
    return out.reshape(batch, heads * head_dim)


# gated: the flag is read when the call runs, not in code torch.compile traces
_attention_break = eager_on_graph(name="toy_decoder.attention", gated=True)(attention_core)

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    torch.Tensor,
]
"""The signature of :func:`attention_core`, for :meth:`ToyDecoder.set_attention`."""


class Attention(nn.Module):
    """Grouped-query self-attention of one layer for a decode step, with its KV cache.

    ``k_cache``/``v_cache`` are ``None`` until :meth:`ToyDecoder.allocate_cache` sets them.
    """

    def __init__(
        self,
        config: DecoderConfig,
        generator: torch.Generator,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        out_std = _INIT_STD / math.sqrt(2 * config.layers)
        q_width, kv_width = config.heads * config.head_dim, config.kv_heads * config.head_dim
        dtype = config.dtype
        self.q_weight = _weight((q_width, config.hidden), _INIT_STD, generator, device, dtype)
        self.k_weight = _weight((kv_width, config.hidden), _INIT_STD, generator, device, dtype)
        self.v_weight = _weight((kv_width, config.hidden), _INIT_STD, generator, device, dtype)
        self.o_weight = _weight((config.hidden, q_width), out_std, generator, device, dtype)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.attention_override: AttentionFn | None = None

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Attention output ``[B, hidden]`` for the normed hidden states ``x`` ``[B, hidden]``."""
        batch = x.shape[0]
        q = F.linear(x, self.q_weight).view(batch, self.heads, self.head_dim)
        k = F.linear(x, self.k_weight).view(batch, self.kv_heads, self.head_dim)
        v = F.linear(x, self.v_weight).view(batch, self.kv_heads, self.head_dim)
        out = self.core(_apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v, positions)
        return F.linear(out, self.o_weight)

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """:func:`attention_core` on this layer's cache; a break point inside a breakable graph.

        When :func:`bcg_core.is_in_breakable_cuda_graph` is true the call goes through the
        ``eager_on_graph`` break named ``"toy_decoder.attention"``; otherwise it is a direct
        call, so a plain CUDA graph captures the attention kernels with the rest of the step.
        Raises :class:`RuntimeError` if the cache is not allocated and :class:`ValueError` if
        the batch is larger than the cache's.
        """
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache not allocated: call ToyDecoder.allocate_cache first")
        if q.shape[0] > self.k_cache.shape[0]:
            raise ValueError(
                f"batch {q.shape[0]} exceeds the KV cache's batch {self.k_cache.shape[0]}"
            )
        core = self.attention_override or _attention_break
        return core(q, k, v, self.k_cache, self.v_cache, positions)


class _SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(
        self,
        config: DecoderConfig,
        generator: torch.Generator,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        out_std = _INIT_STD / math.sqrt(2 * config.layers)
        hidden, ffn, dtype = config.hidden, config.ffn, config.dtype
        self.gate_weight = _weight((ffn, hidden), _INIT_STD, generator, device, dtype)
        self.up_weight = _weight((ffn, hidden), _INIT_STD, generator, device, dtype)
        self.down_weight = _weight((hidden, ffn), out_std, generator, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = F.silu(F.linear(x, self.gate_weight)) * F.linear(x, self.up_weight)
        return F.linear(gated, self.down_weight)


class DecoderBlock(nn.Module):
    """One pre-norm layer: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``."""

    def __init__(
        self,
        config: DecoderConfig,
        generator: torch.Generator,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, config.norm_eps, device, config.dtype)
        self.attn = Attention(config, generator, device)
        self.mlp_norm = RMSNorm(config.hidden, config.norm_eps, device, config.dtype)
        self.mlp = _SwiGLU(config, generator, device)

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), positions, cos, sin)
        out: torch.Tensor = h + self.mlp(self.mlp_norm(h))
        return out


class ToyDecoder(nn.Module):
    """Llama-style decoder running one decode step per call; see the module docstring.

    ``ToyDecoder(config, seed=0, device=None)`` draws every weight from a CPU generator seeded
    with ``seed`` (so the weights depend on ``config`` and ``seed`` only, not on ``device``) and
    places them on ``device``; ``draw_on_device=True`` draws on ``device`` instead (much faster
    for billions of weights; the values then depend on the device's generator). Projections
    use std 0.02, the residual-branch output projections 0.02 / sqrt(2 * layers) and norms
    start at one, which keeps bf16 activations finite over 32 layers. All parameters have
    ``requires_grad=False``: the model is for inference.

    Call :meth:`allocate_cache` before the first step. A step writes each layer's new key/value
    at ``positions`` and reads slots ``0..positions[b]``, so slots before a sequence's position
    must have been filled by earlier steps (or by the caller) for the result to mean anything.

    Args:
        config: the decoder's shape and numerics.
        seed: the seed of the CPU generator the weights are drawn from (default 0).
        device: where the parameters go (default None: the CPU).
        draw_on_device: draw the weights with ``device``'s generator instead of the CPU's
            (default False).
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(
        self,
        config: DecoderConfig,
        seed: int = 0,
        device: torch.device | str | None = None,
        *,
        draw_on_device: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        # Billions of CPU draws take minutes; an 8B-size bench model draws on its device.
        where = device if draw_on_device and device is not None else "cpu"
        generator = torch.Generator(where).manual_seed(seed)
        dtype = config.dtype
        self.embed_weight = _weight(
            (config.vocab, config.hidden), _INIT_STD, generator, device, dtype
        )
        self.blocks = tuple(DecoderBlock(config, generator, device) for _ in range(config.layers))
        self.layers = nn.ModuleList(self.blocks)
        self.norm = RMSNorm(config.hidden, config.norm_eps, device, dtype)
        self.lm_head_weight = _weight(
            (config.vocab, config.hidden), _INIT_STD, generator, device, dtype
        )
        dim = config.head_dim
        inv_freq = config.rope_theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = torch.outer(torch.arange(config.max_context, dtype=torch.float64), inv_freq)
        self.register_buffer("rope_cos", angles.cos().float().to(device), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float().to(device), persistent=False)

    def allocate_cache(
        self, batch: int, device: torch.device | str | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Allocate every layer's zeroed KV cache ``[batch, kv_heads, max_context, head_dim]``.

        ``batch`` is the largest batch later steps may use; ``device`` defaults to the
        parameters' device. The caches are plain tensors held by each :class:`Attention` (not
        buffers, so ``Module.to`` never moves them behind a captured graph's back); they keep
        their addresses until the next ``allocate_cache``, which replaces them and so
        invalidates graphs captured before it.

        Args:
            batch: the largest batch later steps may use, > 0.
            device: where the caches go (default None: the parameters' device).

        Returns:
            ``[(k_cache, v_cache), ...]``, one pair per layer, so callers can inspect or
            pre-fill them.

        Raises:
            ValueError: ``batch`` is not positive.
        """
        if batch <= 0:
            raise ValueError(f"batch must be positive, got {batch}")
        cfg = self.config
        where = self.embed_weight.device if device is None else torch.device(device)
        shape = (batch, cfg.kv_heads, cfg.max_context, cfg.head_dim)
        caches = []
        for block in self.blocks:
            block.attn.k_cache = torch.zeros(shape, device=where, dtype=cfg.dtype)
            block.attn.v_cache = torch.zeros(shape, device=where, dtype=cfg.dtype)
            caches.append((block.attn.k_cache, block.attn.v_cache))
        return caches

    def set_attention(self, fn: AttentionFn | None) -> None:
        """Route every layer's attention core through ``fn``.

        Args:
            fn: a callable with the signature of ``attention_core``
                ``(q, k, v, k_cache, v_cache, positions)`` (e.g. a ``torch.compiler.disable``
                wrapper, or another library's break point); None restores the default routing
                (a bcg break under the runtime flag, else a direct call).
        """
        for block in self.blocks:
            block.attn.attention_override = fn

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step: logits ``[B, vocab]`` (model dtype) for ``tokens`` at ``positions``.

        ``tokens`` and ``positions`` are int64 ``[B]`` on the model's device, with
        ``positions[b]`` the index of ``tokens[b]`` in sequence ``b`` (``< max_context``, not
        checked on the host). Updates the KV cache in place.

        Args:
            tokens: int64 ``[B]`` token ids.
            positions: int64 ``[B]`` positions of ``tokens`` in their sequences.

        Returns:
            Logits ``[B, vocab]`` in the model's dtype.

        Raises:
            ValueError: ``tokens`` is not 1-D, ``positions`` has another shape, or the batch is
                larger than the cache's.
            RuntimeError: :meth:`allocate_cache` was not called.
        """
        if tokens.dim() != 1 or positions.shape != tokens.shape:
            raise ValueError(
                f"tokens and positions must both be [B]; got {tuple(tokens.shape)} "
                f"and {tuple(positions.shape)}"
            )
        cos = self.rope_cos.index_select(0, positions)
        sin = self.rope_sin.index_select(0, positions)
        h = F.embedding(tokens, self.embed_weight)
        for block in self.blocks:
            h = block(h, positions, cos, sin)
        return F.linear(self.norm(h), self.lm_head_weight)
