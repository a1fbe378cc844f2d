"""KV layouts for the simulator: how many bytes a token's KV takes, from the model's
attention layout rather than a hard-coded constant.

``SimConfig(layout=...)`` accepts anything with ``block_size`` and ``block_nbytes``
(bytes of one block of ``block_size`` tokens, every layer): the engine's
:class:`~mooncake_rs.engine.layout.BlockLayout` (MHA/GQA: K and V per KV head) or
:class:`MLALayout` below (one compressed latent plus a decoupled rope key per token per
layer, as in DeepSeek-V2/V3). The simulator derives ``bytes_per_token =
block_nbytes / block_size`` for the conductor's transfer model and the true one, so
fetches, SSD reads and KV streams all move the layout's bytes.

MLA lives here, not in ``engine/layout.py`` (the engine's file, torch-free, MHA/GQA
only): the engine has no MLA attention yet. What ``engine/layout.py`` would need to
gain for it: a per-layer width that is not ``2 * kv_heads * head_dim`` (one latent row
of ``latent_dim + rope_dim`` per token, no separate K and V), i.e. ``token_nbytes``
computed by a layout kind, and ``layer_span`` using it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import InvalidArgument

__all__ = ["KVLayout", "MLALayout", "bytes_per_token", "describe"]

_DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


class KVLayout(Protocol):
    """What the simulator reads from a layout."""

    @property
    def block_size(self) -> int: ...

    @property
    def block_nbytes(self) -> int: ...


@dataclass(frozen=True)
class MLALayout:
    """Multi-head latent attention: per token per layer one latent vector of
    ``latent_dim`` and a rope key of ``rope_dim``, in ``dtype`` (no separate K and V,
    no per-head copies). DeepSeek-V3: 61 layers, 512 + 64, bf16 = 70,272 bytes a token
    (LLaMA3-70B's GQA: 327,680)."""

    num_layers: int
    block_size: int
    latent_dim: int = 512
    rope_dim: int = 64
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for f in ("num_layers", "block_size", "latent_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidArgument(f"MLALayout.{f} must be a positive integer, got {v!r}")
        if isinstance(self.rope_dim, bool) or not isinstance(self.rope_dim, int) or self.rope_dim < 0:
            raise InvalidArgument(f"MLALayout.rope_dim must be an integer >= 0, got {self.rope_dim!r}")
        if self.dtype not in _DTYPE_SIZES:
            raise InvalidArgument(f"MLALayout.dtype must be one of {', '.join(_DTYPE_SIZES)}, got {self.dtype!r}")

    @property
    def token_nbytes(self) -> int:
        """Bytes of one token's latent row in one layer."""
        return (self.latent_dim + self.rope_dim) * _DTYPE_SIZES[self.dtype]

    @property
    def layer_nbytes(self) -> int:
        return self.block_size * self.token_nbytes

    @property
    def block_nbytes(self) -> int:
        return self.num_layers * self.layer_nbytes


def bytes_per_token(layout: Any) -> float:
    """KV bytes of one token, all layers; ``InvalidArgument`` for what is not a layout."""
    try:
        bs, nb = layout.block_size, layout.block_nbytes
    except AttributeError:
        raise InvalidArgument(
            f"layout must have block_size and block_nbytes (a BlockLayout or an MLALayout), got {type(layout).__name__}"
        ) from None
    if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0 or not isinstance(nb, int) or nb <= 0:
        raise InvalidArgument(f"layout block_size and block_nbytes must be positive integers, got {bs!r}, {nb!r}")
    return nb / bs


def describe(layout: Any) -> dict[str, Any]:
    """A JSON-friendly view of a layout (for ``Report.config``)."""
    out: dict[str, Any] = {"kind": type(layout).__name__, "bytes_per_token": bytes_per_token(layout)}
    for f in ("num_layers", "block_size", "num_kv_heads", "head_dim", "latent_dim", "rope_dim", "dtype"):
        if hasattr(layout, f):
            out[f] = getattr(layout, f)
    return out
