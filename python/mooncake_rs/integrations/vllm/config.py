"""The connector's settings, from ``kv_transfer_config.kv_connector_extra_config``.

| key | meaning |
| --- | --- |
| ``store`` | where blocks go: ``"kv-pool"`` (default: this host's KV pool, ``pool`` below) or ``"pool"`` (the cluster-wide pool, ``mooncake_rs.DistributedStore``, found through ``etcd``: pool_store.py) |
| ``pool`` | ``HOST:PORT`` of this host's KV pool (``mooncake-rs kv-pool``); required with ``store: "kv-pool"`` |
| ``auth_token`` / ``auth_token_file`` | the cluster token (else ``MOONCAKE_AUTH_TOKEN``) |
| ``advertise`` | the pool address peers on other hosts use (default: ``pool``) |
| ``peers`` | other pools to follow (their events feed the block index), a list of addresses |
| ``etcd`` | an etcd URL. ``kv-pool``: every pool registered there (``mooncake-rs kv-pool --etcd``) is followed; ``pool``: the store nodes (``mooncake-rs store --etcd``) registered there are the pool (required) |
| ``cluster`` | ``store: "pool"``: the deployment's cluster name (``mooncake-rs store --cluster``; default ``default``) |
| ``replicas`` | ``store: "pool"``: copies of each block (default 1) |
| ``etcd_prefix`` | the deployment's key prefix in etcd (default ``/mooncake``) |
| ``model_id`` | what the block hashes are salted with (default: the served model's path) |
| ``lease_s`` | how long a planned load keeps its blocks leased at most (default 60) |
| ``verify_checksums`` | check each loaded block's CRC-32 against the pool's (default true) |
| ``timeout_s`` | a pool call's bound (default 5) |
| ``transports`` | the transfer engine's transports, e.g. ``["tcp"]`` (default: shm and tcp). With ``shm`` (the default) a pool on this host has its arena mapped and blocks are copied directly |
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidArgument

__all__ = ["ConnectorSettings"]


STORES = ("kv-pool", "pool")


@dataclass(frozen=True)
class ConnectorSettings:
    pool: str
    auth_token: str
    advertise: str
    role: str  # kv_producer | kv_consumer | kv_both
    model_id: str
    peers: tuple[str, ...] = field(default_factory=tuple)
    etcd: str | None = None
    etcd_prefix: str = "/mooncake"
    lease_s: float = 60.0
    verify_checksums: bool = True
    timeout_s: float = 5.0
    transports: tuple[str, ...] | None = None
    store: str = "kv-pool"  # one of STORES
    cluster: str = "default"  # store == "pool": the deployment's cluster name
    replicas: int = 1  # store == "pool": copies of each block
    namespace: str = "vllm-kv"  # store == "pool": the pool keys' prefix (model, dtypes, block size)

    @property
    def uses_pool(self) -> bool:
        """Blocks go to the cluster-wide pool (``DistributedStore``), not a host's KV pool."""
        return self.store == "pool"

    @property
    def direct_copies(self) -> bool:
        """May a pool on this host be copied into directly (its arena mapped here)?"""
        return self.transports is None or "shm" in self.transports

    @property
    def saves(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> ConnectorSettings:
        ktc = vllm_config.kv_transfer_config
        extra: dict[str, Any] = dict(ktc.kv_connector_extra_config or {})
        store = str(extra.get("store") or "kv-pool")
        if store not in STORES:
            raise InvalidArgument(f"kv_connector_extra_config.store {store!r}: expected one of {', '.join(STORES)}")
        pool = extra.get("pool")
        if store == "pool":
            if not extra.get("etcd") or not isinstance(extra.get("etcd"), str):
                raise InvalidArgument("MooncakeRsConnector with store \"pool\" needs kv_connector_extra_config.etcd = "
                                      "the etcd URL the store nodes registered with (mooncake-rs store --etcd URL)")
            pool = str(pool or "")
        elif not pool or not isinstance(pool, str):
            raise InvalidArgument("MooncakeRsConnector needs kv_connector_extra_config.pool = \"HOST:PORT\" of a "
                                  "KV pool (start one with: mooncake-rs kv-pool --listen HOST:PORT), or "
                                  "store = \"pool\" with etcd = the cluster-wide pool's etcd URL")
        token = extra.get("auth_token")
        if not token and extra.get("auth_token_file"):
            with open(extra["auth_token_file"]) as f:
                token = f.read().strip()
        token = token or os.environ.get("MOONCAKE_AUTH_TOKEN")
        if not token:
            raise InvalidArgument("MooncakeRsConnector needs the pool's token: kv_connector_extra_config.auth_token, "
                                  "auth_token_file, or MOONCAKE_AUTH_TOKEN")
        role = ktc.kv_role or "kv_both"
        if role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise InvalidArgument(f"kv_role {role!r}: expected kv_producer, kv_consumer or kv_both")
        peers = extra.get("peers") or ()
        if isinstance(peers, str):
            peers = [p for p in peers.split(",") if p]
        model_id = str(extra.get("model_id") or vllm_config.model_config.model)
        replicas = extra.get("replicas", 1)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise InvalidArgument(f"kv_connector_extra_config.replicas {replicas!r}: an int >= 1")
        return cls(pool=pool, auth_token=str(token), advertise=str(extra.get("advertise") or pool or store),
                   role=role, model_id=model_id,
                   peers=tuple(str(p) for p in peers), etcd=extra.get("etcd") or None,
                   etcd_prefix=str(extra.get("etcd_prefix") or "/mooncake"),
                   lease_s=float(extra.get("lease_s", 60.0)),
                   verify_checksums=_flag(extra.get("verify_checksums", True)),
                   timeout_s=float(extra.get("timeout_s", 5.0)), transports=_transports(extra.get("transports")),
                   store=store, cluster=str(extra.get("cluster") or "default"), replicas=replicas,
                   namespace=pool_namespace(model_id, vllm_config))


def pool_namespace(model_id: str, vllm_config: Any) -> str:
    """The prefix of this model's keys in the cluster-wide pool: the block hashes are salted
    with the model id already; the KV's dtypes and block size are added here, so instances
    whose blocks differ in bytes (bf16 and fp16 have the same size) never share keys."""
    import hashlib

    model, cache = vllm_config.model_config, vllm_config.cache_config
    what = "\0".join(str(x) for x in (model_id, getattr(model, "dtype", ""), getattr(cache, "cache_dtype", ""),
                                      cache.block_size))
    return "vllm-kv/" + hashlib.blake2b(what.encode(), digest_size=8).hexdigest()


def _transports(v: Any) -> tuple[str, ...] | None:
    if v is None:
        return None
    items = [t for t in v.split(",") if t] if isinstance(v, str) else [str(t) for t in v]
    bad = [t for t in items if t not in ("shm", "tcp")]
    if bad or not items:
        raise InvalidArgument(f"transports {v!r}: a list of \"shm\" and/or \"tcp\"")
    return tuple(items)


def _flag(v: Any) -> bool:
    if isinstance(v, str):
        return v.lower() not in ("0", "false", "no", "off", "")
    return bool(v)
