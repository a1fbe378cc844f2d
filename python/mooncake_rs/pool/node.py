"""A store node (``mooncake-rs store``): contributes one ObjectSegment (DRAM + SSD tier) to
the pool, serves the control protocol (protocol.py) on an authenticated listener, lets
clients' transfer engines write into reserved slots and read leased ones, registers in
etcd under a lease, and serves ``/metrics``.

The segment's stores are shared-memory mappings registered with the node's transfer
engine: a client on another host reaches them over TCP, one on this host can map them
(the engine's shm path, one copy by the client).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import msgspec

from .._core import LandingWatch, TransferEngine
from ..net.auth_socket import AuthListener
from ..net.plain_socket import PlainListener
from ..net.etcd import EtcdClient
from ..net.sealed import SealedSocket
from ..net.spin_wait import DEFAULT_SPIN_US, spin_us_checked
from ..errors import InvalidArgument, MooncakeError
from .members import NodeRegistration, StoreNodeRecord
from .metrics import prometheus_text, segment_metrics
from .protocol import (INLINE_MAX, SPARE_BYTES_MAX, Answer, Bind, Bound, Commit, Exists, ExistsKeys, Failure, FlagsAnswer,
                       FrameIO, GetValue, Leased, Lookup, NodeRequest, PutInline, Release, Remove, RemoveAll, Reserve,
                       Reserved, Sizes, Spares, Stats, Value)
from .holds import ConnHolds
from .objects import Lease, Reservation
from .segment import DEFAULT_CHUNK_BYTES, ObjectSegment
from .status import KeyStatus

__all__ = ["StoreNode"]

log = logging.getLogger("mooncake_rs.pool")


class StoreNode:
    #: each request type's handler, by the message's class (filled in below the class)
    _handlers: ClassVar[dict[type, Callable[[StoreNode, Any, ConnHolds], object]]]

    def __init__(self, *, name: str, listen: str, dram_bytes: int, auth_token: str | None,
                 ssd_path: str | None = None,
                 ssd_bytes: int = 0, transfer_listen: str | None = None, metrics_listen: str | None = None,
                 etcd: str | None = None, prefix: str = "/mooncake/default", ttl_s: int = 3,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, transports: tuple[str, ...] = ("tcp", "shm"),
                 plaintext: bool = False, lease_ttl_s: float = 0.0, spin_us: int = DEFAULT_SPIN_US) -> None:
        """``lease_ttl_s`` > 0: a client's reservations and leases end that long after its
        last request even while its connection stays open (holds.py: the slots are granted
        to its engine alone and revoked first, so a late read or write is refused); 0:
        they end with the connection. ``plaintext``: no cluster token, nothing authenticated or sealed (control and data),
        like Mooncake Store's TCP; only on a network where every host is trusted. It must be
        asked for by name: ``auth_token=None`` alone is refused. ``spin_us``: after each answer,
        how long a connection's thread polls for the client's next request before it sleeps
        (net/spin_wait.py; 0: it sleeps at once)."""
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"--listen must be HOST:PORT, got {listen!r}")
        if plaintext == bool(auth_token):
            raise InvalidArgument("a store node needs the cluster token, or plaintext=True (--plaintext) and no "
                                  "token; not both")
        self.plaintext = plaintext
        if not lease_ttl_s >= 0:
            raise InvalidArgument(f"--lease-ttl is seconds >= 0 (0: holds end with the connection), got {lease_ttl_s!r}")
        self.lease_ttl_s = float(lease_ttl_s)
        self.spin_s = spin_us_checked(spin_us, "--spin-us") / 1e6
        self.name = name
        self.segment = ObjectSegment(dram_bytes, ssd_path=ssd_path, ssd_bytes=ssd_bytes, chunk_bytes=chunk_bytes,
                                     shared_memory=True)
        self.te = TransferEngine(f"store-{name}", listen=transfer_listen or f"{host}:0", auth_token=auth_token,
                                 transports=list(transports))
        # peers write reserved slots and read leased ones; the store decides which are which
        # (restricted with a lease deadline: reachable only inside the grants of holds.py)
        self.regions = [self.te.register(sc.store, restricted=self.lease_ttl_s > 0) for sc in self.segment.classes]
        # a reservation whose client asked for it is published when its last byte lands
        # over TCP, before that write is answered (``_landed``): no Commit round trip
        self.landing = LandingWatch(self._landed)
        for region, sc in zip(self.regions, self.segment.classes):
            self.te.watch_writes(region, self.landing, sc.chunk_bytes)
        self._conns: set[ConnHolds] = set()
        self._conns_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = threading.Event()
        self.listener: AuthListener | PlainListener = (
            PlainListener(host, int(port), self._serve) if plaintext
            else AuthListener(host, int(port), auth_token or "", self._serve))
        self.address = self.listener.address
        self._http = _metrics_server(metrics_listen or f"{host}:0", self)
        self.metrics_address = "{}:{}".format(*self._http.server_address[:2])
        threading.Thread(target=self._http.serve_forever, name="mooncake-store-metrics", daemon=True).start()
        if self.lease_ttl_s > 0:
            threading.Thread(target=self._reap, name="mooncake-store-leases", daemon=True).start()
        self.record = StoreNodeRecord(name=name, control=self.address, transfer=self.te.address,
                                      metrics=self.metrics_address, dram_bytes=dram_bytes, ssd_bytes=ssd_bytes)
        self.registration = NodeRegistration(EtcdClient(etcd), prefix, self.record, ttl_s=ttl_s) if etcd else None

    # ---- one connection
    def _serve(self, sock: SealedSocket | socket.socket, peer: str) -> None:
        io = FrameIO(sock, NodeRequest, spin_s=self.spin_s)
        # a plain socket's reads go through a native reader that answers Exists frames
        # itself (a batch_is_exist's round trip without the interpreter on this end); a
        # sealed socket's reads decrypt in its own layer, and every frame comes here
        answers = self.segment.exists_responder(self.spin_s) if io.plain_blocking else None
        conn = ConnHolds(self.te, self.lease_ttl_s, self._free, ended=self.landing.forget_many)
        with self._conns_lock:
            self._conns.add(conn)
        try:
            while not self._closed.is_set():
                if answers is not None and io.drained:
                    rest = answers.serve(sock.fileno())
                    if rest is None:
                        break  # (the client closed the connection)
                    if not rest:  # every frame was an Exists, answered there
                        conn.touch()
                        continue
                    msg = io.recv_from(rest)
                else:
                    msg = io.recv()
                conn.touch()  # any request renews the connection's holds
                try:
                    reply = self._handle(msg, conn)  # (looked up each time: a test swaps it to stall the node)
                except MooncakeError as e:
                    reply = Failure(msg.rid, type(e).__name__, str(e))
                io.send(reply)
                self.segment.reap_if_due()  # (puts leave it for after their answers)
        except EOFError:
            pass
        except (OSError, InvalidArgument) as e:
            log.warning("store node %s: connection from %s ended: %s", self.name, peer, e)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()
            try:
                sock.close()
            except OSError:
                pass

    def _free(self, held: Reservation | Lease) -> None:
        if isinstance(held, Reservation):
            self.segment.abort(held)
        else:
            held.release()

    def _reap(self) -> None:
        """Ends the holds of clients silent for ``lease_ttl_s`` (holds.py)."""
        every = min(max(self.lease_ttl_s / 4, 0.05), 1.0)
        while not self._closed.wait(every):
            with self._conns_lock:
                conns = list(self._conns)
            now = time.monotonic()
            for c in conns:
                c.expire(now)

    def _granting(self, conn: ConnHolds, engine: str) -> None:
        if conn.granting:
            if not engine:
                raise InvalidArgument("this store node grants slots to the client's transfer engine by name "
                                      "(--lease-ttl); the request named none: update the client")
            conn.engine = engine

    def _handle(self, msg: object, conn: ConnHolds) -> object:
        """The answer to one request: one dict lookup by its type (a small put, get or
        existence check runs no chain of type tests before its handler)."""
        handler = self._handlers.get(msg.__class__)
        if handler is None:
            raise InvalidArgument(f"unexpected message {type(msg).__name__}")
        return handler(self, msg, conn)

    def _commit(self, msg: Commit, conn: ConnHolds) -> Answer:
        seg = self.segment
        n = min(len(msg.put_ids), len(msg.ok))
        taken = conn.take_reservations(msg.put_ids[:n])
        out = [int(KeyStatus.INVALID)] * n  # (unknown, or expired: the client was silent for the lease deadline)
        done: list[int] = []
        moved: list[Reservation] = []
        for j, (res, ok) in enumerate(zip(taken, msg.ok)):
            if res is None:  # landed with a group that was not all published (``_landed``), or unknown / expired
                landed = conn.take_outcome(msg.put_ids[j])
                if landed is not None:
                    out[j] = landed
                continue
            if ok and res.key:
                done.append(j)
                moved.append(res)
            else:  # its transfer failed (or a spare no Bind named): the slots go back, nothing is published
                seg.abort(res)
                out[j] = int(KeyStatus.TRANSFER_FAILED if res.key else KeyStatus.INVALID)
        for j, st in zip(done, seg.commit_many(moved, reap=False) if moved else []):
            out[j] = int(st)
        return Answer(msg.rid, out)

    def _landed(self, pids: list[int], conn: ConnHolds) -> int:
        """LandingWatch's callback, on the transfer engine's serving thread: the last byte
        of the last of one Reserve's (or Bind's) objects (``pids``) has landed over TCP.
        Publishes them as their client's Commit would; the write that landed it is answered
        after this, with an error unless 0. Then the client, whose writes all succeeded,
        sends no Commit; on an error it sends one, answered with each object's outcome from
        here."""
        out = self._publish_landed(pids, conn)
        if any(out):
            conn.note_outcomes(dict(zip(pids, out)))
            return next(st for st in out if st)
        return 0

    def _publish_landed(self, pids: list[int], conn: ConnHolds) -> list[int]:
        """Publishes the held reservations ``pids``, whose bytes all landed: each one's
        KeyStatus (INVALID: it had ended, by expiry or the connection's close)."""
        taken = conn.take_reservations(pids)
        held = [res for res in taken if res is not None]
        try:
            published = self.segment.commit_many(held, reap=False) if held else []
        except Exception:  # noqa: BLE001 - a serving thread: logged, the write refused, the slots given back
            log.exception("store node %s: publishing landed objects failed", self.name)
            for res in held:
                self.segment.abort(res)
            published = [KeyStatus.INVALID] * len(held)
        each = iter(published)
        # (a reservation that had ended, by expiry or the connection's close: INVALID, as its Commit)
        out = [int(next(each)) if res is not None else int(KeyStatus.INVALID) for res in taken]
        self.segment.counters.puts_landed += out.count(0)
        return out

    def _bind(self, msg: Bind, conn: ConnHolds) -> Bound:
        """A put into this connection's spare slots (protocol.py ``Bind``): names their
        keys, then arms their landing. Its answer may leave before or after the objects'
        last byte lands; which of the two publishes them, the landing table decides."""
        n = len(msg.put_ids)
        if len(msg.keys) != n or not n or not all(msg.keys):
            raise InvalidArgument("bind: one non-empty key per spare put id, at least one")
        held = conn.bind_spares(msg.put_ids)
        if held is None:
            raise InvalidArgument("bind: a put id is not an unbound spare slot of this connection (its holds "
                                  "expired, or it was bound or given back already): reserve instead")
        for res, key in zip(held, msg.keys):
            res.key = key
            res.meta = res.meta._replace(pinned=msg.pin)
        self.segment.counters.puts_into_spares += n
        # (the keys are in place before the landing may publish them, on the serving thread)
        published = self.landing.arm(list(msg.put_ids), conn)
        statuses = self._publish_landed(msg.put_ids, conn) if published else []
        return Bound(msg.rid, published, statuses)

    def _spares(self, conn: ConnHolds, count: int, size: int) -> Spares | None:
        """Spare slots for the connection's next put (``Reserve.spares``): ``count``
        objects of ``size`` bytes, held as its reservations and watched unbound
        (LandingWatch.expect_unbound) until a ``Bind`` names them. All or none (a put
        uses them only when they hold it whole): none beyond ``SPARE_BYTES_MAX`` bytes a
        connection, or an eighth of the size class for all connections together (idle
        spares are capacity that objects cannot use), or when they do not fit."""
        if count <= 0 or size <= INLINE_MAX:
            return None
        seg = self.segment
        sc = seg.classes[seg.class_of(size)]
        with self._conns_lock:
            conns = list(self._conns)
        held = sum(c.spare_bytes for c in conns)
        if (count * size + conn.spare_bytes > SPARE_BYTES_MAX
                or count * size + held > sc.capacity_chunks * sc.chunk_bytes // 8):
            return None
        got = seg.reserve_unbound(count, size)
        if len(got) < count:
            for res in got:
                seg.abort(res)
            return None
        holds = self._hold_writes(conn, got, spare=True)
        pids = [pid for pid, _, _, _ in holds]
        regions = [region.id for _, _, region, _ in holds]
        offsets = [res.offsets for _, res, _, _ in holds]
        self.landing.expect_unbound(pids, regions, offsets, [size] * len(holds))
        return Spares(size, pids, regions, [cb for _, _, _, cb in holds], offsets)

    def _put_inline(self, msg: PutInline, conn: ConnHolds) -> Answer:
        values = msg.values
        if len(msg.keys) != len(values) or max(map(len, values), default=0) > INLINE_MAX:
            raise InvalidArgument(f"put_inline: one value per key, each at most {INLINE_MAX} bytes")
        put, pin = self.segment.put_value, msg.pin
        return Answer(msg.rid, [int(put(k, v, pin)) if v else int(KeyStatus.INVALID) for k, v in zip(msg.keys, values)])

    def _release(self, msg: Release, conn: ConnHolds) -> Answer:
        for lid in msg.lease_ids:
            held = conn.take_lease(lid)
            if held is not None:
                held.release()
        return Answer(msg.rid)

    def _exists(self, msg: Exists, conn: ConnHolds) -> Answer | FlagsAnswer:
        """1/0 a key. Off the wire (``ExistsKeys``) the keys are still msgpack and the
        answer is written as msgpack in one Rust pass; an ``Exists`` handed in by a caller
        in this process is answered from its list."""
        seg = self.segment
        seg.reap_evicted()
        if msg.__class__ is ExistsKeys:
            return FlagsAnswer(msg.rid, msgspec.Raw(seg.exists_encoded(msg.keys)))
        return Answer(msg.rid, seg.exists_many(msg.keys))

    def _sizes(self, msg: Sizes, conn: ConnHolds) -> Answer:
        known = [self.segment.size_of(k) for k in msg.keys]
        return Answer(msg.rid, [int(KeyStatus.MISSING) if n is None else n for n in known])

    def _remove(self, msg: Remove, conn: ConnHolds) -> Answer:
        return Answer(msg.rid, [1 if self.segment.remove(k) else 0 for k in msg.keys])

    def _remove_all(self, msg: RemoveAll, conn: ConnHolds) -> Answer:
        return Answer(msg.rid, [self.segment.remove_all()])

    def _stats(self, msg: Stats, conn: ConnHolds) -> Answer:
        return Answer(msg.rid, metrics=segment_metrics(self.segment).as_dict())

    def _reserve(self, msg: Reserve, conn: ConnHolds) -> Reserved:
        if len(msg.keys) != len(msg.sizes):
            raise InvalidArgument("reserve: keys and sizes differ in length")
        self._granting(conn, msg.engine)
        seg = self.segment
        st, ids, regions, chunk, offsets = [], [], [], [], []
        got = seg.reserve_many(msg.keys, msg.sizes, msg.pin)  # one store call a size class
        holds = self._hold_writes(conn, [res for res in got if isinstance(res, Reservation)])
        each = iter(holds)
        for res in got:
            if isinstance(res, Reservation):
                pid, _, region, cb = next(each)
                st.append(0)
                ids.append(pid)
                regions.append(region.id)
                chunk.append(cb)
                offsets.append(res.offsets)
            else:  # OK with put id 0: held already; or why not
                st.append(int(res))
                ids.append(0)
                regions.append(0)
                chunk.append(0)
                offsets.append([])
        if holds:
            if msg.commit_on_landing:
                # (an empty object has no byte to land: its client commits it)
                landing = [(pid, region.id, res.offsets, res.meta.size) for pid, res, region, _ in holds
                           if res.meta.size]
                if landing:
                    pids, region_ids, offs, sizes = zip(*landing)
                    self.landing.expect(list(pids), list(region_ids), list(offs), list(sizes), conn)
        spares = self._spares(conn, msg.spares, msg.spare_size) if msg.commit_on_landing else None
        return Reserved(msg.rid, st, ids, regions, chunk, offsets, commit_on_landing=msg.commit_on_landing,
                        spares=spares)

    def _hold_writes(self, conn: ConnHolds, reserved: list[Reservation],
                     spare: bool = False) -> list[tuple[int, Reservation, Any, int]]:
        """Gives each reservation a put id and holds them all for the connection (``spare``:
        as its spare slots), all or none: when holding fails they are aborted, since nothing
        else would free them. ``(put id, reservation, region, chunk bytes)`` each."""
        seg = self.segment
        holds = [(next(self._ids), res, self.regions[res.meta.cls], seg.classes[res.meta.cls].chunk_bytes)
                 for res in reserved]
        if holds:
            try:
                conn.hold_many(holds, write=True, spare=spare)
            except Exception:
                for _, res, _, _ in holds:
                    seg.abort(res)
                raise
        return holds

    def _get_value(self, msg: GetValue, conn: ConnHolds) -> Value:
        """One key's value inline when it is small, else its size (``Lookup``'s one-key
        answer without a lease, in three fields instead of eight lists)."""
        seg = self.segment
        size = seg.size_of(msg.key)
        if size is None:
            return Value(msg.rid, int(KeyStatus.MISSING))
        if size > INLINE_MAX:
            return Value(msg.rid, 0, size)
        v = seg.get_bytes(msg.key)
        if isinstance(v, bytes):
            return Value(msg.rid, 0, len(v), v)
        return Value(msg.rid, int(v))  # (removed or evicted since it was sized)

    def _lookup(self, msg: Lookup, conn: ConnHolds) -> Leased:
        seg = self.segment
        if msg.lease_large:
            self._granting(conn, msg.engine)
        inline = min(msg.inline_max, INLINE_MAX)
        if len(msg.keys) == 1 and not msg.lease_large:  # one small get: its bytes inline, nothing to lease
            key = msg.keys[0]
            size = seg.size_of(key)
            if size is not None and size <= inline:
                v = seg.get_bytes(key)
                if isinstance(v, bytes):  # (as `answer` below would fill it)
                    return Leased(msg.rid, [0], [0], [len(v)], [0], [0], [[]], [v])
        st: list[int] = []
        ids: list[int] = []
        sizes: list[int] = []
        regions: list[int] = []
        chunk: list[int] = []
        offsets: list[list[int]] = []
        data: list[bytes] = []

        def answer(status: int, lid: int = 0, size: int = 0, region: int = 0, cb: int = 0,
                   offs: list[int] | None = None, value: bytes = b"") -> None:
            st.append(status)
            ids.append(lid)
            sizes.append(size)
            regions.append(region)
            chunk.append(cb)
            offsets.append(offs or [])
            data.append(value)

        # first the keys answered without a lease (small values inline, sizes only), then
        # one store call a size class leases the others (segment.lease_many)
        to_lease: list[int] = []
        for n, key in enumerate(msg.keys):
            size = seg.size_of(key)
            if size is not None and size <= inline:
                v = seg.get_bytes(key)
                if isinstance(v, bytes):
                    answer(0, size=len(v), value=v)  # small: the bytes themselves, no lease
                    continue
            if size is not None and not msg.lease_large:
                answer(0, size=size)  # only sized: the client reads it with a leased lookup
                continue
            to_lease.append(n)
            answer(int(KeyStatus.MISSING))  # (filled in below)
        if to_lease:
            holds = []
            for n, lease in zip(to_lease, seg.lease_many([msg.keys[n] for n in to_lease])):
                if not isinstance(lease, Lease):
                    st[n] = int(lease)
                    continue
                lid = next(self._ids)
                m = lease.meta
                region, cb = self.regions[m.cls], seg.classes[m.cls].chunk_bytes
                holds.append((lid, lease, region, cb))
                st[n], ids[n], sizes[n], regions[n], chunk[n], offsets[n] = (0, lid, m.size, region.id, cb,
                                                                             list(lease.offsets))
            if holds:
                try:
                    conn.hold_many(holds, write=False)  # (all or none, as a Reserve's)
                except Exception:
                    for _, lease, _, _ in holds:  # nothing else would release them
                        lease.release()
                    raise
        return Leased(msg.rid, st, ids, sizes, regions, chunk, offsets, data)

    def metrics_text(self) -> str:
        return prometheus_text(segment_metrics(self.segment), {"node": self.name})

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self.registration is not None:
            self.registration.close()
        self.listener.close()
        self._http.shutdown()
        self._http.server_close()
        self.segment.flush()
        self.te.close()

    def __enter__(self) -> "StoreNode":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


StoreNode._handlers = {
    Reserve: StoreNode._reserve, Bind: StoreNode._bind, Commit: StoreNode._commit, PutInline: StoreNode._put_inline,
    Lookup: StoreNode._lookup, GetValue: StoreNode._get_value, Release: StoreNode._release, Sizes: StoreNode._sizes,
    Remove: StoreNode._remove, RemoveAll: StoreNode._remove_all, Stats: StoreNode._stats,
    ExistsKeys: StoreNode._exists,  # (off the wire: NodeRequest)
    Exists: StoreNode._exists,  # (handed in by a caller in this process)
}


def _metrics_server(address: str, node: StoreNode) -> ThreadingHTTPServer:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument(f"--metrics must be HOST:PORT, got {address!r}")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics here")
                return
            body = node.metrics_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    try:
        return ThreadingHTTPServer((host, int(port)), Handler)
    except OSError as e:
        raise InvalidArgument(f"cannot serve /metrics on {address}: {e}") from e
