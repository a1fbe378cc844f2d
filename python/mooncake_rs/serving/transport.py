"""KV movement between instances through each instance's ``mooncake_rs.TransferEngine``.

Every instance registers its store's arena with its own transfer engine
(``TransferEngine.register(store)``; shared memory a peer on this host can map when the
store was opened with ``shared_memory=True``). A copy
is a ``TransferRequest``: ``write`` pushes a span of the local arena into a peer's arena
(prefill -> decode, layer by layer), ``read`` pulls a peer's block into the local arena
(a prefix fetch). In-process the engines share a ``TransferRegistry`` and the path is a
memcpy; across processes the peer is reached by address and the path is shm.

Batches are submitted without blocking, each with the caller's tag, to one
``CompletionQueue``: the engine itself reports a batch when it has ended (its first
error, its bytes, its submit and finish times), so there is no waiter thread here and
nothing in Python counts bytes or in-flight time: ``total_bytes`` and ``busy_s`` are the
engine's own counters (``TransferEngine.stats()``). ``pending``/``error``/``take_bytes``
look at the queue when called (it never blocks), so whoever polls them (the instance
loop) learns of completions; ``wait`` blocks (GIL released) until one arrives.

``link_bandwidth`` (bytes/s) emulates a network link for benchmarks: a write batch then
counts as done no earlier than its bytes take at that rate, the link serialised, and
``busy_s`` counts the emulated time. A read batch (a prefix fetch) is paced by the
holder's link out, one emulated link per peer: reads from two holders run side by side,
reads from one holder queue behind each other (as this reader sees that link: other
readers of the same holder are not counted against it).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

from .. import BatchCompletion, CompletionQueue, TransferEngine, TransferRegistry, TransferRequest

__all__ = ["Transport", "Span"]

#: Deadline of one batch (a transfer that takes longer fails its request with a timeout).
BATCH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Span:
    """``length`` bytes at ``local_off`` of our arena <-> ``remote_off`` of a peer's."""

    local_off: int
    remote_off: int
    length: int


class Transport:
    def __init__(self, name: str, store: Any, registry: TransferRegistry | None = None,
                 link_bandwidth: float | None = None, *, auth_token: str | None = None,
                 peers_write: bool = True, restricted: bool = False,
                 peer_tokens: dict[str, str] | None = None, listen: str = "127.0.0.1:0",
                 transports: list[str] | None = None) -> None:
        self._in_process = registry is not None
        if registry is not None:
            # In-process, the peers are in this process: no listener at all, so no other
            # process can reach the arenas (issue 17, item 1).
            self.te = TransferEngine(name, listen="", registry=registry)
        else:
            # A worker: listens on loopback for its cluster's peers, which prove the
            # cluster's private token (and tag every frame with keys derived from it).
            # With ``peer_tokens`` (kv_grants) each peer proves its own token, so holding
            # one does not let a worker pass for another instance (and use its grants).
            # Across hosts (deploy/) it listens on the host's own address, and may be
            # limited to TCP (``transports``) so KV never takes shm between "hosts" that
            # share a kernel (network namespaces in tests).
            self.te = TransferEngine(name, listen, auth_token=auth_token,
                                     transports=tuple(transports) if transports else None,
                                     peer_tokens=peer_tokens or None)
        # The store's arena: peers address its slots. A prefill arena is only read by
        # peers (prefix fetches); a decode arena is written by the prefill instances:
        # ``restricted``, only inside the grants ``grant`` makes (never over shm).
        self.region = self.te.register(store, remote_readonly=not peers_write, restricted=restricted)
        self.endpoint = {"name": name, "address": self.te.address, "region": self.region.id}
        self._link = link_bandwidth
        self._link_free = 0.0
        self._read_link_free: dict[str, float] = {}  # peer name -> when its emulated link is free
        self._next_tag = 0  # new_tag(): negative, so never a request id
        self._peers: dict[str, Any] = {}
        self._cq = CompletionQueue()
        self._lock = threading.Lock()
        # Each batch is submitted with a sequence number as its queue tag; this maps it
        # to the caller's tag and the time the emulated link lets it finish (0: none).
        self._seq = 0
        self._meta: dict[int, tuple[int, float, int, int]] = {}  # seq -> (tag, ready, bytes, way)
        self._held: list[tuple[float, BatchCompletion]] = []  # ended, waiting for the link
        self._pending: collections.Counter[int] = collections.Counter()
        self._bytes: collections.Counter[int] = collections.Counter()
        self._errors: dict[int, str] = {}
        self._link_busy_s = 0.0
        self._busy_until = 0.0
        # bytes of the batches submitted and not ended, writes (NIC out) and reads (NIC in)
        self._queued = [0, 0]

    # ---- engine counters
    @property
    def total_bytes(self) -> int:
        """Bytes moved by this instance's transfers that ended ok (the engine's count)."""
        s = self.te.stats()
        return s.bytes_written + s.bytes_read

    @property
    def busy_s(self) -> float:
        """Wall time with at least one transfer in flight (the engine's count; with an
        emulated link, the time until the link let the batches finish)."""
        if self._link:
            with self._lock:
                self._drain()
                return self._link_busy_s
        return self.te.stats().busy_s

    def link_queued(self) -> tuple[float, float]:
        """Bytes this instance's transfers still have to move, (out, in): its writes to
        peers (KV streams to decode) and its reads from them (prefix fetches), queued or
        in flight now. With an emulated link, what the emulated links still hold (a
        batch the engine ended waits there for its emulated time); otherwise the bytes
        of the batches submitted and not ended. What the heartbeat reports to the
        conductor's link loads (docs/conductor.md)."""
        now = time.monotonic()
        with self._lock:
            self._drain()
            if self._link:
                out = max(0.0, self._link_free - now) * self._link
                inn = sum(max(0.0, f - now) for f in self._read_link_free.values()) * self._link
                return out, inn
            return float(self._queued[0]), float(self._queued[1])

    def reregister(self, store: Any, *, peers_write: bool, restricted: bool = False) -> Any:
        """Registers the arena again with other rights for peers (a role switch: a
        prefill arena is read-only to peers, a decode arena writable) and makes it the
        one ``endpoint`` names. Returns the previous region, which stays registered: a
        peer may still be reading it (a prefix fetch of blocks pinned before the
        switch); the caller unregisters it (``retire``) once nothing of it is pinned."""
        old = self.region
        self.region = self.te.register(store, remote_readonly=not peers_write, restricted=restricted)
        self.endpoint = {**self.endpoint, "region": self.region.id}
        return old

    def retire(self, region: Any) -> None:
        """Unregisters a region ``reregister`` replaced (in-flight transfers keep its
        memory alive until they end)."""
        self.te.unregister(region)

    # ---- grants (a restricted arena)
    def grant(self, peer: str, offset: int, length: int, expires_s: float) -> int:
        """Lets the engine named ``peer`` write ``offset..offset+length`` of our arena."""
        return int(self.te.grant(self.region, peer, offset, length, write=True, expires_s=expires_s))

    def revoke(self, peer: str, grant_id: int | None = None) -> int:
        return int(self.te.revoke(self.region, peer, grant_id))

    # ---- submitting
    def peer(self, ep: dict[str, Any]) -> Any:
        """The connected peer of ``ep`` (connects on first use). The first connect also
        starts looking up the peer's arena in the background (a zero-length read: on the
        shm path, mapping the peer's segment takes tens of ms for a large arena), so a
        caller that connects ahead of its first transfer does not pay that in it. A TCP
        peer with no connection left (the server closed an idle one to make room, or
        restarted) is connected again."""
        p = self._peers.get(ep["name"])
        if p is None or (p.transport == "tcp" and p.connections == 0):
            p = self.te.connect(ep["name"]) if self._in_process else self.te.connect(ep["name"], ep["address"])
            self._peers[ep["name"]] = p
            if p.transport != "local":
                self.te.submit([TransferRequest("read", self.region, 0, p, ep["region"], 0, 0)],
                               timeout_s=BATCH_TIMEOUT_S)
        return p

    def _submit(self, op: str, tag: int, ep: dict[str, Any], spans: list[Span], link: bool) -> None:
        peer = self.peer(ep)
        region = ep["region"]
        reqs = [TransferRequest(op, self.region, s.local_off, peer, region, s.remote_off, s.length) for s in spans]
        ready = 0.0
        if self._link:
            n = sum(s.length for s in spans)
            if link:
                self._link_free = max(self._link_free, time.monotonic()) + n / self._link
                ready = self._link_free
            else:  # a read: the bytes come over the holder's link out
                name = ep["name"]
                free = max(self._read_link_free.get(name, 0.0), time.monotonic()) + n / self._link
                self._read_link_free[name] = ready = free
        nbytes, way = sum(s.length for s in spans), 0 if link else 1
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._meta[seq] = (tag, ready, nbytes, way)
            self._pending[tag] += 1
            self._queued[way] += nbytes
        try:
            self.te.submit(reqs, timeout_s=BATCH_TIMEOUT_S, queue=self._cq, tag=seq)
        except BaseException:
            with self._lock:
                del self._meta[seq]
                self._queued[way] -= nbytes
                self._done(tag)
            raise

    def write(self, tag: int, ep: dict[str, Any], spans: list[Span]) -> None:
        """Queues pushes of our spans into the peer's arena (returns at once)."""
        if spans:
            self._submit("write", tag, ep, spans, link=True)

    def read(self, tag: int, ep: dict[str, Any], spans: list[Span]) -> None:
        """Queues pulls of the peer's spans into our arena (returns at once); the end
        shows up in ``pending``/``error``/``take_bytes`` of ``tag`` like a write's."""
        if spans:
            self._submit("read", tag, ep, spans, link=False)

    def new_tag(self) -> int:
        """A tag no request id uses (negative): for transfers that need their own
        completion, such as each holder's share of a multi-source fetch."""
        with self._lock:
            self._next_tag -= 1
            return self._next_tag

    # ---- completions (the caller holds self._lock)
    def _done(self, tag: int) -> None:
        self._pending[tag] -= 1
        if self._pending[tag] <= 0:
            del self._pending[tag]

    def _finish(self, c: BatchCompletion, ready: float) -> None:
        tag, _, nbytes, way = self._meta.pop(c.tag)
        self._queued[way] -= nbytes
        if ready:
            t0 = c.submitted_ns * 1e-9
            start = max(t0, self._busy_until)
            if ready > start:
                self._link_busy_s += ready - start
            self._busy_until = max(self._busy_until, ready)
        self._bytes[tag] += c.bytes
        if not c.ok:
            self._errors.setdefault(tag, str(c.error))
        self._done(tag)

    def _handle(self, done: list[BatchCompletion]) -> None:
        for c in done:
            ready = self._meta[c.tag][1]
            if ready:
                self._held.append((max(ready, c.finished_ns * 1e-9), c))
            else:
                self._finish(c, 0.0)
        if self._held:
            now = time.monotonic()
            keep = []
            for ready, c in sorted(self._held, key=lambda x: x[0]):
                if ready <= now:
                    self._finish(c, ready)
                else:
                    keep.append((ready, c))
            self._held = keep

    def _drain(self) -> None:
        self._handle(self._cq.poll())

    def pending(self, tag: int) -> int:
        with self._lock:
            self._drain()
            return self._pending.get(tag, 0)

    def error(self, tag: int) -> str | None:
        with self._lock:
            self._drain()
            return self._errors.pop(tag, None)

    def take_bytes(self, tag: int) -> int:
        with self._lock:
            self._drain()
            return self._bytes.pop(tag, 0)

    def wait(self, timeout_s: float) -> bool:
        """Blocks (GIL released) until a batch ended or ``timeout_s`` passed; whether any
        did. For a loop that has nothing else to do than wait for its transfers."""
        with self._lock:
            self._drain()
            held = min((r for r, _ in self._held), default=None)
        if held is not None:  # a batch the emulated link releases at `held`
            timeout_s = min(timeout_s, max(0.0, held - time.monotonic()))
        done: list[BatchCompletion] = []
        if timeout_s > 0 and self._cq.pending:
            done = self._cq.wait(timeout_s)
        elif timeout_s > 0 and held is not None:
            time.sleep(timeout_s)
        with self._lock:
            before = sum(self._pending.values())
            self._handle(done)
            return sum(self._pending.values()) < before

    def close(self) -> None:
        """Waits (up to a batch deadline) for the batches still in flight, then closes."""
        end = time.monotonic() + BATCH_TIMEOUT_S + 5
        while time.monotonic() < end:
            with self._lock:
                self._drain()
                if not self._pending:
                    break
            self.wait(min(0.05, max(0.0, end - time.monotonic())))
        self._peers.clear()
        self.te.close()
