"""A lease kept alive by a background thread: what a worker's registration and a leader's
key hang on.

The thread refreshes the lease every ``ttl_s / 3`` seconds. While etcd cannot be reached
it keeps trying (the holder keeps working: a worker serves its requests, routing goes on);
if etcd answers that the lease is gone (it expired during a long outage, or was revoked
by an operator), ``on_lost`` runs once on the thread and the loop ends: the holder decides
(a worker re-registers, a leader steps down).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..errors import InvalidArgument, ServiceUnavailable
from ..net.etcd import EtcdClient

__all__ = ["KeptLease"]

log = logging.getLogger("mooncake_rs.deploy")


class KeptLease:
    def __init__(self, client: EtcdClient, ttl_s: int, on_lost: Callable[[], None] | None = None,
                 name: str = "lease") -> None:
        if int(ttl_s) != ttl_s or ttl_s < 1:
            raise InvalidArgument(f"ttl_s is whole seconds >= 1 (etcd leases), got {ttl_s!r}")
        self.client, self.ttl_s = client, int(ttl_s)
        self.id = client.lease_grant(self.ttl_s)
        self._on_lost = on_lost
        self._stop = threading.Event()
        self.lost = False
        self._thread = threading.Thread(target=self._run, name=f"mooncake-{name}-keepalive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        unreachable = False
        while not self._stop.wait(self.ttl_s / 3):
            try:
                ttl = self.client.lease_keepalive(self.id)
            except ServiceUnavailable as e:
                if not unreachable:
                    log.warning("etcd unreachable, lease %x not refreshed (retrying): %s", self.id, e)
                unreachable = True
                continue
            if unreachable:
                log.warning("etcd reachable again, lease %x %s", self.id, "kept" if ttl else "expired meanwhile")
                unreachable = False
            if ttl <= 0:
                self.lost = True
                if self._on_lost is not None and not self._stop.is_set():
                    self._on_lost()
                return

    def revoke(self) -> None:
        """Stops refreshing and revokes the lease (its keys go at once); best effort when
        etcd is unreachable (the lease then expires by itself within its TTL)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.client.timeout_s + 1)
        try:
            self.client.lease_revoke(self.id)
        except ServiceUnavailable as e:
            log.warning("could not revoke lease %x (it expires within %d s): %s", self.id, self.ttl_s, e)
