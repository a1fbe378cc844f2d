"""The attention backend interface and the per-step batch description it plans from."""

from __future__ import annotations

from abc import ABC, abstractmethod
import array

import torch

__all__ = ["AttentionBackend", "BatchMeta"]


class BatchMeta:
    """One step's sequences, flattened (what every layer's attention needs).

    Sequence ``i`` contributes ``q_lens[i]`` new query tokens (rows
    ``qo_indptr[i]:qo_indptr[i+1]`` of the flat batch) and attends to ``kv_lens[i]`` tokens
    (cached ones plus the new ones, the new ones last) held in ``page_tables[i]``.
    ``slots`` (flat cache slot ``page * page_size + row`` of every new token) and
    ``positions`` are built at once; the CSR page tables in FlashInfer's convention
    (``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, int32) on first
    use, on the cache's device.
    """

    def __init__(self, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
                 device: torch.device, token_ids: list[int] | None = None) -> None:
        self.q_lens = q_lens
        self.kv_lens = kv_lens
        self.page_tables = page_tables
        self.page_size = page_size
        self.device = device
        self.is_decode = all(n == 1 for n in q_lens)
        self.num_tokens = sum(q_lens)
        p = page_size
        if self.is_decode:
            pos = [kv - 1 for kv in kv_lens]
            slots = [t[x // p] * p + x % p for t, x in zip(page_tables, pos)]
        else:
            pos, slots = [], []
            for n, kv, t in zip(q_lens, kv_lens, page_tables):
                r = range(kv - n, kv)
                pos.extend(r)
                slots.extend(t[x // p] * p + x % p for x in r)
        # page tables padded to the longest, for backends that gather whole pages
        self.max_pages = maxpg = -(-max(kv_lens) // p)
        flat = slots + pos + (token_ids if token_ids is not None else []) + kv_lens
        for kv, t in zip(kv_lens, page_tables):
            npg = -(-kv // p)
            flat.extend(t[:npg])
            if npg < maxpg:
                flat.extend([0] * (maxpg - npg))
        # one host-to-device copy for everything (array -> tensor is much cheaper than a list)
        packed = torch.frombuffer(array.array("q", flat), dtype=torch.long)
        if device.type != "cpu":
            packed = packed.to(device)
        t_, b_ = self.num_tokens, len(q_lens)
        self.slots = packed[:t_]
        self.positions = packed[t_:2 * t_]
        off = 2 * t_
        #: the new tokens' ids when given to the constructor
        self.token_ids = packed[off:off + t_] if token_ids is not None else None
        off += t_ if token_ids is not None else 0
        self.kv_lens_tensor = packed[off:off + b_]
        self.padded_tables = packed[off + b_:].view(b_, maxpg)
        self._csr: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def build(cls, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
              device: torch.device, token_ids: list[int] | None = None) -> "BatchMeta":
        return cls(q_lens, kv_lens, page_tables, page_size, device, token_ids)

    def _make_csr(self) -> tuple[torch.Tensor, ...]:
        if self._csr is None:
            qo, kvp, idx, last = [0], [0], [], []
            p = self.page_size
            for n, kv, table in zip(self.q_lens, self.kv_lens, self.page_tables):
                npg = -(-kv // p)
                qo.append(qo[-1] + n)
                kvp.append(kvp[-1] + npg)
                idx.extend(table[:npg])
                last.append(kv - (npg - 1) * p)
            dev, i32 = self.device, torch.int32
            self._csr = (torch.tensor(qo, dtype=i32, device=dev), torch.tensor(kvp, dtype=i32, device=dev),
                         torch.tensor(idx, dtype=i32, device=dev), torch.tensor(last, dtype=i32, device=dev))
        return self._csr

    @property
    def qo_indptr(self) -> torch.Tensor:  # int32 [B + 1]
        return self._make_csr()[0]

    @property
    def kv_indptr(self) -> torch.Tensor:  # int32 [B + 1], in pages
        return self._make_csr()[1]

    @property
    def kv_indices(self) -> torch.Tensor:  # int32 [sum of pages]
        return self._make_csr()[2]

    @property
    def kv_last_page_len(self) -> torch.Tensor:  # int32 [B], 1..page_size
        return self._make_csr()[3]


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
    def plan(self, meta: BatchMeta, window: int | None = None) -> None:
        """Prepares the step (index tensors, kernel plans); reused by every layer.

        ``window``: sliding-window attention (Mistral-style) where a query at position
        ``i`` sees keys ``i - window + 1 .. i``; ``None``: the whole causal prefix."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``q``: ``[T, heads, head_dim]``; caches ``[pages, page_size, kv_heads, head_dim]``
        (already holding this step's new K/V). Returns ``[T, heads, head_dim]``."""
