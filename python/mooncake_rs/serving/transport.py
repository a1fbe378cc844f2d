"""KV movement between instances through each instance's ``mooncake_rs.TransferEngine``.

Every instance registers its store's arena with its own transfer engine
(``TransferEngine.register(store)``; shared memory a peer on this host can map when the
store was opened with ``shared_memory=True``). A copy
is a ``TransferRequest``: ``write`` pushes a span of the local arena into a peer's arena
(prefill -> decode, layer by layer), ``read`` pulls a peer's block into the local arena
(a prefix fetch). In-process the engines share a ``TransferRegistry`` and the path is a
memcpy; across processes the peer is reached by address and the path is shm. Batches
are submitted without blocking; a waiter thread waits for them in order (the wait
releases the GIL), so sending overlaps the engine's compute, and it records the time
transfers were in flight (for the serving bandwidth figure).

``link_bandwidth`` (bytes/s) emulates a network link for benchmarks: a batch then counts
as done no earlier than its bytes take at that rate, the link serialised.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

from .. import TransferEngine, TransferRegistry, TransferRequest
from ..errors import TransferFailed

__all__ = ["Transport", "Span"]


@dataclass(frozen=True)
class Span:
    """``length`` bytes at ``local_off`` of our arena <-> ``remote_off`` of a peer's."""

    local_off: int
    remote_off: int
    length: int


class Transport:
    def __init__(self, name: str, store: Any, registry: TransferRegistry | None = None,
                 link_bandwidth: float | None = None, *, auth_token: str | None = None,
                 peers_write: bool = True) -> None:
        self._in_process = registry is not None
        if registry is not None:
            # In-process, the peers are in this process: no listener at all, so no other
            # process can reach the arenas (issue 17, item 1).
            self.te = TransferEngine(name, listen="", registry=registry)
        else:
            # A worker: listens on loopback for its cluster's peers, which prove the
            # cluster's private token (and tag every frame with keys derived from it).
            self.te = TransferEngine(name, auth_token=auth_token)
        # The store's arena: peers address its slots. A prefill arena is only read by
        # peers (prefix fetches); a decode arena is written by the prefill instances.
        self.region = self.te.register(store, remote_readonly=not peers_write)
        self.endpoint = {"name": name, "address": self.te.address, "region": self.region.id}
        self._link = link_bandwidth
        self._link_free = 0.0
        self._peers: dict[str, Any] = {}
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[int, Any, int, float, float]] = collections.deque()
        self._pending: collections.Counter[int] = collections.Counter()
        self._bytes: collections.Counter[int] = collections.Counter()
        self._errors: dict[int, str] = {}
        self.total_bytes = 0
        self.busy_s = 0.0  # wall time with at least one batch in flight
        self._busy_until = 0.0
        self._stop = False
        self._thread = threading.Thread(target=self._wait_loop, name=f"mooncake-transfer-{name}", daemon=True)
        self._thread.start()

    def peer(self, ep: dict[str, Any]) -> Any:
        p = self._peers.get(ep["name"])
        if p is None:
            p = self.te.connect(ep["name"]) if self._in_process else self.te.connect(ep["name"], ep["address"])
            self._peers[ep["name"]] = p
        return p

    def write(self, tag: int, ep: dict[str, Any], spans: list[Span]) -> None:
        """Queues pushes of our spans into the peer's arena (returns at once)."""
        if not spans:
            return
        peer = self.peer(ep)
        reqs = [TransferRequest("write", self.region, s.local_off, peer, ep["region"], s.remote_off, s.length)
                for s in spans]
        n = sum(s.length for s in spans)
        now = time.monotonic()
        ready = 0.0
        if self._link:
            self._link_free = max(self._link_free, now) + n / self._link
            ready = self._link_free
        batch = self.te.submit(reqs, timeout_s=30.0)
        with self._cv:
            self._queue.append((tag, batch, n, now, ready))
            self._pending[tag] += 1
            self._cv.notify()

    def read_now(self, tag: int, ep: dict[str, Any], spans: list[Span]) -> None:
        """Pulls the peer's spans into our arena and waits (a prefix fetch)."""
        peer = self.peer(ep)
        reqs = [TransferRequest("read", self.region, s.local_off, peer, ep["region"], s.remote_off, s.length)
                for s in spans]
        t0 = time.monotonic()
        for st in self.te.submit(reqs, timeout_s=30.0).wait():
            if not st.ok:
                raise TransferFailed(f"fetch from {ep['name']} failed: {st.error}")
        n = sum(s.length for s in spans)
        with self._cv:
            self._bytes[tag] += n
            self.total_bytes += n
            self._account(t0, time.monotonic())

    def _account(self, t0: float, t1: float) -> None:
        start = max(t0, self._busy_until)
        if t1 > start:
            self.busy_s += t1 - start
        self._busy_until = max(self._busy_until, t1)

    def _wait_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                tag, batch, n, t0, ready = self._queue[0]
            statuses = batch.wait()
            left = ready - time.monotonic()
            if left > 0:
                time.sleep(left)
            t1 = time.monotonic()
            bad = [s.error for s in statuses if not s.ok]
            with self._cv:
                self._queue.popleft()
                self._account(t0, t1)
                self.total_bytes += n
                self._bytes[tag] += n
                if bad:
                    self._errors[tag] = str(bad[0])
                self._pending[tag] -= 1
                if self._pending[tag] <= 0:
                    del self._pending[tag]

    def pending(self, tag: int) -> int:
        with self._cv:
            return self._pending.get(tag, 0)

    def error(self, tag: int) -> str | None:
        with self._cv:
            return self._errors.pop(tag, None)

    def take_bytes(self, tag: int) -> int:
        with self._cv:
            return self._bytes.pop(tag, 0)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=35)
        self._peers.clear()
        self.te.close()
