"""The KV pool service: one :class:`~mooncake_rs.Store` in shared memory, its arena
registered with a :class:`~mooncake_rs.TransferEngine`, and an authenticated control
socket (protocol.py) through which engines we did not write (vLLM, via
``MooncakeRsConnector``) reserve, commit, look up and lease blocks.

Bytes never pass through this process's Python: a client writes a block layer by layer
into a reserved slot and reads a leased one with its own transfer engine (one memcpy over
shm on this host, TCP from another). The pool keeps, per stored block, a CRC-32 of its
bytes (the writer's, taken in its copy pass, or the pool's own at commit), so a reader can tell a block that changed in the store (a flipped
bit, a stray writer) from the one that was saved, and report it instead of using it.

State a client holds (leases, reservations) belongs to its connection: when it closes (a
worker died), its leases are released and its reservations aborted; both also expire
after the ``lease_s`` they were asked for, so nothing stays pinned forever.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..._core import BlockHashes, Store, TransferEngine, crc32
from ...net.auth_socket import AuthListener
from ...errors import InvalidArgument, MooncakeError
from ...net.framing import Codec, ProtocolError
from . import protocol as p
from .shared_arena import host_id
from .wire import recv_message

__all__ = ["KVPoolServer", "PoolConfig"]

log = logging.getLogger("mooncake_rs.pool")

MAX_LEASE_S = 600.0


@dataclass
class PoolConfig:
    """``dram_bytes``: the arena (rounded down to whole slots). ``listen``: the control
    socket; ``data_listen``: the transfer engine's (TCP for peers on other hosts; same-host
    peers map the arena). ``max_events``: store events kept for followers."""

    auth_token: str
    dram_bytes: int = 256 << 20
    listen: str = "127.0.0.1:0"
    data_listen: str = "127.0.0.1:0"
    name: str = ""  # the transfer engine's name; "" -> kvpool-<random> (unique per process and host)
    eviction: str = "lru"
    max_events: int = 1 << 20

    def __post_init__(self) -> None:
        if self.dram_bytes <= 0:
            raise InvalidArgument(f"dram_bytes must be > 0, got {self.dram_bytes}")
        if not self.name:
            self.name = f"kvpool-{uuid.uuid4().hex[:8]}"
        if self.max_events < 1:
            raise InvalidArgument(f"max_events must be >= 1, got {self.max_events}")


@dataclass(eq=False)
class _Conn:
    leases: dict[int, tuple[Any, float]] = field(default_factory=dict)  # id -> (LeasedRun, expiry)
    reservations: dict[int, tuple[list[Any], float]] = field(default_factory=dict)  # id -> (blocks, expiry)


class KVPoolServer:
    """Serves one pool until :meth:`close`. The store is made at the first ``Open`` (its
    block size is the client's); every later ``Open`` must name the same size and layout."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        host, _, port = config.listen.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"listen must be HOST:PORT, got {config.listen!r}")
        self._lock = threading.Lock()
        self._store: Store | None = None
        self._layout = ""
        self.engine = TransferEngine(config.name, listen=config.data_listen, auth_token=config.auth_token)
        self._region: Any = None
        self._ids = itertools.count(1)
        self._checksums: dict[int, int] = {}
        self._events: deque[tuple[str, int, str]] = deque(maxlen=config.max_events)
        self._events_start = 0  # sequence number of self._events[0]
        self._conns: set[_Conn] = set()
        self.counters = {"saves_stored": 0, "saves_skipped_full": 0, "saves_skipped_present": 0,
                         "saves_aborted": 0, "lookups": 0, "blocks_leased": 0, "corrupt_removed": 0,
                         "leases_expired": 0}
        self._closed = threading.Event()
        self._listener = AuthListener(host, int(port), config.auth_token, self._serve)
        self.address = self._listener.address
        self._sweeper = threading.Thread(target=self._sweep, name="mooncake-pool-sweep", daemon=True)
        self._sweeper.start()

    # --- life ---------------------------------------------------------------------

    @property
    def store(self) -> Store | None:
        return self._store

    @property
    def region_id(self) -> int | None:
        """The arena's region id at :attr:`engine` (None until the first Open)."""
        return None if self._region is None else int(self._region.id)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._listener.close()
        with self._lock:
            for c in list(self._conns):
                self._drop_conn_state(c)
        self.engine.close()

    def __enter__(self) -> KVPoolServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- connections --------------------------------------------------------------

    def _serve(self, sock: Any, peer: str) -> None:
        codec = Codec(p.Request)
        conn = _Conn()
        with self._lock:
            self._conns.add(conn)
        try:
            while not self._closed.is_set():
                try:
                    msg = recv_message(sock, codec)
                except (ConnectionError, OSError):
                    return
                except ProtocolError as e:
                    log.warning("pool: closing the connection of %s: %s", peer, e)
                    return
                try:
                    reply = self.handle(msg, conn)
                except MooncakeError as e:
                    reply = p.PoolError(type(e).__name__, str(e))
                except Exception as e:  # a bug here must not take the pool down: report it
                    log.exception("pool: %s failed", type(msg).__name__)
                    reply = p.PoolError("InternalError", f"{type(e).__name__}: {e}")
                sock.sendall(codec.encode(reply))
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._drop_conn_state(conn)
            sock.close()

    def _drop_conn_state(self, conn: _Conn) -> None:
        for run, _ in conn.leases.values():
            run.release()
        conn.leases.clear()
        for blocks, _ in conn.reservations.values():
            self._abort(blocks)
        conn.reservations.clear()

    def _abort(self, blocks: list[Any]) -> None:
        for w in blocks:
            if w is not None and not w.done:
                w.abort()
                self.counters["saves_aborted"] += 1

    def _sweep(self) -> None:
        while not self._closed.wait(0.5):
            now = time.monotonic()
            with self._lock:
                for c in self._conns:
                    for lid in [k for k, (_, exp) in c.leases.items() if exp < now]:
                        c.leases.pop(lid)[0].release()
                        self.counters["leases_expired"] += 1
                    for rid in [k for k, (_, exp) in c.reservations.items() if exp < now]:
                        self._abort(c.reservations.pop(rid)[0])
                self._pull_events()

    # --- ops ----------------------------------------------------------------------

    def handle(self, msg: Any, conn: _Conn) -> Any:
        """One request -> its reply (errors raise typed MooncakeErrors)."""
        with self._lock:
            if isinstance(msg, p.Open):
                return self._open(msg)
            if isinstance(msg, p.Events):
                self._pull_events()
                return self._events_since(msg.since, msg.limit)
            if isinstance(msg, p.PoolStats):
                return p.PoolStatsReply(self.stats())
            store = self._require_store()
            if isinstance(msg, p.Lookup):
                return self._lookup(store, msg, conn)
            if isinstance(msg, p.Release):
                entry = conn.leases.pop(msg.lease, None)
                if entry is not None:
                    entry[0].release()
                return p.Removed(1 if entry is not None else 0)
            if isinstance(msg, p.Reserve):
                return self._reserve(store, msg, conn)
            if isinstance(msg, p.Commit):
                return self._commit(msg, conn)
            if isinstance(msg, p.Remove):
                n = 0
                for k in BlockHashes(msg.keys):
                    if store.remove(k):
                        n += 1
                    self._checksums.pop(k, None)
                if msg.corrupt:
                    self.counters["corrupt_removed"] += n
                self._pull_events()
                return p.Removed(n)
        raise InvalidArgument(f"unexpected request {type(msg).__name__}")

    def _require_store(self) -> Store:
        if self._store is None:
            raise InvalidArgument("the pool is not open yet: send Open(block_bytes, layout) first")
        return self._store

    def _open(self, msg: p.Open) -> p.Opened:
        if msg.version != p.POOL_PROTOCOL_VERSION:
            raise InvalidArgument(f"pool protocol version {msg.version}, this pool speaks {p.POOL_PROTOCOL_VERSION}")
        if msg.block_bytes <= 0:
            raise InvalidArgument(f"block_bytes must be > 0, got {msg.block_bytes}")
        if self._store is None:
            if msg.block_bytes > self.config.dram_bytes:
                raise InvalidArgument(f"a block of {msg.block_bytes} bytes does not fit the pool's "
                                      f"{self.config.dram_bytes} bytes; give the pool more memory")
            self._store = Store(block_bytes=msg.block_bytes, dram_bytes=self.config.dram_bytes,
                                eviction=self.config.eviction, shared_memory=True)
            self._region = self.engine.register(self._store)
            self._layout = msg.layout
            log.info("pool: opened with %d-byte blocks, %d slots, layout %s", msg.block_bytes,
                     self._store.slots, msg.layout)
        elif msg.block_bytes != self._store.block_bytes or msg.layout != self._layout:
            raise InvalidArgument(f"this pool holds blocks of {self._store.block_bytes} bytes, layout "
                                  f"{self._layout!r}; a client asked for {msg.block_bytes} bytes, layout "
                                  f"{msg.layout!r} (one pool serves one model layout)")
        region = self._store.region()
        return p.Opened(self.engine.name, self.engine.address, self._region.id, self._store.block_bytes,
                        self._store.slots, self._layout, region.slot_stride, region.shm_name or "", host_id())

    def _lookup(self, store: Store, msg: p.Lookup, conn: _Conn) -> p.Found:
        self.counters["lookups"] += 1
        run = store.lookup_prefix_run(BlockHashes(msg.keys), promote=True)
        offsets = run.offsets
        sums = [self._checksums.get(k, -1) for k in run.keys]
        lease = 0
        if msg.lease_s > 0 and len(run):
            lease = next(self._ids)
            conn.leases[lease] = (run, time.monotonic() + min(msg.lease_s, MAX_LEASE_S))
            self.counters["blocks_leased"] += len(run)
        else:
            run.release()
        return p.Found(len(offsets), offsets, sums, lease)

    def _reserve(self, store: Store, msg: p.Reserve, conn: _Conn) -> p.Reserved:
        from ...errors import StoreFull

        blocks: list[Any] = []
        offsets: list[int] = []
        present = full = 0
        for k in BlockHashes(msg.keys):
            if store.contains(k):
                blocks.append(None)
                offsets.append(-1)
                present += 1
                continue
            try:
                w = store.reserve(k)
            except StoreFull:
                blocks.append(None)
                offsets.append(-1)
                full += 1
                continue
            blocks.append(w)
            offsets.append(w.offset)
        self.counters["saves_skipped_present"] += present
        self.counters["saves_skipped_full"] += full
        rid = next(self._ids)
        conn.reservations[rid] = (blocks, time.monotonic() + min(msg.lease_s, MAX_LEASE_S))
        return p.Reserved(rid, offsets, present, full)

    def _commit(self, msg: p.Commit, conn: _Conn) -> p.Committed:
        entry = conn.reservations.pop(msg.reservation, None)
        if entry is None:
            raise InvalidArgument(f"no reservation {msg.reservation} (committed already, or expired)")
        blocks = entry[0]
        if len(msg.ok) != len(blocks) or (msg.checksums and len(msg.checksums) != len(blocks)):
            self._abort(blocks)
            raise InvalidArgument(f"commit names {len(msg.ok)} blocks ({len(msg.checksums)} checksums), the "
                                  f"reservation has {len(blocks)}")
        stored = 0
        for i, (w, ok) in enumerate(zip(blocks, msg.ok)):
            if w is None:
                continue
            if not ok:
                w.abort()
                self.counters["saves_aborted"] += 1
                continue
            # The checksum of the bytes as the writer left them, before anyone can read them:
            # the writer's own (taken while it copied, so a write that went wrong on the way
            # is caught at the first read), else the slot's.
            if msg.checksums:
                crc = msg.checksums[i] & 0xFFFFFFFF
            else:
                with memoryview(w) as view:
                    crc = crc32(view)
            block = w.commit()
            if block is not None:
                self._checksums[block.key] = crc
                block.release()
                stored += 1
        self.counters["saves_stored"] += stored
        self._pull_events()
        return p.Committed(stored)

    # --- events -------------------------------------------------------------------

    def _pull_events(self) -> None:
        """Move the store's new events into the log followers read (under the lock)."""
        if self._store is None:
            return
        for ev in self._store.drain_events():
            if ev.kind in ("evicted", "removed") and not self._store.contains(ev.key):
                self._checksums.pop(ev.key, None)
            if len(self._events) == self._events.maxlen:
                self._events_start += 1
            self._events.append((ev.kind, ev.key, ev.tier))

    def _events_since(self, since: int, limit: int) -> p.EventBatch:
        start = max(since, self._events_start)
        end = min(self._events_start + len(self._events), start + max(1, limit))
        items = list(itertools.islice(self._events, start - self._events_start, end - self._events_start))
        keys = bytes(BlockHashes([k for _, k, _ in items])) if items else b""
        return p.EventBatch(start, end, [k for k, _, _ in items], keys, [t for _, _, t in items])

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        if self._store is not None:
            out.update({f"store_{k}": int(v) for k, v in self._store.stats().as_dict().items()})
        out["leases_held"] = sum(len(c.leases) for c in self._conns)
        out["reservations_held"] = sum(len(c.reservations) for c in self._conns)
        return out
