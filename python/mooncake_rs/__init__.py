"""mooncake_rs: KVCache-centric, disaggregated LLM serving.

The core (hashing, block index, tiered store, transfer engine, conductor) is Rust; this
package is its Python API. ``import mooncake_rs`` never imports torch: the engine
(``mooncake_rs.engine``) imports it when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _logging
from ._core import (
    AppliedEvents,
    Batch,
    BatchCompletion,
    Block,
    BlockCache,
    BlockHashes,
    BlockIndex,
    CompletionQueue,
    Conductor,
    ConductorConfig,
    ConductorSnapshot,
    Decision,
    DecodeCostModel,
    DecodeLoad,
    IndexStats,
    LeasedRun,
    LinkLoad,
    Peer,
    PrefillCostModel,
    PrefillLoad,
    PrefixHasher,
    PrefixMatch,
    Region,
    ReplicationHint,
    Store,
    StoreEvent,
    StoreEvents,
    StoreRegion,
    StoreStats,
    TransferCostModel,
    TransferEngine,
    TransferGrant,
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
    ServiceUnavailable,
    StoreFull,
    StoreIOError,
    TransferFailed,
    TransferTimeout,
    Unauthorized,
)
from .errors import __all__ as _error_names

if TYPE_CHECKING:  # loaded on first access (see __getattr__); torch-free either way
    from .base.model_config import ModelConfig
    from .base.layout import BlockLayout
    from .base.outputs import RequestOutput
    from .base.params import SamplingParams

_logging.configure()

#: client types (torch-free modules of the engine package), loaded on first access
_CLIENT_TYPES = {"SamplingParams": ".base.params", "RequestOutput": ".base.outputs",
                 "BlockLayout": ".base.layout", "ModelConfig": ".base.model_config"}

__all__ = [
    "__version__",
    # hashing and the index
    "PrefixHasher",
    "BlockHashes",
    "Xxh3RollingHasher",
    "BlockIndex",
    "PrefixMatch",
    "IndexStats",
    # the conductor (global scheduler)
    "Conductor",
    "ConductorConfig",
    "Decision",
    "LinkLoad",
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
    "LeasedRun",
    "StoreEvent",
    "StoreEvents",
    "AppliedEvents",
    "StoreStats",
    "StoreRegion",
    "BlockCache",
    # transfer engine
    "TransferEngine",
    "TransferGrant",
    "TransferRegistry",
    "TransferRequest",
    "TransferStatus",
    "TransferStats",
    "Region",
    "Peer",
    "Batch",
    "CompletionQueue",
    "BatchCompletion",
    # serving (lazy: see __getattr__)
    "Cluster",
    # the cluster-wide KV pool (lazy: see __getattr__; docs/store-service.md)
    "DistributedStore",
    # errors: every class of the exception tree (named once, in errors.py)
    *_error_names,
    # client types (torch-free; lazy: see __getattr__)
    "SamplingParams",
    "RequestOutput",
    "BlockLayout",
    "ModelConfig",
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
    # The cluster-wide pool sits above this package's core (nothing below imports it).
    if name == "DistributedStore":
        import importlib

        return importlib.import_module(".pool", __name__).DistributedStore
    if name in _CLIENT_TYPES:
        import importlib

        return getattr(importlib.import_module(_CLIENT_TYPES[name], __name__), name)
    raise AttributeError(f"module 'mooncake_rs' has no attribute {name!r}")
