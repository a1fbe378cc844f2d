"""The byte layout of a store block: what the store, the serving layer and a client
need to size slots and address layers, without torch (the engine's :mod:`.kv_cache`
copies pages to and from this layout and re-exports these types)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidArgument

if TYPE_CHECKING:
    from .model_config import ModelConfig

__all__ = ["BlockLayout", "LayerSpan", "DTYPE_SIZES", "dtype_size"]

#: Bytes per element of each KV dtype the engine accepts (the names of
#: ``config.DTYPES``; ``weights.torch_dtype`` maps the same names to torch dtypes).
DTYPE_SIZES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_size(name: str) -> int:
    """Element size in bytes of the dtype called ``name``; ``InvalidArgument`` for
    any other name (the same message as the engine's)."""
    try:
        return DTYPE_SIZES[name]
    except (KeyError, TypeError):
        raise InvalidArgument(f"dtype must be float32, bfloat16 or float16, got {name!r}") from None


@dataclass(frozen=True)
class LayerSpan:
    """Where one layer's part of a block lives inside the block's bytes."""

    layer: int
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class BlockLayout:
    """The byte layout of one store block (the KV of ``block_size`` tokens, all layers).

    Layer ``l`` occupies bytes ``[l * layer_nbytes, (l + 1) * layer_nbytes)``. Inside a
    layer: K then V, each ``[block_size, num_kv_heads, head_dim]`` row-major (token-major,
    NHD) in ``dtype``. A partial block (fewer than ``block_size`` tokens) uses the same
    layout; rows past its token count are left as they were.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        for f in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if int(getattr(self, f)) <= 0:
                raise InvalidArgument(f"BlockLayout.{f} must be positive")
        dtype_size(self.dtype)

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: str) -> "BlockLayout":
        return cls(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)

    @property
    def dtype_size(self) -> int:
        return dtype_size(self.dtype)

    @property
    def token_nbytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * self.dtype_size

    @property
    def layer_nbytes(self) -> int:
        return 2 * self.block_size * self.token_nbytes

    @property
    def block_nbytes(self) -> int:
        return self.num_layers * self.layer_nbytes

    def layer_span(self, layer: int) -> LayerSpan:
        if not 0 <= layer < self.num_layers:
            raise InvalidArgument(f"layer {layer} out of range 0..{self.num_layers - 1}")
        return LayerSpan(layer, layer * self.layer_nbytes, self.layer_nbytes)

    def spans(self) -> list[LayerSpan]:
        return [self.layer_span(l) for l in range(self.num_layers)]
