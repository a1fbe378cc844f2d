"""The torch reference backend: gather the pages into padded K/V, then SDPA (CPU and CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionBackend, BatchMeta

__all__ = ["TorchAttention"]


class TorchAttention(AttentionBackend):
    """Paged gather + ``scaled_dot_product_attention`` with a causal mask per sequence.

    ``plan`` builds, once per step, the gather index ``[B, max_kv]`` of cache slots, the
    boolean mask ``[B, 1, max_q, max_kv]`` and the scatter positions of the flat queries
    in the padded ``[B, max_q]`` layout; each layer then runs one gather and one SDPA.
    """

    name = "torch"

    def plan(self, meta: BatchMeta) -> None:
        b = len(meta.q_lens)
        self.max_q = max_q = max(meta.q_lens)
        max_kv = max(meta.kv_lens)
        p = meta.page_size
        dev = self.device
        kv_pos = torch.arange(max_kv, device=dev)
        # gather slots: page_table[t // p] * p + t % p for t < kv_len, 0 beyond
        maxpg = -(-max_kv // p)
        rows = []
        for kv, t in zip(meta.kv_lens, meta.page_tables):
            npg = -(-kv // p)
            rows.append(list(t[:npg]) + [0] * (maxpg - npg))
        tables = torch.tensor(rows, dtype=torch.long, device=dev)
        self.kv_slots = tables.repeat_interleave(p, dim=1)[:, :max_kv] * p + (kv_pos % p)
        kv_len = torch.tensor(meta.kv_lens, device=dev)
        q_len = torch.tensor(meta.q_lens, device=dev)
        qi = torch.arange(max_q, device=dev)
        # query i of sequence s sits at position kv_len - q_len + i
        qpos = (kv_len - q_len)[:, None] + qi[None, :]  # [B, max_q]
        mask = kv_pos[None, None, :] <= qpos[:, :, None]  # causal
        mask &= kv_pos[None, None, :] < kv_len[:, None, None]
        mask[:, :, 0] |= qi[None, :] >= q_len[:, None]  # padded rows attend to one key: no NaN
        self.mask = mask[:, None]
        self.single = b == 1 and meta.q_lens[0] == meta.kv_lens[0]  # plain causal prompt
        seq = torch.repeat_interleave(torch.arange(b, device=dev), q_len)
        starts = meta.qo_indptr.to(torch.long)[:-1]
        self.row_seq = seq
        self.row_pos = torch.arange(meta.num_tokens, device=dev) - starts[seq]
        self.batch = b

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        h, d = self.num_kv_heads, self.head_dim
        kc = k_cache.reshape(-1, h, d)
        vc = v_cache.reshape(-1, h, d)
        k = kc[self.kv_slots].transpose(1, 2)  # [B, h, max_kv, d]
        v = vc[self.kv_slots].transpose(1, 2)
        if self.single:
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True,
                                                 scale=self.scale, enable_gqa=True)
            return out[0].transpose(0, 1)
        qp = q.new_zeros(self.batch, self.max_q, self.num_heads, d)
        qp[self.row_seq, self.row_pos] = q
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), k, v, attn_mask=self.mask,
                                             scale=self.scale, enable_gqa=True)
        return out.transpose(1, 2)[self.row_seq, self.row_pos]
