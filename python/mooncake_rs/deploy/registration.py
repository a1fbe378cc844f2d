"""A worker's registration in etcd: its record under a lease it keeps alive.

``register()`` refuses, with an ``InvalidArgument`` that says what differs, a worker whose
model fingerprint is not the cluster's (the first registration, or the ``serve`` process,
records the cluster's fingerprint at ``{prefix}/fingerprint``; it stays when workers come
and go), and a name another live worker holds. Then the key lives as long as the lease:
``close()`` revokes it (the worker leaves at once); a crashed worker's key expires with
its TTL. A lease lost during a long etcd outage is re-granted and the record put again
when etcd returns, so a worker that outlived an outage rejoins by itself.

With the cluster token (``token=``, what ``mooncake-rs worker`` passes) the record is
signed for its key and lease (records.py): conductors ignore records that are not. The
fingerprint is signed too; one that does not verify is replaced (a forged fingerprint
cannot keep the cluster's workers out).
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec

from ..errors import InvalidArgument, ServiceUnavailable
from ..net.etcd import EtcdClient
from .lease import KeptLease
from ..client.records import (ModelFingerprint, SignedFingerprint, WorkerRecord, encode_record, records_key, sign_fingerprint,
                      sign_record, verify_fingerprint, worker_key)

__all__ = ["WorkerRegistration", "claim_fingerprint"]

log = logging.getLogger("mooncake_rs.deploy")

_RETRY_S = 0.5
_CLAIM_TRIES = 8


def _fingerprint_key(prefix: str) -> bytes:
    return f"{prefix.rstrip('/')}/fingerprint".encode()


def claim_fingerprint(client: EtcdClient, prefix: str, fingerprint: ModelFingerprint,
                      sign_key: bytes | None = None) -> None:
    """Records ``fingerprint`` as the cluster's if none is, else checks it is the same
    (InvalidArgument naming the fields that differ). With ``sign_key`` (the records key
    of the cluster token) the fingerprint is signed, and one in etcd that does not
    verify is not the cluster's: it is logged and replaced by this one."""
    key = _fingerprint_key(prefix)
    data = msgspec.json.encode(fingerprint) if sign_key is None else sign_fingerprint(fingerprint, sign_key, key)
    for _ in range(_CLAIM_TRIES):
        if client.create(key, data):
            return
        kv = client.get(key)
        if kv is None:  # deleted in between by an operator: claim again
            continue
        if sign_key is None:
            theirs = _plain_fingerprint(kv.value, key)
        else:
            signed, why = verify_fingerprint(kv.value, sign_key, key)
            if signed is None:
                log.warning("the fingerprint at %s is ignored: %s; putting this worker's (signed) in its place",
                            key.decode(), why)
                if client.replace(key, data, kv.mod_revision):
                    return
                continue  # changed in between: read it again
            theirs = signed
        diff = theirs.mismatch(fingerprint)
        if diff:
            raise InvalidArgument(f"this worker's model does not match the cluster's ({diff}); "
                                  "start it with the cluster's model, dtype and block size")
        return
    raise ServiceUnavailable(f"the fingerprint at {key.decode()} kept changing while it was claimed "
                             f"({_CLAIM_TRIES} tries); is something rewriting it?")


def _plain_fingerprint(value: bytes, key: bytes) -> ModelFingerprint:
    """A cluster without a token: the fingerprint as written (a signed one's inner one)."""
    try:
        return msgspec.json.decode(value, type=ModelFingerprint)
    except msgspec.DecodeError:
        pass
    try:
        return msgspec.json.decode(value, type=SignedFingerprint).fingerprint
    except msgspec.DecodeError as e:
        raise InvalidArgument(f"the cluster's fingerprint at {key.decode()} is malformed ({e}); delete it") from e


class WorkerRegistration:
    """Registers ``record`` under ``prefix`` (e.g. ``/mooncake/<cluster>``) until ``close()``;
    signed with the cluster ``token`` when given."""

    def __init__(self, client: EtcdClient, prefix: str, record: WorkerRecord, ttl_s: int = 5, *,
                 token: str | bytes | None = None) -> None:
        self.client, self.prefix, self.record, self.ttl_s = client, prefix, record, ttl_s
        self._sign_key = records_key(token) if token is not None else None
        self.key = worker_key(prefix, record.name)
        self._lock = threading.Lock()
        self._closed = False
        self._lease: KeptLease | None = None
        self._rejoin: threading.Thread | None = None

    def register(self, wait_s: float = 0.0) -> "WorkerRegistration":
        """Claims or checks the fingerprint and puts the record under a fresh lease.

        ``wait_s``: how long to keep trying while etcd is unreachable or too slow to
        answer within the client's deadline (``ServiceUnavailable``), e.g. a worker that
        starts with etcd, or under a load spike; 0 (the default) tries once. A mismatched
        fingerprint or a taken name is never retried."""
        if not wait_s >= 0:
            raise InvalidArgument(f"wait_s must be >= 0 seconds, got {wait_s!r}")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                claim_fingerprint(self.client, self.prefix, self.record.fingerprint, self._sign_key)
                with self._lock:
                    self._put()
                return self
            except ServiceUnavailable as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.warning("worker %s: etcd unavailable (%s); retrying for %.1f s more", self.record.name, e, left)
                time.sleep(min(_RETRY_S, left))

    def _put(self) -> None:
        lease = KeptLease(self.client, self.ttl_s, on_lost=self._lost, name=f"worker-{self.record.name}")
        try:
            value = encode_record(self.record) if self._sign_key is None else \
                sign_record(self.record, self._sign_key, self.key, lease.id)
            created = self.client.create(self.key, value, lease.id)
        except BaseException:
            lease.revoke()
            raise
        if not created:
            lease.revoke()
            raise InvalidArgument(f"a worker named {self.record.name!r} is already registered in {self.prefix}; "
                                  "give this one another --name (or wait for the other's lease to expire)")
        self._lease = lease

    def _lost(self) -> None:
        log.warning("worker %s: its etcd lease expired (etcd outage?); registering again", self.record.name)
        self._rejoin = threading.Thread(target=self._rejoin_loop, name="mooncake-rejoin", daemon=True)
        self._rejoin.start()

    def _rejoin_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                try:
                    self._put()
                    log.warning("worker %s registered again", self.record.name)
                    return
                except ServiceUnavailable:
                    pass
                except InvalidArgument as e:  # another worker took the name meanwhile
                    log.error("worker %s cannot register again: %s", self.record.name, e)
                    return
            threading.Event().wait(_RETRY_S)

    @property
    def lease_id(self) -> int | None:
        return self._lease.id if self._lease is not None else None

    def close(self) -> None:
        """Leaves the cluster now (revokes the lease; idempotent)."""
        with self._lock:
            self._closed = True
            lease, self._lease = self._lease, None
        if lease is not None:
            lease.revoke()

    def __enter__(self) -> "WorkerRegistration":
        return self.register()

    def __exit__(self, *exc: object) -> None:
        self.close()
