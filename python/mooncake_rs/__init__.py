"""mooncake_rs: KVCache-centric, disaggregated LLM serving.

The core (hashing, block index, tiered store, transfer engine, conductor) is Rust; this
package is its Python API. ``import mooncake_rs`` never imports torch: the engine
(``mooncake_rs.engine``) imports it when first used.
"""

from __future__ import annotations

from . import _logging
from ._core import BlockIndex, IndexStats, PrefixHasher, PrefixMatch, __version__
from ._core import (
    Batch,
    Peer,
    Region,
    TransferEngine,
    TransferRegistry,
    TransferRequest,
    TransferStats,
    TransferStatus,
)
from .errors import (
    BlockNotFound,
    InternalError,
    InvalidArgument,
    MooncakeError,
    Overloaded,
    StoreFull,
    StoreIOError,
    TransferFailed,
    TransferTimeout,
)

_logging.configure()

__all__ = [
    "__version__",
    # hashing and the index
    "PrefixHasher",
    "BlockIndex",
    "PrefixMatch",
    "IndexStats",
    # transfer engine
    "TransferEngine",
    "TransferRegistry",
    "TransferRequest",
    "TransferStatus",
    "TransferStats",
    "Region",
    "Peer",
    "Batch",
    # errors
    "MooncakeError",
    "InvalidArgument",
    "StoreFull",
    "BlockNotFound",
    "StoreIOError",
    "TransferFailed",
    "TransferTimeout",
    "Overloaded",
    "InternalError",
]
