"""``MooncakeDistributedStore`` and ``ReplicateConfig`` with Mooncake Store's method names,
signatures and integer return codes, over ``mooncake_rs.pool.DistributedStore``.

What the integrations read (vLLM's MooncakeStoreConnector, SGLang HiCache's mooncake
backend, LMCache's mooncakestore connector): ``0`` for a stored put (also when the key
was already there: put-if-absent, as Mooncake), the byte count for a read, ``-200`` when
there is no room, ``-704`` for a missing key, ``1``/``0`` from ``is_exist``, ``b''`` from
``get`` of a missing key. The differences that remain are listed in
docs/store-service.md.

No call raises on a bad key or a missing object: like the native module, errors are
return codes (and a log line), so an integration's own error handling runs unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import MooncakeError
from ..pool import DistributedStore, KeyStatus
from .config import (SetupConfig, auth_token_from_env, etcd_url_of, plaintext_from_env, pool_prefix,
                     spin_us_from_env, tcp_connections_from_env, transports_from_env)

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "ReplicaDescriptor"]

log = logging.getLogger("mooncake_rs.compat")

OK = 0
INVALID_PARAMS = int(KeyStatus.INVALID)
OBJECT_NOT_FOUND = int(KeyStatus.MISSING)
NOT_SET_UP = -1  # the native module's "client not initialized"


class ReplicateConfig:
    """Mooncake's put options. ``replica_num`` copies on distinct nodes; ``with_hard_pin``:
    never evicted. The other fields are accepted and kept (placement hints our
    rendezvous placement does not need)."""

    replica_num: int = 1
    with_hard_pin: bool = False
    with_soft_pin: bool = False
    soft_pin_ttl_ms: int = 0
    preferred_segment: str = ""
    preferred_segments: list = []
    prefer_alloc_in_same_node: bool = False
    group_ids: list = []

    def __init__(self) -> None:
        self.preferred_segments = []
        self.group_ids = []

    def __repr__(self) -> str:
        return f"ReplicateConfig(replica_num={self.replica_num}, with_hard_pin={self.with_hard_pin})"


class ReplicaDescriptor:
    """What ``batch_get_replica_desc`` returns per replica (vLLM's tier logging asks)."""

    def __init__(self, tier: str) -> None:
        self._tier = tier

    def is_memory_replica(self) -> bool:
        return self._tier == "memory"

    def is_disk_replica(self) -> bool:
        return self._tier == "disk"


def _opts(config: ReplicateConfig | None) -> tuple[int, bool]:
    if config is None:
        return 1, False
    return max(1, int(getattr(config, "replica_num", 1) or 1)), bool(getattr(config, "with_hard_pin", False))


def _addr(value: Any) -> tuple[np.ndarray, int]:
    arr = np.frombuffer(memoryview(value).cast("B"), dtype=np.uint8)
    return arr, (arr.ctypes.data if arr.size else 0)


class MooncakeDistributedStore:
    def __init__(self) -> None:
        self._store: DistributedStore | None = None
        self.hostname = ""

    # ---- setup
    def setup(self, local_hostname: Any = None, metadata_server: str | None = None,
              global_segment_size: int = 16 << 20, local_buffer_size: int = 16 << 20, protocol: str = "tcp",
              rdma_devices: str = "", master_server_addr: str = "127.0.0.1:50051", engine: Any = None,
              enable_ssd_offload: bool = False, ssd_offload_path: str = "", tenant_id: str = "default",
              enable_client_http_server: bool = False, client_http_port: int = 9300) -> int:
        if isinstance(local_hostname, dict):
            cfg = SetupConfig.from_dict(local_hostname)
        elif local_hostname is None and metadata_server is None:
            cfg = SetupConfig.from_env() or SetupConfig()
        else:
            cfg = SetupConfig(local_hostname=str(local_hostname or "localhost"),
                              metadata_server=str(metadata_server or ""),
                              global_segment_size=int(global_segment_size),
                              local_buffer_size=int(local_buffer_size), protocol=str(protocol),
                              device_name=str(rdma_devices or ""), master_server_address=str(master_server_addr),
                              enable_ssd_offload=bool(enable_ssd_offload), ssd_offload_path=str(ssd_offload_path or ""))
        return self._open(cfg)

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Mooncake's "dummy client" of a standalone store process: here, a client of the
        deployment whose etcd ``server_address`` names (``etcd://HOST:PORT``)."""
        return self._open(SetupConfig(global_segment_size=0, local_buffer_size=int(local_buffer_size),
                                      master_server_address=str(server_address)))

    def init_all(self, protocol: str = "tcp", device_name: str = "", mount_segment_size: int = 16 << 20) -> int:
        """The old one-call setup: an embedded pool of ``mount_segment_size`` bytes, or the
        deployment named by ``MOONCAKE_CONFIG_PATH``."""
        cfg = SetupConfig.from_env() or SetupConfig(global_segment_size=int(mount_segment_size))
        return self._open(cfg)

    def _open(self, cfg: SetupConfig) -> int:
        if self._store is not None:
            return OK
        try:
            etcd = etcd_url_of(cfg)
            if etcd is not None:
                plain = plaintext_from_env()
                self._store = DistributedStore.connect(etcd, auth_token=None if plain else auth_token_from_env(),
                                                       prefix=pool_prefix(), transports=transports_from_env(),
                                                       tcp_connections=tcp_connections_from_env(),
                                                       plaintext=plain, spin_us=spin_us_from_env())
            else:
                if cfg.global_segment_size <= 0:
                    log.error("an embedded pool needs global_segment_size > 0 (or an etcd:// metadata_server "
                              "naming a deployment of `mooncake-rs store` nodes)")
                    return INVALID_PARAMS
                ssd = cfg.ssd_offload_path if cfg.enable_ssd_offload and cfg.ssd_offload_path else None
                self._store = DistributedStore.embedded(cfg.global_segment_size, ssd_path=ssd,
                                                        ssd_bytes=4 * cfg.global_segment_size if ssd else 0)
        except MooncakeError as e:
            log.error("MooncakeDistributedStore.setup failed: %s", e)
            return INVALID_PARAMS if "InvalidArgument" in type(e).__name__ else int(KeyStatus.RPC_FAILED)
        self.hostname = cfg.local_hostname
        return OK

    @property
    def pool(self) -> DistributedStore:
        """The ``DistributedStore`` under the facade (after ``setup``)."""
        if self._store is None:
            raise RuntimeError("MooncakeDistributedStore.setup() has not been called")
        return self._store

    # ---- bytes API
    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """``put_batch([key], [value], config)``, through the store's single-key path."""
        store = self._store
        if store is None:
            return NOT_SET_UP
        try:  # (an empty value or a bad key: InvalidArgument from put_status)
            replicas, pin = _opts(config)
            return int(store.put_status(key, value, replicas, pin))
        except (MooncakeError, TypeError, ValueError) as e:
            log.error("put of %r failed: %s", key, e)
            return INVALID_PARAMS

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None) -> int:
        if self._store is None:
            return NOT_SET_UP
        if len(keys) != len(values):
            return INVALID_PARAMS
        try:  # (an empty value or a bad key: InvalidArgument from batch_put_values)
            replicas, pin = _opts(config)
            res = self._store.batch_put_values(keys, values, replicas=replicas, pin=pin)
        except (MooncakeError, TypeError, ValueError) as e:
            log.error("put of %d keys failed: %s", len(keys), e)
            return INVALID_PARAMS
        for r in res:
            if r != OK:
                return int(r)
        return OK

    def get(self, key: str) -> bytes:
        """``get_batch([key])[0]``, through the store's single-key path."""
        store = self._store
        if store is None:
            return b""
        try:
            value = store.get_or_none(key)
        except MooncakeError:
            return b""
        return value if value is not None else b""

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """Each value, ``b''`` for a key that is missing or could not be read (Mooncake)."""
        if self._store is None:
            return [b""] * len(keys)
        try:
            return [v if v is not None else b"" for v in self._store.batch_get_bytes(keys)]
        except MooncakeError:
            return [b""] * len(keys)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """One value made of several buffers, stored as their concatenation (LMCache
        writes a metadata header and the KV bytes this way)."""
        if self._store is None:
            return NOT_SET_UP
        held = [_addr(p) for p in parts]
        if not held or sum(a.size for a, _ in held) == 0:
            return INVALID_PARAMS
        live = [(a, p) for a, p in held if a.size]
        return self._batch_put([key], [[p for _, p in live]], [[a.size for a, _ in live]], config)[0]

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Replaces the value (remove, then put: a reader in between sees the key missing)."""
        if self._store is None:
            return NOT_SET_UP
        self.remove(key)
        return self.put(key, value, config)

    def get_buffer(self, key: str) -> bytearray | None:
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> list[bytearray | None]:
        """Each value as a buffer object, None when missing (LMCache reads these)."""
        if self._store is None:
            return [None] * len(keys)
        try:
            sizes = self._store.batch_sizes(list(keys))
        except MooncakeError:
            return [None] * len(keys)
        outs = [bytearray(n) if n else None for n in sizes]
        live = [i for i, o in enumerate(outs) if o is not None]
        got = self._batch_get([keys[i] for i in live], [[_addr(outs[i])[1]] for i in live],
                              [[sizes[i] or 0] for i in live]) if live else []
        for i, g in zip(live, got):
            if g < 0:
                outs[i] = None
        return outs

    # ---- zero-copy API (memory by address)
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        try:
            self.pool.register_buffer(int(buffer_ptr), int(size))
        except (MooncakeError, RuntimeError) as e:
            log.error("register_buffer(%#x, %d) failed: %s", buffer_ptr, size, e)
            return INVALID_PARAMS
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        if self._store is None:
            return NOT_SET_UP
        return OK if self._store.unregister_buffer(int(buffer_ptr)) else INVALID_PARAMS

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self._batch_put([key], [[buffer_ptr]], [[size]], config)[0]

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._batch_get([key], [[buffer_ptr]], [[size]])[0]

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        if len(keys) != len(buffer_ptrs) or len(keys) != len(sizes):
            return [INVALID_PARAMS] * len(keys)
        return self._batch_put(list(keys), [[p] for p in buffer_ptrs], [[s] for s in sizes], config)

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        if len(keys) != len(buffer_ptrs) or len(keys) != len(sizes):
            return [INVALID_PARAMS] * len(keys)
        return self._batch_get(list(keys), [[p] for p in buffer_ptrs], [[s] for s in sizes])

    def batch_put_from_multi_buffers(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        if len(keys) != len(all_buffer_ptrs) or len(keys) != len(all_sizes):
            return [INVALID_PARAMS] * len(keys)
        return self._batch_put(list(keys), [list(p) for p in all_buffer_ptrs], [list(s) for s in all_sizes], config)

    def batch_get_into_multi_buffers(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]], prefer_same_node: bool = True) -> list[int]:
        if len(keys) != len(all_buffer_ptrs) or len(keys) != len(all_sizes):
            return [INVALID_PARAMS] * len(keys)
        return self._batch_get(list(keys), [list(p) for p in all_buffer_ptrs], [list(s) for s in all_sizes])

    def _batch_put(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]],
                   config: ReplicateConfig | None) -> list[int]:
        if self._store is None:
            return [NOT_SET_UP] * len(keys)
        replicas, pin = _opts(config)
        try:
            return [int(s) for s in self._store.batch_put_from(keys, ptrs, sizes, replicas=replicas, pin=pin)]
        except MooncakeError as e:
            log.error("batch put of %d keys failed: %s", len(keys), e)
            return [INVALID_PARAMS] * len(keys)

    def _batch_get(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        if self._store is None:
            return [NOT_SET_UP] * len(keys)
        try:
            return [int(s) for s in self._store.batch_get_into(keys, ptrs, sizes)]
        except MooncakeError as e:
            log.error("batch get of %d keys failed: %s", len(keys), e)
            return [INVALID_PARAMS] * len(keys)

    # ---- metadata
    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1 present, 0 absent, -1 error (Mooncake's convention)."""
        if self._store is None:
            return [-1] * len(keys)
        try:
            return self._store.batch_exists_flags(keys)
        except MooncakeError as e:
            log.error("batch_is_exist failed: %s", e)
            return [-1] * len(keys)

    def get_size(self, key: str) -> int:
        if self._store is None:
            return NOT_SET_UP
        try:
            n = self._store.batch_sizes([key])[0]
        except MooncakeError:
            return INVALID_PARAMS
        return OBJECT_NOT_FOUND if n is None else n

    def remove(self, key: str, force: bool = False) -> int:
        """0, or -704 for a missing key. Never -706 (OBJECT_HAS_LEASE): a read in flight holds
        the slots it reads, so removing a key never waits for or breaks a reader."""
        if self._store is None:
            return NOT_SET_UP
        try:
            return OK if self._store.remove(key) else OBJECT_NOT_FOUND
        except MooncakeError:
            return INVALID_PARAMS

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return [self.remove(k, force) for k in keys]

    def remove_all(self, force: bool = False) -> int:
        """How many objects were removed."""
        if self._store is None:
            return NOT_SET_UP
        return self._store.remove_all()

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDescriptor]]:
        if self._store is None:
            return {}
        present = self._store.batch_exists(list(keys))
        return {k: [ReplicaDescriptor("memory")] if p else [] for k, p in zip(keys, present)}

    def health_check(self) -> int:
        return 0 if self._store is not None and not self._store.closed else 1

    def get_hostname(self) -> str:
        return self.hostname

    def close(self) -> int:
        if self._store is not None:
            self._store.close()
            self._store = None
        return OK

