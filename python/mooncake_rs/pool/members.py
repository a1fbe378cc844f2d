"""Store nodes in etcd: each node's record under ``{prefix}/store-nodes/{name}``, held by a
lease the node keeps alive (deploy/lease.py), and the clients' view of the live set.

A node that crashes leaves when its lease expires (``ttl_s``); one that shuts down
revokes it and leaves at once. Clients read the prefix every ``poll_s`` (a range read of
a few records), so a change reaches them within ``poll_s``; a node a client cannot reach
is also skipped by that client at once (remote.py), without waiting for etcd.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec

from ..net.etcd import EtcdClient
from ..deploy.lease import KeptLease
from ..errors import InvalidArgument, ServiceUnavailable

__all__ = ["StoreNodeRecord", "NodeRegistration", "NodeDirectory", "nodes_prefix"]

log = logging.getLogger("mooncake_rs.pool")

RECORD_VERSION = 1


class StoreNodeRecord(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    control: str  # HOST:PORT of its pool control listener
    transfer: str  # HOST:PORT of its transfer engine
    metrics: str = ""  # HOST:PORT of its /metrics
    dram_bytes: int = 0
    ssd_bytes: int = 0
    version: int = RECORD_VERSION


def nodes_prefix(prefix: str) -> bytes:
    return f"{prefix.rstrip('/')}/store-nodes/".encode()


_decoder = msgspec.json.Decoder(StoreNodeRecord)


class NodeRegistration:
    """Puts ``record`` under a kept lease until ``close()``; re-registers after a lease
    lost to an etcd outage."""

    def __init__(self, client: EtcdClient, prefix: str, record: StoreNodeRecord, ttl_s: int = 3) -> None:
        if not record.name or "/" in record.name:
            raise InvalidArgument(f"a store node name is non-empty and has no '/', got {record.name!r}")
        self.client, self.record, self.ttl_s = client, record, ttl_s
        self.key = nodes_prefix(prefix) + record.name.encode()
        self._lock = threading.Lock()
        self._closed = False
        self._lease: KeptLease | None = None
        # A node restarted after a crash finds its old record until that lease expires
        # (at most ttl_s): wait that long before calling the name taken by a live node.
        deadline = time.monotonic() + ttl_s + 1
        while True:
            try:
                self._put()
                return
            except InvalidArgument:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)

    def _put(self) -> None:
        lease = KeptLease(self.client, self.ttl_s, on_lost=self._lost, name=f"store-{self.record.name}")
        try:
            created = self.client.create(self.key, msgspec.json.encode(self.record), lease.id)
        except BaseException:
            lease.revoke()
            raise
        if not created:
            lease.revoke()
            raise InvalidArgument(f"a store node named {self.record.name!r} is already registered; give this one "
                                  "another --name (or wait for the other's lease to expire)")
        self._lease = lease

    def _lost(self) -> None:
        def again() -> None:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    try:
                        self._put()
                        log.warning("store node %s registered again", self.record.name)
                        return
                    except (ServiceUnavailable, InvalidArgument):
                        pass
                time.sleep(0.5)

        threading.Thread(target=again, name="mooncake-store-rejoin", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lease, self._lease = self._lease, None
        if lease is not None:
            lease.revoke()


class NodeDirectory:
    """The live store nodes, as etcd lists them (refreshed every ``poll_s``)."""

    def __init__(self, client: EtcdClient, prefix: str, poll_s: float = 0.5) -> None:
        self.client, self.poll_s = client, poll_s
        self._prefix = nodes_prefix(prefix)
        self._cond = threading.Condition()
        self._nodes: dict[str, StoreNodeRecord] = {}
        self._stop = threading.Event()
        self.available = False
        self._refresh()
        self._thread = threading.Thread(target=self._run, name="mooncake-pool-nodes", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        try:
            kvs, _ = self.client.get_prefix(self._prefix)
        except ServiceUnavailable as e:
            if self.available:
                log.warning("etcd unavailable; using the last known %d store nodes: %s", len(self._nodes), e)
            self.available = False
            return
        fresh: dict[str, StoreNodeRecord] = {}
        for kv in kvs:
            try:
                rec = _decoder.decode(kv.value)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.error("malformed store node record at %r skipped: %s", kv.key, e)
                continue
            if rec.version == RECORD_VERSION:
                fresh[rec.name] = rec
        with self._cond:
            self.available = True
            self._nodes = fresh
            self._cond.notify_all()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._refresh()

    def nodes(self) -> dict[str, StoreNodeRecord]:
        with self._cond:
            return dict(self._nodes)

    def names(self) -> list[str]:
        """The nodes' names, without the lock: a refresh replaces the table whole, never
        changes it in place (asked on every small-key call)."""
        return list(self._nodes)

    def wait_for(self, n: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._nodes) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.client.timeout_s + 1)
