"""mooncake_rs: KVCache-centric, disaggregated LLM serving.

The core (hashing, block index, tiered store, transfer engine, conductor) is Rust; this
package is its Python API. ``import mooncake_rs`` never imports torch: the engine
(``mooncake_rs.engine``) imports it when first used.
"""

from __future__ import annotations

from . import _logging
from ._core import (
    Batch,
    Block,
    BlockCache,
    BlockIndex,
    Conductor,
    ConductorConfig,
    ConductorSnapshot,
    Decision,
    DecodeCostModel,
    DecodeLoad,
    IndexStats,
    Peer,
    PrefillCostModel,
    PrefillLoad,
    PrefixHasher,
    PrefixMatch,
    Region,
    ReplicationHint,
    Store,
    StoreEvent,
    StoreRegion,
    StoreStats,
    TransferCostModel,
    TransferEngine,
    TransferRegistry,
    TransferRequest,
    TransferStats,
    TransferStatus,
    WritableBlock,
    Xxh3RollingHasher,
    __version__,
)
from .errors import (
    BlockNotFound,
    InternalError,
    InvalidArgument,
    MalformedEvent,
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
    "Xxh3RollingHasher",
    "BlockIndex",
    "PrefixMatch",
    "IndexStats",
    # the conductor (global scheduler)
    "Conductor",
    "ConductorConfig",
    "Decision",
    "ReplicationHint",
    "ConductorSnapshot",
    "PrefillLoad",
    "DecodeLoad",
    "PrefillCostModel",
    "TransferCostModel",
    "DecodeCostModel",
    # tiered store
    "Store",
    "Block",
    "WritableBlock",
    "StoreEvent",
    "StoreStats",
    "StoreRegion",
    "BlockCache",
    # transfer engine
    "TransferEngine",
    "TransferRegistry",
    "TransferRequest",
    "TransferStatus",
    "TransferStats",
    "Region",
    "Peer",
    "Batch",
    # serving (lazy: see __getattr__)
    "Cluster",
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
    "MalformedEvent",
]


def __getattr__(name: str) -> object:
    # The engine imports torch: load it on first use only (``mooncake_rs.engine``).
    if name == "engine":
        import importlib

        return importlib.import_module(".engine", __name__)
    # The serving layer (Cluster) imports the engine, hence torch, when a Cluster is built.
    if name in ("Cluster", "serving"):
        import importlib

        serving = importlib.import_module(".serving", __name__)
        return serving if name == "serving" else serving.Cluster
    raise AttributeError(f"module 'mooncake_rs' has no attribute {name!r}")
