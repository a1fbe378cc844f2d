"""The torch reference backend: gather the pages into padded K/V, then SDPA (CPU and CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionBackend, BatchMeta

__all__ = ["TorchAttention"]


class TorchAttention(AttentionBackend):
    """Paged gather + ``scaled_dot_product_attention`` with a causal mask per sequence.

    ``plan`` builds, once per step, the page gather index ``[B, max_pages]``, the
    boolean mask ``[B, 1, max_q, max_kv]`` and the scatter positions of the flat queries
    in the padded ``[B, max_q]`` layout; each layer then runs one gather and one SDPA.
    """

    name = "torch"
    _ar: torch.Tensor | None = None

    def _arange(self, n: int) -> torch.Tensor:
        """A cached ``arange`` of at least ``n`` (plan runs every step)."""
        if self._ar is None or self._ar.numel() < n:
            self._ar = torch.arange(max(n, 1024), device=self.device)
        return self._ar

    def plan(self, meta: BatchMeta, window: int | None = None) -> None:
        b = len(meta.q_lens)
        self.max_q = max_q = max(meta.q_lens)
        max_kv = max(meta.kv_lens)
        p = meta.page_size
        dev = self.device
        maxpg = meta.max_pages
        tables, kv_len = meta.padded_tables, meta.kv_lens_tensor
        # gather whole pages: keys [B, maxpg * p]; rows past kv_len are masked
        self.tables = tables
        max_kv = maxpg * p
        ar = self._arange(max(max_kv, max_q))
        kv_pos = ar[:max_kv]
        self.batch = b
        self.decode = meta.is_decode
        # one plain causal prompt filling its pages exactly (and inside the window): no mask needed
        self.single = (b == 1 and meta.q_lens[0] == meta.kv_lens[0] == max_kv
                       and (window is None or max_kv <= window))
        if self.decode:
            live = kv_pos[None, :] < kv_len[:, None]
            if window is not None:  # the query sits at kv_len - 1
                live &= kv_pos[None, :] >= (kv_len - window)[:, None]
            self.mask = live[:, None, None, :]
            return
        q_len = torch.tensor(meta.q_lens, device=dev)
        qi = ar[:max_q]
        # query i of sequence s sits at position kv_len - q_len + i
        qpos = (kv_len - q_len)[:, None] + qi[None, :]  # [B, max_q]
        mask = kv_pos[None, None, :] <= qpos[:, :, None]  # causal (and inside kv_len)
        if window is not None:
            mask &= kv_pos[None, None, :] > qpos[:, :, None] - window
        mask[:, :, 0] |= qi[None, :] >= q_len[:, None]  # padded rows attend to one key: no NaN
        self.mask = mask[:, None]
        seq = torch.repeat_interleave(torch.arange(b, device=dev), q_len)
        starts = torch.cumsum(q_len, 0) - q_len
        self.row_seq = seq
        self.row_pos = torch.arange(meta.num_tokens, device=dev) - starts[seq]

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        h, d = self.num_kv_heads, self.head_dim
        b = self.batch
        k = k_cache[self.tables].view(b, -1, h, d).transpose(1, 2)  # [B, h, maxpg * p, d]
        v = v_cache[self.tables].view(b, -1, h, d).transpose(1, 2)
        if self.decode:
            out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=self.mask,
                                                 scale=self.scale, enable_gqa=True)
            return out[:, :, 0, :]
        if self.single:
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True,
                                                 scale=self.scale, enable_gqa=True)
            return out[0].transpose(0, 1)
        qp = q.new_zeros(self.batch, self.max_q, self.num_heads, d)
        qp[self.row_seq, self.row_pos] = q
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), k, v, attn_mask=self.mask,
                                             scale=self.scale, enable_gqa=True)
        return out.transpose(1, 2)[self.row_seq, self.row_pos]
