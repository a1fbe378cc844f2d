"""Leader election among ``serve`` processes: whoever creates ``{prefix}/leader`` under its
own lease leads, until it resigns or its lease lapses (crash, host gone, partition).

``campaign()`` blocks until this candidate leads (or ``timeout_s`` passes): it tries the
create-if-absent transaction and, while another candidate holds the key, polls it every
``poll_s`` seconds. So a standby takes over at most ``ttl_s + poll_s`` (plus one etcd
round trip) after the leader's last keep-alive. A leader that learns its lease is gone
(etcd said so after an outage) stops leading at once and ``on_lost`` runs: it must stop
routing, since another candidate may lead by then.

With the cluster ``token`` the key holds a signed ``LeaderRecord`` (records.py): clients
that hold the token ignore (and log) a leader record that an etcd writer put there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..errors import InvalidArgument, ServiceUnavailable
from ..net.etcd import EtcdClient
from .lease import KeptLease
from ..client.records import decode_leader, encode_leader, leader_key, records_key

__all__ = ["LeaderElection"]

log = logging.getLogger("mooncake_rs.deploy")


class LeaderElection:
    def __init__(self, client: EtcdClient, prefix: str, candidate: str, *, ttl_s: int = 3,
                 poll_s: float = 0.25, on_lost: Callable[[], None] | None = None,
                 token: str | bytes | None = None) -> None:
        if not candidate:
            raise InvalidArgument("a candidate needs a non-empty name (its address, say)")
        if not poll_s > 0:
            raise InvalidArgument(f"poll_s must be > 0, got {poll_s!r}")
        self.client, self.candidate, self.ttl_s, self.poll_s = client, candidate, ttl_s, poll_s
        self.key = leader_key(prefix)
        self._sign_key = records_key(token) if token is not None else None
        self._on_lost = on_lost
        self._lease: KeptLease | None = None
        self._leading = threading.Event()
        self._warned = False

    @property
    def is_leader(self) -> bool:
        return self._leading.is_set()

    def leader(self) -> str | None:
        """Who leads now, as etcd says (None: nobody)."""
        kv = self.client.get(self.key)
        return decode_leader(kv.value, self._sign_key, self.key, kv.lease) if kv is not None else None

    def campaign(self, timeout_s: float | None = None) -> bool:
        """Blocks until this candidate leads (True) or ``timeout_s`` passes (False). etcd
        outages during the wait are retried."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            try:
                led = self._try_once()
                self._warned = False
                if led:
                    return True
            except ServiceUnavailable as e:
                if not self._warned:  # once an outage, not once a poll
                    log.warning("election: etcd unavailable, retrying every %g s: %s", self.poll_s, e)
                    self._warned = True
            time.sleep(self.poll_s)
        return False

    def _try_once(self) -> bool:
        if self._lease is None or self._lease.lost:
            self._lease = KeptLease(self.client, self.ttl_s, on_lost=self._lost, name="leader")
        value = encode_leader(self.candidate, self._sign_key, self.key, self._lease.id)
        if self.client.create(self.key, value, self._lease.id):
            self._leading.set()
            log.info("%s leads (lease %x, ttl %d s)", self.candidate, self._lease.id, self.ttl_s)
            return True
        return False

    def _lost(self) -> None:
        was = self._leading.is_set()
        self._leading.clear()
        if was:
            log.error("%s lost the leadership (its lease expired)", self.candidate)
            if self._on_lost is not None:
                self._on_lost()

    def resign(self) -> None:
        """Steps down now (the key goes with the lease, a standby takes over at its next poll)."""
        self._leading.clear()
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.revoke()
