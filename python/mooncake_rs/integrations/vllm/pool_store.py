"""The connector's store adapter for the cluster-wide pool (``mooncake_rs.DistributedStore``,
docs/store-service.md), chosen by ``kv_connector_extra_config.store = "pool"``.

One pool object a block: key ``<namespace>/<128-bit block hash in hex>`` (the namespace
carries the model's KV dtypes and block size, config.py), value every layer's segments of
the block in pool-block order (layout.py: the bytes a KV-pool slot holds) followed by the
block's CRC-32 (4 bytes, little-endian), taken over those bytes when saved. Values move
straight between vLLM's KV tensors and the pool nodes (``batch_put_from`` /
``batch_get_into`` with one piece a segment; the tensors are registered with the pool
once), so there is no staging copy; the checksum is checked after every load, so a block
changed in the pool (or a different layout under the same key) is reported to vLLM and
recomputed, never used.

What the pool does not have that a KV pool has: leases taken at lookup (a block the
scheduler counted can be evicted before the worker reads it: the read then fails, the
block is reported and recomputed) and store events (no block index, no KV events from
``take_events``: every instance asks the pool itself, one ``batch_exists`` a request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._core import BlockHashes
from ...pool.client import DistributedStore
from ...pool.status import KeyStatus
from .config import ConnectorSettings

__all__ = ["PoolBlocks", "TRAILER_BYTES"]

#: the CRC-32 after a block's bytes in its pool value
TRAILER_BYTES = 4


def block_keys(keys: BlockHashes | bytes | Sequence[int]) -> list[int]:
    """128-bit block keys as ints, from BlockHashes, their 16-byte-a-key bytes, or ints."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        return BlockHashes(bytes(keys)).tolist()
    if isinstance(keys, BlockHashes):
        return keys.tolist()
    return [int(k) for k in keys]


class PoolBlocks:
    """KV blocks in a ``DistributedStore``, under one namespace."""

    def __init__(self, store: DistributedStore, namespace: str, *, replicas: int = 1) -> None:
        self.store = store
        self.namespace = namespace.rstrip("/")
        self.replicas = replicas

    @classmethod
    def open(cls, settings: ConnectorSettings) -> "PoolBlocks":
        """Connects to the pool's store nodes registered in ``settings.etcd``."""
        from ...client.records import cluster_prefix

        assert settings.etcd is not None  # ConnectorSettings requires it with store "pool"
        transports = settings.transports or ("tcp", "shm")
        store = DistributedStore.connect(settings.etcd, auth_token=settings.auth_token,
                                         prefix=cluster_prefix(settings.cluster), timeout_s=max(10.0, settings.timeout_s),
                                         io_timeout_s=settings.timeout_s, transports=tuple(transports))
        return cls(store, settings.namespace, replicas=settings.replicas)

    def key(self, k: int) -> str:
        return f"{self.namespace}/{k:032x}"

    def leading(self, keys: BlockHashes | bytes | Sequence[int]) -> int:
        """How many of the leading ``keys`` the pool holds (a prefix is usable up to its
        first missing block)."""
        ks = block_keys(keys)
        if not ks:
            return 0
        held = self.store.batch_exists([self.key(k) for k in ks])
        n = 0
        for h in held:
            if not h:
                break
            n += 1
        return n

    def register(self, ptr: int, size: int) -> None:
        """Memory read and written in place by puts and gets (vLLM's KV storages)."""
        self.store.register_buffer(ptr, size)

    def put(self, keys: Sequence[int], ptrs: list[list[int]], sizes: list[list[int]]) -> list[KeyStatus]:
        """Stores each block from its pieces (put-if-absent: a block already there is OK)."""
        return self.store.batch_put_from([self.key(k) for k in keys], ptrs, sizes, replicas=self.replicas)

    def get(self, keys: Sequence[int], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Reads each block into its pieces: its size, or a negative KeyStatus."""
        return self.store.batch_get_into([self.key(k) for k in keys], ptrs, sizes)

    def remove(self, keys: Sequence[int]) -> list[bool]:
        return self.store.batch_remove([self.key(k) for k in keys])

    def close(self) -> None:
        self.store.close()

    def __repr__(self) -> str:
        return f"PoolBlocks({self.namespace!r}, {self.store!r})"


def pieces_of(layers: Sequence[Any], block_id: int, trailer_ptr: int) -> tuple[list[int], list[int]]:
    """(addresses, sizes) of block ``block_id``'s value: each layer's segments in pool
    order, then its 4-byte checksum at ``trailer_ptr``."""
    ptrs: list[int] = []
    sizes: list[int] = []
    for layer in layers:
        for off in layer.segments(block_id):
            ptrs.append(layer.storage_ptr + off)
            sizes.append(layer.segment_bytes)
    ptrs.append(trailer_ptr)
    sizes.append(TRAILER_BYTES)
    return ptrs, sizes
