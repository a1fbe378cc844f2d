"""A cluster-wide KV pool of objects (string key -> bytes): store nodes contribute DRAM and
SSD (``mooncake-rs store``), clients put and get through ``DistributedStore``. The
Mooncake-Store-compatible facade (``mooncake_rs.compat``) is built on this package.

See docs/store-service.md.
"""

from __future__ import annotations

from .client import DistributedStore
from .metrics import PoolMetrics
from .segment import ObjectSegment
from .status import KeyStatus

__all__ = ["DistributedStore", "ObjectSegment", "KeyStatus", "PoolMetrics"]
