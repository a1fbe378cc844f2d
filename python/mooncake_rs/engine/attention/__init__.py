"""Attention backends behind one interface (:class:`AttentionBackend`)."""

from __future__ import annotations

import torch

from ...errors import InvalidArgument
from .base import AttentionBackend, BatchMeta
from .flashinfer_backend import FlashInferAttention, flashinfer_available
from .torch_ref import TorchAttention

__all__ = ["AttentionBackend", "BatchMeta", "TorchAttention", "FlashInferAttention",
           "flashinfer_available", "make_backend", "BACKENDS"]

BACKENDS = ("auto", "torch", "flashinfer")


def make_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> AttentionBackend:
    """``"auto"``: FlashInfer when the device is CUDA and flashinfer imports, else torch."""
    if name not in BACKENDS:
        raise InvalidArgument(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" and flashinfer_available() else "torch"
    if name == "flashinfer":
        if not flashinfer_available():
            raise InvalidArgument("attention_backend='flashinfer' needs CUDA and the flashinfer package "
                                  "(pip install mooncake-rs[gpu])")
        return FlashInferAttention(num_heads, num_kv_heads, head_dim, dtype, device)
    return TorchAttention(num_heads, num_kv_heads, head_dim, dtype, device)
