"""FlashInfer paged attention (CUDA only; ``flashinfer`` imported lazily).

A step whose sequences all add one token uses ``BatchDecodeWithPagedKVCacheWrapper``;
any other step (prefill chunks, possibly mixed with decodes) uses
``BatchPrefillWithPagedKVCacheWrapper`` with a causal mask (FlashInfer aligns the new
queries with the last ``q_len`` keys). Each wrapper is planned once per step and run by
every layer on the NHD caches ``(k_cache, v_cache)``. A sliding window becomes the
wrappers' ``window_left``.
"""

from __future__ import annotations

import torch

from ...errors import InvalidArgument
from .base import AttentionBackend, BatchMeta

__all__ = ["FlashInferAttention", "flashinfer_available"]

_WORKSPACE_BYTES = 256 * 1024 * 1024


def flashinfer_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, dtype, device)
        if device.type != "cuda":
            raise InvalidArgument("the flashinfer attention backend needs a CUDA device")
        import flashinfer

        self._ws = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._ws, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._ws, "NHD", use_tensor_cores=(num_heads // num_kv_heads) >= 4)
        self._active = self._decode

    def plan(self, meta: BatchMeta, window: int | None = None) -> None:
        # FlashInfer's window_left is inclusive (keys i - window_left .. i): window - 1 keys back
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype,
                      window_left=-1 if window is None else window - 1)
        if meta.is_decode:
            self._decode.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, self.num_heads,
                              self.num_kv_heads, self.head_dim, meta.page_size, **common)
            self._active = self._decode
        else:
            self._prefill.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                               self.num_heads, self.num_kv_heads, self.head_dim, meta.page_size,
                               causal=True, **common)
            self._active = self._prefill

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return self._active.run(q.contiguous(), (k_cache, v_cache))
