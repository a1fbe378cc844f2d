"""The pool as a deployment: the store nodes etcd lists, keys placed by rendezvous
hashing (placement.py), bytes moved by this client's transfer engine straight between
the caller's memory and the nodes' slots.

A put reserves slots on each of the key's ``replicas`` top nodes, writes every replica
with one transfer batch per node (all nodes' batches in flight together), then commits
the replicas whose transfer succeeded; a key is OK when at least one replica committed
(fewer than asked is counted as ``under_replicated``). Over TCP the node publishes the
objects as their last byte lands (no commit), and a put of the last put's object size
writes into spare slots the node held for it, named by a ``Bind`` sent beside the writes
(no reservation round trip): docs/store-service.md. A get asks the key's nodes in
rank order: a node that is down or does not hold the key passes the key to the next
one; the first that holds it leases the chunks, the client reads them, then releases.
So a lost node's keys come from their other replicas, or are reported missing once
every live node was asked; never another key's bytes (chunk keys are unique per put).
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np

from .._core import ObjectBatch, Peer, TransferEngine
from ..net.etcd import EtcdClient
from ..deploy.settings import read_token
from ..errors import InvalidArgument, ServiceUnavailable
from .buffers import RegisteredBuffer, RegisteredBuffers, address_of, scatter, view_at
from .links import NodeDown, NodeLink, Pending
from .members import NodeDirectory
from .node_links import NodeLinks
from .metrics import PoolMetrics
from .placement import rank_nodes
from .ranked import RankedAsks
from .objects import clip_sizes
from .protocol import (INLINE_MAX, SPARE_BYTES_MAX, Bind, Bound, Commit, Exists, GetValue, Leased, Lookup, PutInline,
                       Release, Remove, RemoveAll, Reserve, Reserved, Sizes, Stats)
from .status import KeyStatus

__all__ = ["RemoteBackend"]

log = logging.getLogger("mooncake_rs.pool")


def _taken(values: list, take: list[int]) -> list:
    """The entries ``take`` (ascending positions) of one node's per-entry list: the list
    itself when every entry is taken."""
    return values if len(take) == len(values) else [values[j] for j in take]


class _SparePut(NamedTuple):
    """One node's part of a put into its spare slots: the Bind in flight, the slots as a
    ``Reserved``, and the writes' batch."""

    link: NodeLink
    bind: Pending
    rep: Reserved
    batch: ObjectBatch
    take: list[int]


class RemoteBackend:
    def __init__(self, etcd: str, *, auth_token: str | bytes | None, prefix: str, name: str | None,
                 wait_nodes: int, timeout_s: float, io_timeout_s: float,
                 transports: tuple[str, ...] = ("tcp", "shm"), tcp_connections: int | None = None,
                 plaintext: bool = False, spin_us: int = 0) -> None:
        if isinstance(auth_token, bytes):
            auth_token = auth_token.decode()
        if plaintext and auth_token:
            raise InvalidArgument("plaintext=True talks to nodes started with --plaintext, without a token: "
                                  "drop auth_token, or plaintext")
        self.token: str | None = None if plaintext else (auth_token if auth_token else read_token(None))
        self.io_timeout_s = io_timeout_s
        self.directory = NodeDirectory(EtcdClient(etcd), prefix)
        if not self.directory.wait_for(wait_nodes, timeout_s):
            self.directory.close()
            raise ServiceUnavailable(f"fewer than {wait_nodes} store nodes registered under {prefix} in etcd at "
                                     f"{etcd} after {timeout_s} s; start `mooncake-rs store --etcd {etcd} ...`")
        self.name = name or f"pool-client-{os.getpid()}-{secrets.token_hex(3)}"
        self.te = TransferEngine(self.name, listen="", auth_token=self.token, transports=list(transports),
                                 connections_per_endpoint=tcp_connections)
        self.buffers = RegisteredBuffers()  # DistributedStore replaces it with its own
        self.nodes = NodeLinks(self.directory, self.token, self.te, io_timeout_s, spin_s=spin_us / 1e6)
        self.ranked = RankedAsks(self.nodes)
        self.replicas_lost = 0
        self.under_replicated = 0

    # ---- memory
    def register(self, buf: RegisteredBuffer) -> RegisteredBuffer:
        region = self.te.register(view_at(buf.ptr, buf.size))
        return RegisteredBuffer(buf.ptr, buf.size, region)

    def unregister(self, buf: RegisteredBuffer) -> None:
        if buf.region is not None:
            self.te.unregister(buf.region)

    def _submit(self, op: str, peer: Peer, ptrs: list[list[int]], sizes: list[list[int]], totals: list[int],
                rep: Reserved | Leased, take: list[int]) -> ObjectBatch:
        """One node's objects as one transfer batch, planned in Rust (object_layout.rs):
        the caller's pieces (``ptrs``, ``sizes``) and bytes that move (``totals``) of the
        node's answer's entries ``take``. The caller's registered buffers are looked up
        there; other memory is registered until the batch is released."""
        regions, chunk, offsets = (_taken(rep.regions, take), _taken(rep.chunk_bytes, take),
                                   _taken(rep.offsets, take))
        return self.te.submit_objects(op, peer, ptrs, sizes, totals, regions, chunk, offsets, self.buffers.regions(),
                                      timeout_s=max(self.io_timeout_s, 30.0))

    # ---- puts
    def put_many(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]], replicas: int,
                 pin: bool) -> list[KeyStatus]:
        live = self.nodes.live()
        if not live:
            return [KeyStatus.RPC_FAILED] * len(keys)
        by_node: dict[str, list[int]] = defaultdict(list)
        for i, k in enumerate(keys):
            for node in rank_nodes(k, live)[:replicas]:
                by_node[node].append(i)
        done = [0] * len(keys)
        errors: list[KeyStatus | None] = [None] * len(keys)
        retry = self._put_on(by_node, keys, ptrs, sizes, pin, done, errors, spares=True)
        if retry:  # nodes that refused a Bind (its spares had expired): those keys again, with a Reserve
            self._put_on(retry, keys, ptrs, sizes, pin, done, errors, spares=False)
        return self._outcome(done, errors, replicas)

    def _put_on(self, by_node: dict[str, list[int]], keys: list[str], ptrs: list[list[int]],
                sizes: list[list[int]], pin: bool, done: list[int], errors: list[KeyStatus | None],
                spares: bool) -> dict[str, list[int]]:
        """Puts key ``i`` on each node whose ``by_node`` entry lists it, counting a replica
        placed in ``done[i]`` and the first reason one was not in ``errors[i]``. ``spares``
        False: no spare slots are used. Returns the nodes that refused a Bind, each with its
        keys, placed nowhere there yet."""
        totals = [sum(s) for s in sizes]
        retry: dict[str, list[int]] = {}
        refill: list[tuple[NodeLink, int, int]] = []  # links whose spares this put used: (link, count, size)

        def fail(idx: list[int], st: KeyStatus) -> None:
            for i in idx:
                errors[i] = errors[i] or st

        def settle(idx: list[int], res: list[int]) -> None:
            for i, st in zip(idx, res):
                if st == 0:
                    done[i] += 1
                else:
                    errors[i] = errors[i] or KeyStatus(st)

        batches: list[ObjectBatch] = []
        try:
            # every node is asked before any answer is read: their round trips overlap. A
            # node whose spare slots fit the put gets a Bind and its writes at once
            asked = []  # (node, small indices, their PutInline, large indices, their Reserve or _SparePut)
            for node, all_idx in by_node.items():
                small = [i for i in all_idx if 0 < totals[i] <= INLINE_MAX]
                large = [i for i in all_idx if not 0 < totals[i] <= INLINE_MAX]
                inline = None
                reserve: _SparePut | Pending | NodeDown | None = None
                if small:
                    values = [b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs[i], sizes[i])) for i in small]
                    inline = self.nodes.asked(node, PutInline, keys=[keys[i] for i in small], values=values, pin=pin)
                if large:
                    size = totals[large[0]]
                    link, lands, want = self._spares_wanted(node, [totals[i] for i in large], spares)
                    reserve = self._put_into_spares(link, node, [keys[i] for i in large], [ptrs[i] for i in large],
                                                    [sizes[i] for i in large], size, pin) if link and want else None
                    if reserve is not None:
                        batches.append(reserve.batch)
                    else:
                        held = link.spares.held(size) if link and want else 0
                        reserve = self.nodes.asked(node, Reserve, keys=[keys[i] for i in large],
                                                   sizes=[totals[i] for i in large], pin=pin, engine=self.name,
                                                   commit_on_landing=lands, spares=max(want - held, 0),
                                                   spare_size=size if want > held else 0)
                asked.append((node, small, inline, large, reserve))
            # (node, link, idx, reserved, batch, the answer's entries it moves, _SparePut or None)
            pending: list[tuple[str, NodeLink, list[int], Reserved, ObjectBatch | None, list[int], _SparePut | None]] = []
            for node, small, inline, idx, reserve in asked:
                if inline is not None:
                    try:
                        settle(small, self.nodes.answer(node, inline).values)
                    except NodeDown as e:
                        log.warning("put: %s", e)
                        fail(small, KeyStatus.RPC_FAILED)
                if reserve is None:
                    continue
                if isinstance(reserve, _SparePut):
                    pending.append((node, reserve.link, idx, reserve.rep, reserve.batch, reserve.take, reserve))
                    continue
                try:
                    rep: Reserved = self.nodes.answer(node, reserve)
                except NodeDown as e:
                    log.warning("put: %s", e)
                    fail(idx, KeyStatus.RPC_FAILED)
                    continue
                link = reserve.link  # type: ignore[union-attr]  # answered: a Pending
                if link.broken:  # closed since the answer: its reservations went with it
                    fail(idx, KeyStatus.RPC_FAILED)
                    continue
                link.spares.add(rep.spares)
                take = []
                for j, i in enumerate(idx):
                    st = rep.statuses[j]
                    if st != 0:
                        errors[i] = KeyStatus(st) if errors[i] in (None, KeyStatus.RPC_FAILED) else errors[i]
                    elif rep.put_ids[j] == 0:
                        done[i] += 1  # already held there
                    else:
                        take.append(j)
                batch = None
                if take:
                    sel = _taken(idx, take)
                    batch = self._submit("write", link.peer, [ptrs[i] for i in sel], [sizes[i] for i in sel],
                                         [totals[i] for i in sel], rep, take)
                    batches.append(batch)
                pending.append((node, link, idx, rep, batch, take, None))
            commits = []  # each node's Commit leaves as soon as its own transfer ended
            for node, link, idx, rep, batch, take, spare in pending:
                ok = [True] * len(idx)
                if batch is not None:
                    for j, moved in zip(take, batch.wait()):
                        ok[j] = moved
                mine = [j for j in range(len(idx)) if rep.put_ids[j] > 0]
                over_tcp = all(link.peer.route(r) == "tcp" for r in {rep.regions[j] for j in take})
                if spare is not None:
                    bound = self._bound(node, spare)
                    if bound is None:  # refused (its spares had expired) or the node is gone
                        if link.broken:
                            fail(idx, KeyStatus.RPC_FAILED)
                        else:
                            retry[node] = idx
                        continue
                    refill.append((link, len(idx), totals[idx[0]]))
                    if bound.published:  # every byte had landed when the keys arrived
                        settle(idx, bound.statuses)
                        continue
                if rep.commit_on_landing and over_tcp and all(ok):
                    # every write succeeded over TCP: the node published the objects before
                    # it answered the last one (Reserved.commit_on_landing); only empty
                    # objects, which have no byte to land, are left to commit
                    for j in mine:
                        if totals[idx[j]]:
                            done[idx[j]] += 1
                    mine = [j for j in mine if not totals[idx[j]]]
                if take:
                    link.writes_land = over_tcp  # (what the next put to this node asks for)
                if mine:
                    try:  # on the connection that holds the reservations
                        commit: Pending | NodeDown = link.submit(Commit, put_ids=[rep.put_ids[j] for j in mine],
                                                                 ok=[ok[j] for j in mine])
                    except NodeDown as e:
                        commit = e
                    commits.append((node, [idx[j] for j in mine], commit))
            for node, committed, commit in commits:
                try:
                    settle(committed, self.nodes.answer(node, commit).values)
                except NodeDown as e:
                    log.warning("put commit: %s", e)
                    fail(committed, KeyStatus.RPC_FAILED)
        finally:
            for b in batches:
                b.release()
        for link, count, size in refill:  # the next put's spares, asked now that these bytes landed
            link.spares.ask(count, size, self.name)
        return retry

    def _put_into_spares(self, link: NodeLink, node: str, keys: list[str], ptrs: list[list[int]],
                         sizes: list[list[int]], size: int, pin: bool) -> _SparePut | None:
        """A put of ``len(keys)`` objects of ``size`` bytes into spare slots the node holds
        for this client: its Bind and its writes leave together, nobody waits for a
        Reserve's answer first (the put asks for the next put's spares once its bytes
        landed). None when the link holds too few spares of that size."""
        taken = link.spares.take(len(keys), size)
        if taken is None:
            return None
        ids, regions, chunk, offsets = (list(col) for col in zip(*taken))
        # (the spare slots as a Reserve would have answered them: the rest of the put is its)
        rep = Reserved(0, [0] * len(keys), ids, regions, chunk, offsets, commit_on_landing=True)
        take = list(range(len(keys)))
        try:
            batch = self._submit("write", link.peer, ptrs, sizes, [size] * len(keys), rep, take)
        except BaseException:
            link.spares.give_back(ids)  # (nothing was sent into them)
            raise
        try:
            bind = link.submit(Bind, put_ids=ids, keys=keys, pin=pin)
        except NodeDown:  # (the link broke: the spares went with its connection)
            batch.wait()
            batch.release()
            self.nodes.mark_down(node)
            return None
        return _SparePut(link, bind, rep, batch, take)

    def _bound(self, node: str, spare: _SparePut) -> Bound | None:
        """The answer to a spare put's Bind, read after its writes ended. None when the node
        refused it (its spares had expired: they are given back, and the caller puts the
        keys again through a Reserve) or its link broke."""
        link = spare.link
        try:
            bound: Bound = spare.bind.result()
        except NodeDown as e:
            if link.broken:
                log.warning("put: %s", e)
                self.nodes.mark_down(node)
            else:
                log.info("put into spare slots: %s; reserving instead", e)
                # (the writes ended: nothing reaches them any more; the link's other spares
                # ended with the same holds, most likely)
                link.spares.give_back(spare.rep.put_ids + link.spares.drop())
            return None
        return bound

    def _spares_wanted(self, node: str, totals: list[int], spares: bool) -> tuple[NodeLink | None, bool, int]:
        """The link to ``node`` (None: it cannot be asked); whether this engine's writes into
        its regions go over TCP, where the node sees them land (``NodeLink.writes_land``: not
        a same-host node's shared memory or staging link); and how many spare slots a put of
        objects of ``totals`` bytes to it wants: one an object when they land, are all of
        one size (above ``INLINE_MAX``, at most ``SPARE_BYTES_MAX`` in all) and the last put
        to that node had that size too (``SpareSlots.note_put``: a client whose sizes change
        from put to put would only churn them)."""
        try:
            link = self.nodes.link(node)
        except NodeDown:
            return None, False, 0  # (the Reserve fails the same way)
        repeated = link.spares.note_put(totals)
        size = totals[0]
        if not (spares and link.writes_land and repeated and size > INLINE_MAX
                and len(totals) * size <= SPARE_BYTES_MAX):
            return link, link.writes_land, 0
        return link, True, len(totals)

    def _outcome(self, done: list[int], errors: list[KeyStatus | None], replicas: int) -> list[KeyStatus]:
        """OK for a key at least one replica took (fewer than asked: counted), else why not."""
        out = []
        for n, err in zip(done, errors):
            if n:
                if n < replicas:
                    self.under_replicated += 1
                out.append(KeyStatus.OK)
            else:
                out.append(err or KeyStatus.RPC_FAILED)
        return out

    def put_one(self, key: str, value: Any, replicas: int, pin: bool) -> KeyStatus:
        """``put_values([key], [value], ...)[0]``: a small ``bytes`` value to a one-node pool
        is one ``PutInline`` and its status, without the batch's per-key lists (what one
        Mooncake ``put`` pays for); anything else as ``put_values``."""
        live = self.nodes.live()
        if value.__class__ is not bytes or not 0 < len(value) <= INLINE_MAX or len(live) != 1:
            return self.put_values([key], [value], replicas, pin)[0]
        rep = self.nodes.ask_one(live[0], PutInline, keys=[key], values=[value], pin=pin)
        if rep is None or not rep.values:  # (no answer, or a short one)
            return KeyStatus.RPC_FAILED
        st = rep.values[0]
        if st != 0:
            return KeyStatus(st)
        if replicas > 1:  # (as _outcome counts a key fewer nodes took than asked)
            self.under_replicated += 1
        return KeyStatus.OK

    def put_values(self, keys: list[str], values: list[Any], replicas: int, pin: bool) -> list[KeyStatus]:
        """Values given as buffers. When all are small, their bytes go inside the
        ``PutInline`` messages themselves, one per node (one round trip, no address or
        copy taken here); else as ``put_many``."""
        try:
            views = [memoryview(v).cast("B") for v in values]
        except TypeError:  # not C-contiguous: address_of makes a contiguous copy
            views = []
        if not views or any(not 0 < v.nbytes <= INLINE_MAX for v in views):
            held = [address_of(v) for v in values]
            return self.put_many(keys, [[p] for _, p in held], [[a.size] for a, _ in held], replicas, pin)
        live = self.nodes.live()
        if not live:
            return [KeyStatus.RPC_FAILED] * len(keys)
        if len(live) == 1:  # one node takes every key: one request, its answer mapped as it is
            rep = self.nodes.ask_one(live[0], PutInline, keys=keys, values=views, pin=pin)
            got = rep.values if rep is not None else []
            out = [KeyStatus.OK if st == 0 else KeyStatus(st) for st in got[:len(keys)]]
            out += [KeyStatus.RPC_FAILED] * (len(keys) - len(out))  # (no answer, or a short one)
            if replicas > 1:  # (as _outcome counts a key fewer nodes took than asked)
                self.under_replicated += out.count(KeyStatus.OK)
            return out
        by_node: dict[str, list[int]] = defaultdict(list)
        for i, k in enumerate(keys):
            for node in rank_nodes(k, live)[:replicas]:
                by_node[node].append(i)
        groups = list(by_node.items())
        asks: list[tuple[str, type, dict[str, Any]]] = [
            (node, PutInline, {"keys": [keys[i] for i in idx], "values": [views[i] for i in idx], "pin": pin})
            for node, idx in groups]
        answers = self.nodes.ask_each(asks)
        done = [0] * len(keys)
        errors: list[KeyStatus | None] = [None] * len(keys)
        for (_, idx), rep in zip(groups, answers):
            for i, st in zip(idx, rep.values if rep is not None else [int(KeyStatus.RPC_FAILED)] * len(idx)):
                if st == 0:
                    done[i] += 1
                elif errors[i] is None:
                    errors[i] = KeyStatus(st)
        return self._outcome(done, errors, replicas)

    # ---- gets
    def get_many(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        live = self.nodes.live()
        ranks = [rank_nodes(k, live) for k in keys]
        result: list[int] = [int(KeyStatus.MISSING)] * len(keys)
        todo = list(range(len(keys)))
        batches: list[ObjectBatch] = []
        try:
            for rnd in range(len(live)):
                by_node: dict[str, list[int]] = defaultdict(list)
                for i in todo:
                    if rnd < len(ranks[i]):
                        by_node[ranks[i][rnd]].append(i)
                if not by_node:
                    break
                todo = []
                # every node of this round is asked before any answer is read
                asked = [(node, idx, self.nodes.asked(node, Lookup, keys=[keys[i] for i in idx], inline_max=INLINE_MAX,
                                                      engine=self.name))
                         for node, idx in by_node.items()]
                inflight = []
                for node, idx, lookup in asked:
                    try:
                        rep: Leased = self.nodes.answer(node, lookup)
                    except NodeDown as e:
                        log.warning("get: %s", e)
                        self.replicas_lost += len(idx)
                        todo.extend(idx)
                        continue
                    link = lookup.link  # type: ignore[union-attr]  # answered: a Pending
                    if link.broken:  # closed since the answer: its leases went with it
                        todo.extend(idx)
                        continue
                    take, leases = [], []
                    for j, i in enumerate(idx):
                        if rep.statuses[j] != 0:
                            todo.append(i)
                            continue
                        if rep.lease_ids[j] == 0:  # a small value, in the answer itself
                            if sum(sizes[i]) < rep.sizes[j]:
                                result[i] = int(KeyStatus.INVALID)
                            else:
                                scatter(np.frombuffer(rep.data[j], dtype=np.uint8), ptrs[i], clip_sizes(sizes[i], rep.sizes[j]))
                                result[i] = rep.sizes[j]
                            continue
                        leases.append(rep.lease_ids[j])
                        if sum(sizes[i]) < rep.sizes[j]:
                            result[i] = int(KeyStatus.INVALID)
                            continue
                        take.append(j)
                    batch = None
                    if take:
                        sel = _taken(idx, take)
                        batch = self._submit("read", link.peer, [ptrs[i] for i in sel], [sizes[i] for i in sel],
                                             _taken(rep.sizes, take), rep, take)
                        batches.append(batch)
                    inflight.append((node, link, idx, rep, batch, take, leases))
                for node, link, idx, rep, batch, take, leases in inflight:
                    if batch is not None:
                        for j, moved in zip(take, batch.wait()):
                            if moved:
                                result[idx[j]] = rep.sizes[j]
                            else:
                                result[idx[j]] = int(KeyStatus.MISSING)
                                todo.append(idx[j])  # try the next replica
                    if leases:
                        # nobody waits for this answer: the bytes are here, the node frees the
                        # leases when it reads the request (or when this connection closes)
                        try:
                            link.post(Release, lease_ids=leases)
                        except NodeDown:
                            pass
                if not todo:
                    break
        finally:
            for b in batches:
                b.release()
        return result

    def get_bytes_many(self, keys: list[str]) -> list[bytes | None]:
        """Small values come back inside the lookup (one round trip); larger ones are read
        by ``get_many`` into buffers of the size the lookup reported."""
        if len(keys) == 1:
            return [self.get_one(keys[0])]
        return self._get_bytes_ranked(keys)

    def _get_bytes_ranked(self, keys: list[str]) -> list[bytes | None]:
        """``get_bytes_many``, each key asked of its nodes in rank order (ranked.py)."""
        out: list[bytes | None] = [None] * len(keys)
        large: dict[int, int] = {}

        def take(idx: list[int], rep: Leased | None) -> list[int]:
            if rep is None:
                self.replicas_lost += len(idx)
                return idx
            retry = []
            for j, i in enumerate(idx):
                if rep.statuses[j] != 0:
                    retry.append(i)
                elif rep.sizes[j] <= INLINE_MAX:
                    out[i] = bytes(rep.data[j])
                else:
                    large[i] = rep.sizes[j]
            return retry

        self.ranked.by_rank(keys, lambda idx: (Lookup, {"keys": [keys[i] for i in idx], "inline_max": INLINE_MAX,
                                                  "lease_large": False}), take)
        return self._read_sized(keys, out, large)

    def get_one(self, key: str) -> bytes | None:
        """``get_bytes_many([key])[0]``; of a one-node pool, one ``GetValue`` with no
        ranking, closures or per-key lists (what one Mooncake ``get`` pays for)."""
        live = self.nodes.live()
        if len(live) != 1:
            return self._get_bytes_ranked([key])[0]
        one = self.nodes.ask_one(live[0], GetValue, key=key)
        if one is None:
            self.replicas_lost += 1
            return None
        if one.status != 0:
            return None
        if one.size <= INLINE_MAX:
            return one.data
        return self._read_sized([key], [None], {0: one.size})[0]

    def _read_sized(self, keys: list[str], out: list[bytes | None], large: dict[int, int]) -> list[bytes | None]:
        """``out`` with the values too large to come inline (index -> size) read by ``get_many``."""
        if large:
            idx = list(large)
            bufs = [np.empty(large[i], dtype=np.uint8) for i in idx]
            got = self.get_many([keys[i] for i in idx], [[b.ctypes.data] for b in bufs], [[b.nbytes] for b in bufs])
            for i, b, g in zip(idx, bufs, got):
                out[i] = b.tobytes() if g == b.nbytes else None
        return out

    # ---- metadata
    def exists_flags(self, keys: list[str]) -> list[int]:
        # (the nodes answer 1/0: one node's answer list is handed on as it came)
        return self.ranked.values(keys, Exists, (1).__eq__)

    def size_many(self, keys: list[str]) -> list[int | None]:
        vals = self.ranked.values(keys, Sizes, lambda v: v >= 0)
        return [v if v >= 0 else None for v in vals]

    def remove_many(self, keys: list[str]) -> list[bool]:
        removed = [False] * len(keys)
        for rep in self.nodes.ask_each([(node, Remove, {"keys": keys}) for node in self.nodes.live()]):  # every replica
            if rep is not None:
                removed = [r or bool(v) for r, v in zip(removed, rep.values)]
        return removed

    def remove_all(self) -> int:
        return sum(rep.values[0] for rep in self.nodes.ask_each([(n, RemoveAll, {}) for n in self.nodes.live()])
                   if rep is not None)

    def metrics(self) -> PoolMetrics:
        m = PoolMetrics()
        for rep in self.nodes.ask_each([(n, Stats, {}) for n in self.nodes.live()]):
            if rep is not None:
                m = m + PoolMetrics(**{k: int(v) for k, v in rep.metrics.items()
                                       if k in PoolMetrics.__dataclass_fields__})
        m.replicas_lost, m.under_replicated = self.replicas_lost, self.under_replicated
        return m

    def close(self) -> None:
        self.nodes.close()
        self.directory.close()
        self.te.close()
