"""A small diffusion transformer (DiT) for tests, examples and benchmarks.

Patch embedding, ``depth`` blocks of adaLN-modulated self-attention, masked cross-attention to
variable-length text and an MLP, then a modulated final layer that unpatchifies back to latent
channels. Self-attention goes through :class:`DiTSelfAttention` (or :class:`DiTSelfAttentionLSE`,
which returns ``(out, lse)`` like varlen kernels do): the classes to hand to
:func:`install_breakable_attention`. Everything else is capturable: no host syncs, and position
embeddings and masks are built on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DiTConfig:
    """Shape of a toy DiT. ``lse_attention`` selects the tuple-returning attention class."""

    in_channels: int = 4
    patch: int = 2
    hidden: int = 256
    depth: int = 4
    heads: int = 4
    text_dim: int = 128
    mlp_ratio: int = 4
    lse_attention: bool = False
    dtype: torch.dtype = torch.bfloat16


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, d = x.shape
    return x.view(b, n, heads, d // heads).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


class DiTSelfAttention(nn.Module):
    """The attention operation over image tokens: ``forward(q, k, v)`` with ``[B, heads, N, d]``
    inputs returns ``[B, heads, N, d]``. This is the module engines swap for varlen,
    sparse or sequence-parallel kernels, and the one to make a break point; the projections
    around it stay in the captured graph."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


class DiTSelfAttentionLSE(DiTSelfAttention):
    """Like :class:`DiTSelfAttention` but returns ``(out, lse)``, the log-sum-exp per query."""

    def forward(  # type: ignore[override]
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        lse = torch.logsumexp(scores, dim=-1)
        attn = torch.exp(scores - lse[..., None]).to(v.dtype)
        return attn @ v, lse


class DiTCrossAttention(nn.Module):
    """Attention from image tokens to text tokens; ``mask [B, L]`` is True for real tokens."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, text: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = _heads(self.q(x), self.heads)
        k, v = (_heads(t, self.heads) for t in self.kv(text).chunk(2, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        out: torch.Tensor = self.out(_merge(attended))
        return out


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    """adaLN-zero style block: self-attention, cross-attention, MLP, each gated by ``c``."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        attention = DiTSelfAttentionLSE if cfg.lse_attention else DiTSelfAttention
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.attn = attention()
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.norm2 = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.cross = DiTCrossAttention(cfg.hidden, cfg.heads)
        self.norm3 = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden),
            nn.GELU(approximate="tanh"),
            nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden),
        )
        self.ada = nn.Linear(cfg.hidden, 6 * cfg.hidden)

    def forward(
        self, x: torch.Tensor, c: torch.Tensor, text: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        mod: torch.Tensor = self.ada(F.silu(c))
        s1, sc1, g1, s2, sc2, g2 = mod.chunk(6, dim=-1)
        qkv: torch.Tensor = self.qkv(_modulate(self.norm1(x), s1, sc1))
        q, k, v = (_heads(t, self.heads) for t in qkv.chunk(3, dim=-1))
        attn = self.attn(q, k, v)
        attn_out: torch.Tensor = self.proj(_merge(attn[0] if isinstance(attn, tuple) else attn))
        x = x + g1[:, None] * attn_out
        cross: torch.Tensor = self.cross(self.norm2(x), text, mask)
        x = x + cross
        mlp: torch.Tensor = self.mlp(_modulate(self.norm3(x), s2, sc2))
        return x + g2[:, None] * mlp


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of timesteps ``t [B]`` (float32) as ``[B, dim]``."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _pos_embedding(h: int, w: int, dim: int, device: torch.device) -> torch.Tensor:
    ys, xs = torch.meshgrid(
        torch.arange(h, device=device, dtype=torch.float32),
        torch.arange(w, device=device, dtype=torch.float32),
        indexing="ij",
    )
    quarter = dim // 4
    freqs = torch.exp(-math.log(10000.0) * torch.arange(quarter, device=device) / quarter)
    parts = [f(p.reshape(-1, 1) * freqs) for p in (ys, xs) for f in (torch.sin, torch.cos)]
    return torch.cat(parts, dim=-1)[None]


class ToyDiT(nn.Module):
    """``forward(latents [B, C, H, W], t [B], text [B, L, text_dim], mask [B, L] | None)``
    returns the predicted noise ``[B, C, H, W]``. ``t`` may live on the CPU (it is moved)."""

    def __init__(self, cfg: DiTConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)
        p, d = cfg.patch, cfg.hidden
        self.patch_embed = nn.Conv2d(cfg.in_channels, d, kernel_size=p, stride=p)
        self.t_embed = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.text_proj = nn.Linear(cfg.text_dim, d)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.final_norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Linear(d, 2 * d)
        self.final = nn.Linear(d, p * p * cfg.in_channels)
        with torch.no_grad():
            for param in self.parameters():
                std = 0.02 if param.dim() > 1 else 0.01
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        self.to(cfg.dtype)

    def forward(
        self,
        latents: torch.Tensor,
        t: torch.Tensor,
        text: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, ch, h, w = latents.shape
        p = self.cfg.patch
        x = self.patch_embed(latents).flatten(2).transpose(1, 2)
        x = x + _pos_embedding(h // p, w // p, self.cfg.hidden, x.device).to(x.dtype)
        t = t.to(latents.device)
        c = self.t_embed(timestep_embedding(t, self.cfg.hidden).to(x.dtype))
        ctx = self.text_proj(text)
        if mask is None:
            mask = torch.ones(text.shape[:2], dtype=torch.bool, device=text.device)
        for block in self.blocks:
            x = block(x, c, ctx, mask)
        shift, scale = self.final_ada(F.silu(c)).chunk(2, dim=-1)
        x = self.final(_modulate(self.final_norm(x), shift, scale))
        assert isinstance(x, torch.Tensor)
        x = x.view(b, h // p, w // p, p, p, ch).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, ch, h, w)
