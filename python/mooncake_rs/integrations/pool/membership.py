"""KV pools in the deploy layer's etcd: a pool registers its control address under a kept
lease (``{prefix}/kvpool/{name}``; it goes when the pool stops, or with the lease's TTL
when it dies), and connectors on any host list them to follow their events."""

from __future__ import annotations

import json
import logging

from ...net.etcd import EtcdClient
from ...deploy.lease import KeptLease
from ...errors import InvalidArgument

__all__ = ["PoolRegistration", "pool_addresses", "DEFAULT_PREFIX"]

log = logging.getLogger("mooncake_rs.pool")

DEFAULT_PREFIX = "/mooncake"


def _key(prefix: str, name: str) -> bytes:
    return f"{prefix.rstrip('/')}/kvpool/{name}".encode()


class PoolRegistration:
    """Keeps ``{prefix}/kvpool/{name}`` -> ``{"address": ...}`` in etcd while it lives."""

    def __init__(self, etcd_url: str, name: str, address: str, prefix: str = DEFAULT_PREFIX, ttl_s: int = 5) -> None:
        if not name or "/" in name:
            raise InvalidArgument(f"a pool name is one path segment, got {name!r}")
        self.client = EtcdClient(etcd_url)
        self.key = _key(prefix, name)
        self.lease = KeptLease(self.client, ttl_s, name="kvpool")
        self.client.put(self.key, json.dumps({"address": address}).encode(), lease=self.lease.id)

    def close(self) -> None:
        self.lease.revoke()


def pool_addresses(etcd_url: str, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """The control addresses of every pool registered under ``prefix``."""
    kvs, _ = EtcdClient(etcd_url).get_prefix(f"{prefix.rstrip('/')}/kvpool/".encode())
    out = []
    for kv in kvs:
        try:
            addr = json.loads(kv.value).get("address")
        except (ValueError, AttributeError):
            log.warning("pool record %r is not JSON with an address; skipped", kv.key)
            continue
        if isinstance(addr, str) and addr:
            out.append(addr)
    return out
