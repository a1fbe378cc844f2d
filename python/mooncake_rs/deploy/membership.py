"""The live set of workers, as the ``serve`` process (conductor and router) sees it.

A thread reads every record under ``{prefix}/workers/`` and then watches the prefix from
the revision it read at, so no change between the read and the watch is missed. Each
change reaches ``on_join(record)`` / ``on_leave(name)`` on that thread, in etcd's order.

When etcd cannot be reached (the watch drops, or the health check every ``check_s`` fails
— which also catches a silent network cut that leaves the watch's socket open),
``available`` turns False and the members stay as last known: routing continues on them.
When etcd answers again the thread reads the prefix afresh and reports the difference
(workers that left meanwhile, by crash or lease expiry, leave then).

Records whose fingerprint differs from ``fingerprint`` (when given) are refused: kept in
``refused`` with the reason, logged, never reported as members. Malformed records are
skipped the same way, and so, with the cluster ``token``, are records not signed with it
for their key and lease (records.py): etcd is not trusted to say who is a worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..errors import InvalidArgument, ServiceUnavailable
from ..net.etcd import EtcdClient, Watch
from ..client.records import ModelFingerprint, WorkerRecord, decode_record, records_key, verify_record, workers_prefix

__all__ = ["Membership"]

log = logging.getLogger("mooncake_rs.deploy")


class Membership:
    def __init__(self, client: EtcdClient, prefix: str, *, fingerprint: ModelFingerprint | None = None,
                 on_join: Callable[[WorkerRecord], None] | None = None,
                 on_leave: Callable[[str], None] | None = None, check_s: float = 1.0,
                 token: str | bytes | None = None) -> None:
        if not check_s > 0:
            raise InvalidArgument(f"check_s must be > 0, got {check_s!r}")
        self.client, self.fingerprint, self.check_s = client, fingerprint, check_s
        self._prefix = workers_prefix(prefix)
        self._sign_key = records_key(token) if token is not None else None
        self._on_join, self._on_leave = on_join, on_leave
        self._members: dict[str, WorkerRecord] = {}
        self.refused: dict[str, str] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._watch: Watch | None = None
        self.available = False
        #: how many times the view was rebuilt from a fresh read (1 after the first)
        self.resyncs = 0
        self._thread = threading.Thread(target=self._run, name="mooncake-membership", daemon=True)
        self._health = threading.Thread(target=self._check, name="mooncake-etcd-health", daemon=True)
        self._thread.start()
        self._health.start()

    # ---- queries
    def members(self) -> dict[str, WorkerRecord]:
        with self._cond:
            return dict(self._members)

    def wait_until(self, predicate: Callable[[dict[str, WorkerRecord]], bool], timeout_s: float) -> bool:
        """Waits until ``predicate(members)`` holds; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(dict(self._members)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    # ---- the watcher
    def _apply(self, name: str, record: WorkerRecord | None) -> None:
        """One change, reported to the callbacks outside the lock."""
        with self._cond:
            old = self._members.get(name)
            if record is None:
                self._members.pop(name, None)
                self.refused.pop(name, None)
            else:
                self._members[name] = record
            self._cond.notify_all()
        # the same worker under a new lease (it registered again after an outage) is no change
        changed = record is not None and (old is None or not record.same_worker(old))
        if old is not None and (record is None or changed) and self._on_leave is not None:
            self._on_leave(name)
        if changed and self._on_join is not None:
            self._on_join(record)  # type: ignore[arg-type]

    def _decode(self, key: bytes, value: bytes, lease: int) -> WorkerRecord | None:
        name = key[len(self._prefix):].decode(errors="replace")
        try:
            rec = decode_record(value)
        except InvalidArgument as e:
            self._refuse(name, str(e))
            return None
        if rec.name != name:
            self._refuse(name, f"record names {rec.name!r} under the key of {name!r}")
            return None
        if self._sign_key is not None:
            why = verify_record(rec, self._sign_key, key, lease)
            if why is not None:
                self._refuse(name, f"ignored: {why}")
                return None
        if self.fingerprint is not None:
            diff = self.fingerprint.mismatch(rec.fingerprint)
            if diff:
                self._refuse(name, f"model fingerprint differs from the cluster's: {diff}")
                return None
        return rec

    def _refuse(self, name: str, reason: str) -> None:
        with self._cond:
            known = self.refused.get(name) == reason
            self.refused[name] = reason
            self._cond.notify_all()
        if not known:
            log.error("worker %s refused: %s", name, reason)

    def _resync(self) -> int:
        kvs, revision = self.client.get_prefix(self._prefix)
        fresh: dict[str, WorkerRecord] = {}
        for kv in kvs:
            rec = self._decode(kv.key, kv.value, kv.lease)
            if rec is not None:
                fresh[rec.name] = rec
        for name in set(self.members()) - set(fresh):
            self._apply(name, None)
        for name, rec in fresh.items():
            self._apply(name, rec)
        self.resyncs += 1
        return revision

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                revision = self._resync()
                self._watch = self.client.watch_prefix(self._prefix, revision + 1)
                self._set_available(True)
                backoff = 0.1
                for events in self._watch:
                    for ev in events:
                        name = ev.key[len(self._prefix):].decode(errors="replace")
                        self._apply(name, self._decode(ev.key, ev.value, ev.lease) if ev.kind == "put" else None)
            except ServiceUnavailable as e:
                if self.available:
                    log.warning("etcd unavailable, routing on the last known %d workers: %s", len(self.members()), e)
                self._set_available(False)
            finally:
                if self._watch is not None:
                    self._watch.close()
                    self._watch = None
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 2.0)

    def _set_available(self, up: bool) -> None:
        with self._cond:
            self.available = up
            self._cond.notify_all()

    def _check(self) -> None:
        """A watch on a cut network blocks forever: a failed probe closes it (resync)."""
        while not self._stop.wait(self.check_s):
            try:
                self.client.get(self._prefix)
            except ServiceUnavailable:
                w = self._watch
                if w is not None:
                    w.close()

    def close(self) -> None:
        self._stop.set()
        w = self._watch
        if w is not None:
            w.close()
        self._thread.join(timeout=self.client.timeout_s + 2)
        self._health.join(timeout=self.client.timeout_s + 2)

    def __enter__(self) -> "Membership":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
