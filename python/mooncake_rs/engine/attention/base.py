"""The attention backend interface and the per-step batch description it plans from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

__all__ = ["AttentionBackend", "BatchMeta"]


@dataclass
class BatchMeta:
    """One step's sequences, flattened (what every layer's attention needs).

    Sequence ``i`` contributes ``q_lens[i]`` new query tokens (rows
    ``qo_indptr[i]:qo_indptr[i+1]`` of the flat batch) and attends to ``kv_lens[i]`` tokens
    (cached ones plus the new ones, the new ones last) held in ``page_tables[i]``.
    The tensors are CSR page tables in FlashInfer's convention, on the cache's device.
    """

    q_lens: list[int]
    kv_lens: list[int]
    page_tables: list[list[int]]
    page_size: int
    qo_indptr: torch.Tensor  # int32 [B + 1]
    kv_indptr: torch.Tensor  # int32 [B + 1], in pages
    kv_indices: torch.Tensor  # int32 [sum pages]
    kv_last_page_len: torch.Tensor  # int32 [B], 1..page_size
    slots: torch.Tensor  # int64 [T]: flat cache slot of every new token
    positions: torch.Tensor  # int64 [T]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.q_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @classmethod
    def build(cls, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
              device: torch.device) -> "BatchMeta":
        qo, kvp, idx, last, slots, pos = [0], [0], [], [], [], []
        for n, kv, table in zip(q_lens, kv_lens, page_tables):
            npg = -(-kv // page_size)
            qo.append(qo[-1] + n)
            kvp.append(kvp[-1] + npg)
            idx.extend(table[:npg])
            last.append(kv - (npg - 1) * page_size)
            for t in range(kv - n, kv):
                slots.append(table[t // page_size] * page_size + t % page_size)
            pos.extend(range(kv - n, kv))
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.long, device=device)
        return cls(q_lens, kv_lens, page_tables, page_size, torch.tensor(qo, **i32), torch.tensor(kvp, **i32),
                   torch.tensor(idx, **i32), torch.tensor(last, **i32), torch.tensor(slots, **i64),
                   torch.tensor(pos, **i64))


class AttentionBackend(ABC):
    """Paged attention over the KV cache. ``plan`` once per step, ``forward`` per layer."""

    name: str = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.scale = head_dim ** -0.5

    @abstractmethod
    def plan(self, meta: BatchMeta) -> None:
        """Prepares the step (index tensors, kernel plans); reused by every layer."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``q``: ``[T, heads, head_dim]``; caches ``[pages, page_size, kv_heads, head_dim]``
        (already holding this step's new K/V). Returns ``[T, heads, head_dim]``."""
