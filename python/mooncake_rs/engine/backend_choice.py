"""Which attention backend and which default dtype an engine gets (pure functions).

Kept apart from the backends themselves and free of torch, so the decision (data in,
data out) is tested on any machine, CUDA or not: the caller supplies what it knows about
the device and about whether ``flashinfer`` imports.

FlashInfer compiles its paged prefill and decode kernels for half-precision inputs only
(no float32 kernels) and for head dims 64, 128 and 256. Its wrappers take the page size at
run time; the engine vouches only for powers of two up to 128 (the default page size,
``gcd(block_size, 16)``, is always one of them), and falls back to torch for any other.
"""

from __future__ import annotations

from ..errors import InvalidArgument
from ..base.model_config import DTYPES

__all__ = ["BACKENDS", "FLASHINFER_DTYPES", "FLASHINFER_HEAD_DIMS", "FLASHINFER_PAGE_SIZES",
           "flashinfer_unsupported", "choose_backend", "default_dtype", "resolve_dtype"]

#: names accepted as ``attention_backend``.
BACKENDS = ("auto", "torch", "flashinfer")
#: dtypes FlashInfer has kernels for (q and KV in the same dtype).
FLASHINFER_DTYPES = ("bfloat16", "float16")
#: head dims FlashInfer's prefill and decode kernels are compiled for.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
#: page sizes the engine uses FlashInfer with.
FLASHINFER_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def flashinfer_unsupported(device_type: str, dtype_name: str, head_dim: int, page_size: int,
                           flashinfer_available: bool) -> list[str]:
    """What stops FlashInfer from running this configuration, one phrase per reason, each
    naming what is unsupported and what is supported (empty: FlashInfer can run it)."""
    why = []
    if device_type != "cuda":
        why.append(f"device {device_type!r} is not CUDA (FlashInfer runs on CUDA only)")
    elif not flashinfer_available:
        why.append("the flashinfer package does not import (pip install mooncake-rs[gpu])")
    if dtype_name not in FLASHINFER_DTYPES:
        why.append(f"dtype {dtype_name} has no FlashInfer kernels (supported: {', '.join(FLASHINFER_DTYPES)})")
    if head_dim not in FLASHINFER_HEAD_DIMS:
        why.append(f"head_dim {head_dim} has no FlashInfer kernels "
                   f"(supported: {', '.join(map(str, FLASHINFER_HEAD_DIMS))})")
    if page_size not in FLASHINFER_PAGE_SIZES:
        why.append(f"page_size {page_size} is not supported with FlashInfer "
                   f"(supported: {', '.join(map(str, FLASHINFER_PAGE_SIZES))})")
    return why


def choose_backend(requested: str, device_type: str, dtype_name: str, head_dim: int, page_size: int,
                   flashinfer_available: bool) -> tuple[str, str]:
    """``(backend name, reason)`` for an ``attention_backend`` request.

    ``"auto"`` gives ``"flashinfer"`` when :func:`flashinfer_unsupported` finds nothing,
    else ``"torch"`` with the reasons (the engine logs them). ``"flashinfer"`` asked for
    with anything unsupported raises :class:`InvalidArgument` listing every reason;
    ``"torch"`` is always granted. Any other name raises :class:`InvalidArgument`.
    """
    if requested not in BACKENDS:
        raise InvalidArgument(f"attention_backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "torch":
        return "torch", "attention_backend='torch' was asked for"
    why = flashinfer_unsupported(device_type, dtype_name, head_dim, page_size, flashinfer_available)
    if requested == "flashinfer":
        if why:
            raise InvalidArgument("attention_backend='flashinfer' cannot run this configuration: "
                                  + "; ".join(why) + " (use attention_backend='torch' or 'auto')")
        return "flashinfer", "attention_backend='flashinfer' was asked for"
    if why:
        return "torch", "auto chose torch: " + "; ".join(why)
    return "flashinfer", (f"auto chose flashinfer: CUDA, {dtype_name}, head_dim {head_dim}, "
                          f"page_size {page_size}")


def default_dtype(device_type: str) -> str:
    """The engine's dtype when none is given: ``bfloat16`` on CUDA (what the FlashInfer
    kernels and the tensor cores take), ``float32`` elsewhere (CPU matmuls in half
    precision are slow and the CPU tests compare against float32 references)."""
    return "bfloat16" if device_type == "cuda" else "float32"


def resolve_dtype(requested: str | None, device_type: str) -> str:
    """``requested`` when given (it must be a supported dtype name), else
    :func:`default_dtype` for the device."""
    if requested is None:
        return default_dtype(device_type)
    if requested not in DTYPES:
        raise InvalidArgument(f"dtype must be one of {DTYPES} (or None for the device's default), "
                              f"got {requested!r}")
    return requested
