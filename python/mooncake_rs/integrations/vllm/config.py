"""The connector's settings, from ``kv_transfer_config.kv_connector_extra_config``.

| key | meaning |
| --- | --- |
| ``pool`` | ``HOST:PORT`` of this host's KV pool (``mooncake-rs kv-pool``); required |
| ``auth_token`` / ``auth_token_file`` | the cluster token (else ``MOONCAKE_AUTH_TOKEN``) |
| ``advertise`` | the pool address peers on other hosts use (default: ``pool``) |
| ``peers`` | other pools to follow (their events feed the block index), a list of addresses |
| ``etcd`` | an etcd URL: every pool registered there (``mooncake-rs kv-pool --etcd``) is followed |
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
        pool = extra.get("pool")
        if not pool or not isinstance(pool, str):
            raise InvalidArgument("MooncakeRsConnector needs kv_connector_extra_config.pool = \"HOST:PORT\" of a "
                                  "KV pool (start one with: mooncake-rs kv-pool --listen HOST:PORT)")
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
        return cls(pool=pool, auth_token=str(token), advertise=str(extra.get("advertise") or pool), role=role,
                   model_id=str(extra.get("model_id") or vllm_config.model_config.model),
                   peers=tuple(str(p) for p in peers), etcd=extra.get("etcd") or None,
                   etcd_prefix=str(extra.get("etcd_prefix") or "/mooncake"),
                   lease_s=float(extra.get("lease_s", 60.0)),
                   verify_checksums=_flag(extra.get("verify_checksums", True)),
                   timeout_s=float(extra.get("timeout_s", 5.0)), transports=_transports(extra.get("transports")))


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
