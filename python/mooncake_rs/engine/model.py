"""The decoder: RMSNorm, RoPE (theta, linear / llama3 scaling), GQA, SwiGLU.

One forward serves every supported family (Llama, Mistral, Qwen2, Qwen3): the config's
switches add projection biases (q/k/v, o, MLP) and Qwen3's per-head q/k RMSNorm. The
q/k/v ones happen before RoPE and the cache write, so the attention backends (torch
reference and FlashInfer alike) see ordinary q/k/v and need no family knowledge; the one
thing they are told is a sliding window (Mistral), which they apply as a mask.

Plain functions over :class:`~.weights.LlamaWeights`; a forward pass runs over a flat
batch of new tokens (any mix of prefill chunks and decodes), writes their K/V into the
paged cache and attends through an :class:`~.attention.AttentionBackend` planned for the
step. After each layer an optional callback runs (the serving layer copies finished
blocks out of the cache there while later layers compute).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from .attention import AttentionBackend, BatchMeta
from ..base.model_config import ModelConfig
from .kv_cache import KVCache
from .weights import LlamaWeights

__all__ = ["LlamaModel", "rope_inv_freq", "rms_norm"]


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (float32) with the config's scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    factor = float(rs["factor"])
    if rs["rope_type"] == "linear":
        return inv / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between
    low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    ramp = (old / wavelen - low) / (high - low)
    smooth = (1 - ramp) * scaled / factor + ramp * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smooth, scaled)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Forward passes of a decoder (any supported family) over the paged KV cache."""

    def __init__(self, cfg: ModelConfig, weights: LlamaWeights) -> None:
        self.cfg = cfg
        self.w = weights
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.inv_freq = rope_inv_freq(cfg).to(self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    def forward(self, token_ids: torch.Tensor, meta: BatchMeta, cache: KVCache, attn: AttentionBackend,
                logits_rows: torch.Tensor | slice | None,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """Runs the new tokens of one step; returns float32 logits of ``logits_rows``
        (row indices into the flat batch; ``None`` skips the LM head)."""
        cfg, w = self.cfg, self.w
        t = token_ids.shape[0]
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qs, kvs = cfg.q_size, cfg.kv_size
        eps = cfg.rms_norm_eps
        x = w.embed[token_ids]
        cos, sin = self.rope(meta.positions)
        attn.plan(meta, cfg.sliding_window)
        for l, lw in enumerate(w.layers):
            h = rms_norm(x, lw.attn_norm, eps)
            qkv = F.linear(h, lw.qkv, lw.qkv_bias)
            q = qkv[:, :qs].view(t, nh, hd)
            k = qkv[:, qs:qs + kvs].view(t, nkv, hd)
            v = qkv[:, qs + kvs:].view(t, nkv, hd)
            if lw.q_norm is not None and lw.k_norm is not None:  # Qwen3: each head's q, k RMSNormed
                q = rms_norm(q, lw.q_norm, eps)
                k = rms_norm(k, lw.k_norm, eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            cache.write(l, meta.slots, k, v)
            o = attn.forward(q, cache.k(l), cache.v(l))
            x = x + F.linear(o.reshape(t, qs), lw.o, lw.o_bias)
            h = rms_norm(x, lw.mlp_norm, eps)
            gu = F.linear(h, lw.gate_up, lw.gate_up_bias)
            g, u = gu.chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, lw.down, lw.down_bias)
            if on_layer is not None:
                on_layer(l)
        if logits_rows is None:
            return None
        x = rms_norm(x[logits_rows], w.norm, eps)
        return F.linear(x, w.lm_head).float()
