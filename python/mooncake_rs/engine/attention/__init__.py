"""Attention backends behind one interface (:class:`AttentionBackend`)."""

from __future__ import annotations

import logging

import torch

from ..backend_choice import BACKENDS, choose_backend
from .base import AttentionBackend, BatchMeta
from .flashinfer_backend import FlashInferAttention, flashinfer_available
from .torch_ref import TorchAttention

__all__ = ["AttentionBackend", "BatchMeta", "TorchAttention", "FlashInferAttention",
           "flashinfer_available", "make_backend", "BACKENDS", "choose_backend"]

log = logging.getLogger("mooncake_rs.engine")

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def make_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, page_size: int = 16) -> AttentionBackend:
    """The backend :func:`~mooncake_rs.engine.backend_choice.choose_backend` picks:
    ``"auto"`` is FlashInfer only where its kernels support the device, dtype, head dim
    and page size, else torch (one log line says why); ``"flashinfer"`` with anything
    unsupported raises ``InvalidArgument`` naming it."""
    dtype_name = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    # flashinfer is imported only when it could be used (importing it is slow)
    fi = device.type == "cuda" and name != "torch" and flashinfer_available()
    chosen, reason = choose_backend(name, device.type, dtype_name, head_dim, page_size, fi)
    if name == "auto" and chosen == "torch" and device.type == "cuda":
        log.info("attention: %s", reason)  # a CUDA engine on the slow path: say why once
    else:
        log.debug("attention: %s", reason)
    if chosen == "flashinfer":
        return FlashInferAttention(num_heads, num_kv_heads, head_dim, dtype, device)
    return TorchAttention(num_heads, num_kv_heads, head_dim, dtype, device)
