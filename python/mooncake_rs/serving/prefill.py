"""Prefill behaviour of an instance.

For each request a decode instance hands it (``Prefill``, on the peer link, with the
slots it reserved): take the prefix blocks this instance holds, fetch the ones the
decision names from their holders into the local store (a ``MultiFetch``, multisource.py:
a share from each holder at once, or all of it from the one holder when the decision
names no others; then ``Fetched`` tells the cluster the holders may unpin), load them all into
pages through ``Engine.add_request(restored_kv=...)``, and compute the rest in chunks.

A request whose local prefix is still being made by an earlier request on this instance
(a session's next step routed behind its queued predecessor: the conductor priced those
blocks as local, docs/conductor.md "Pending prefixes") waits for that request to store
its blocks, then looks its local prefix up again when it is handed to the engine, so it
reuses them rather than computing them a second time. Its fetch, if any, of the blocks
after that prefix runs meanwhile. A fetch the conductor did not price as a prefetch
(``Prefill.prefetch`` False: its staging room was full) starts only when the requests
computing here before it are done (its dequeue, as the simulator runs it), so it does not
take store room while they compute. When a request goes into the engine the cluster is
told ``Started`` (the conductor's queue counts it running from then, not from dispatch).
After each layer of each step, ``on_layer`` saves that layer's part of every newly
completed full block into a reserved store slot and queues its copy into the slot the
decode instance reserved, so sending overlaps the next layers' compute. The partial
last block (no hash) goes to a request-scoped slot of the decode instance. When the
engine has the first token and every copy is done, the new blocks are committed (store
events -> conductor index) and the decode instance is told ``KvReady`` directly.

``Cancel`` comes from the cluster, which waits for the ``Cancelled`` ack before it lets
the decode instance free the slots we write into (and the holder unpin what we read).
A cancel can overtake its ``Prefill`` (they come on different links): the rid is then
remembered, and the ``Prefill`` dropped when it comes.
"""

from __future__ import annotations

import collections
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from .._core import BlockHashes
from .multisource import FetchSource, MultiFetch
from .protocol import (Cancel, Cancelled, Failed, Fetched, InstanceSpec, KvReady, Message, Prefill, PrefillReport,
                       ProtocolError, Started, op_of)
from .role import RoleContext
from .transport import Span

__all__ = ["PrefillRole", "shared_blocks"]

#: rids remembered for a cancel that overtook its Prefill, and rids whose Prefill came
#: (a cancel for those needs no such memory); bounded, oldest forgotten first
_REMEMBER = 1 << 16


class _Recent:
    """A bounded set of ints (insertion order; the oldest go first)."""

    def __init__(self, cap: int = _REMEMBER) -> None:
        self._d: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._cap = cap

    def add(self, x: int) -> None:
        self._d[x] = None
        if len(self._d) > self._cap:
            self._d.popitem(last=False)

    def pop(self, x: int) -> bool:
        return self._d.pop(x, 0) is None

    def __contains__(self, x: int) -> bool:
        return x in self._d


@dataclass
class _PState:
    rid: int
    keys: BlockHashes  # every full prompt block's hash (a buffer, no int per block)
    prompt_len: int
    dest: Any  # protocol.Dest
    dest_ep: dict[str, Any]
    decode: int
    t_start: float
    local: int = 0  # blocks the decision reuses from this instance (Prefill.local)
    leases: list[Any] = field(default_factory=list)  # Blocks held (reused prefix)
    fetched_run: list[Any] = field(default_factory=list)  # blocks local..local+n the fetch brought
    after: set[int] = field(default_factory=set)  # earlier requests here that make part of its prefix
    parked: bool = False  # ready, but waiting for ``after`` to store their blocks
    deferred: bool = False  # its fetch waits for the requests computing before it (not a prefetch)
    new_slots: dict[int, Any] = field(default_factory=dict)  # block -> WritableBlock being filled
    partial: Any = None  # WritableBlock of the partial last block (request-scoped, never committed)
    error: str | None = None
    reused: int = 0
    fetched: int = 0
    first: int | None = None
    finish: str | None = None
    done: bool = False
    t_compute: float = 0.0
    t_engine: float = 0.0  # when it joined the engine (after any fetch)
    busy_s: float = 0.0  # this instance's time spent on it (PrefillReport.busy_s)
    msg: Any = None  # the Prefill, until computing starts
    in_fetch: bool = False
    fetch: MultiFetch | None = None  # the prefix fetch in flight (it holds its own slots)
    sources: int = 0  # holders the fetch read from
    fetch_bytes: int = 0  # bytes the fetch moved (under its own transport tags)
    fetch_s: float = 0.0  # the fetch's start (monotonic), then how long it took


class PrefillRole:
    """A prefill instance's behaviour (role.Role)."""

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.engine, self.store, self.transport = ctx.engine, ctx.store, ctx.transport
        self.layout = ctx.engine.layout
        self.up = ctx.up  # to the cluster
        self.peers = ctx.peers  # decode instance id -> link
        self.flush = ctx.flush  # store events to the cluster
        self.kv_events = ctx.kv_events  # a kv_events.KVEventsOut when the instance publishes
        self.reqs: dict[int, _PState] = {}
        self._free_at = 0.0  # when the latest request's compute and save ended (busy_s)
        self._overtaken = _Recent()  # cancelled before their Prefill came
        self._seen = _Recent()

    @property
    def spec(self) -> InstanceSpec:
        return self.ctx.spec

    def busy(self) -> bool:
        return any(st.done or st.in_fetch or st.parked or st.deferred for st in self.reqs.values())

    def send_pending(self) -> None:
        pass  # everything goes out when it happens

    def tracked(self) -> int:
        """Requests this role still holds state (pages, leases, slots) for."""
        return len(self.reqs)

    def rids(self) -> list[int]:
        """The requests ``tracked`` counts."""
        return list(self.reqs)

    def holds(self, rid: int) -> bool:
        return rid in self.reqs

    # ---- messages
    def handle(self, src: int, msg: Message) -> None:
        match msg:
            case Prefill(rid=rid):
                if src != msg.decode:  # the answer goes back on the link it came on
                    raise ProtocolError(f"a Prefill from instance {src} names decode {msg.decode}")
                if self._overtaken.pop(rid):
                    return  # cancelled before it came: the cluster was told Cancelled already
                self._seen.add(rid)
                try:
                    self._start(msg)
                except BaseException:  # fails alone (the instance reports it): hold nothing for it
                    self._drop(rid)
                    raise
            case Cancel(rid=rid):
                self._cancel(rid)
            case _:
                raise ProtocolError(f"a prefill instance does not take {op_of(msg)}")

    def _start(self, msg: Prefill) -> None:
        store = self.store
        rid, keys = msg.rid, BlockHashes(msg.keys)
        st = _PState(rid, keys, len(msg.prompt), msg.dest, msg.dest.arena.as_dict(), msg.decode, time.monotonic())
        st.msg, st.local = msg, msg.local
        self.reqs[rid] = st  # first: a failure below drops it with what it holds
        if self.kv_events is not None:  # the tokens of the blocks this request may store
            self.kv_events.learn(keys, msg.prompt)
        slots: list[Any] = store.lookup_prefix(keys[:msg.local])
        st.leases = slots
        coming = self._made_here(st, len(slots))
        fetch = msg.fetch
        if fetch is None or max(len(slots), coming) < msg.local:
            if fetch is not None:
                self.up(Fetched(rid))  # not fetched after all: the holder may let go
            self._ready(st)
        elif msg.prefetch or not self._computing_before(st):
            self._fetch(st, msg)
        else:
            st.deferred = True

    def _computing_before(self, st: _PState) -> bool:
        """Whether a request that came here before ``st`` is in the engine, not done."""
        for other in self.reqs.values():
            if other is st:
                return False
            if other.t_engine and not other.done:
                return True
        return False

    def _made_here(self, st: _PState, have: int) -> int:
        """How many of ``st``'s local blocks (``st.local``; ``have`` of them are in the
        store now) the requests already on this instance will have stored when they end:
        the longest prefix shared with one of them. Records in ``st.after`` each one that
        brings more than ``have``."""
        best = have
        for other in self.reqs.values():
            if other is st:  # the ones after it came later
                break
            n = shared_blocks(other.keys, st.keys, st.local)
            if n > have:
                st.after.add(other.rid)
                best = max(best, n)
        return best

    def _ready(self, st: _PState) -> None:
        """Its fetch (if any) is in: compute now, or once the earlier requests making
        its local prefix have stored it (``poll`` hands it over then)."""
        if any(r in self.reqs for r in st.after):
            st.parked = True
        else:
            self._compute(st)

    def _fetch(self, st: _PState, msg: Prefill) -> None:
        """Starts a read of each holder's share (the decision's holder alone, or with
        ``fetch_also`` the others too, split by ``fetch_split``, which the cluster made from
        the holders' free bandwidth) and returns: the instance loop goes on computing
        other requests; ``poll`` drives the fetch to its end."""
        fetch = msg.fetch
        assert fetch is not None
        sources = [FetchSource(f.holder, f.arena.as_dict(), f.offsets) for f in (fetch, *msg.fetch_also)]
        st.fetch = MultiFetch(self.transport, self.store, BlockHashes(fetch.keys).tolist(), sources,
                              msg.fetch_split or None)
        st.in_fetch, st.fetch_s = True, time.monotonic()
        st.fetch.start()

    def _fetched(self, st: _PState, mf: MultiFetch) -> None:
        """Every share has ended: the run is committed whole or not at all (a share that
        failed and could not be read around), the cluster is told, the rest computed."""
        st.in_fetch, st.fetch = False, None
        st.fetch_s = time.monotonic() - st.fetch_s
        res = mf.finish()
        st.fetched_run = list(res.blocks)
        st.fetched += res.fetched
        st.fetch_bytes += res.bytes
        st.sources = sum(1 for n in res.per_holder.values() if n) if res.error is None else 0
        self.up(Fetched(st.rid))
        self._ready(st)

    def _compute(self, st: _PState) -> None:
        """The prefix is in: send the reused blocks to decode and prefill the rest."""
        store, msg = self.store, st.msg
        assert msg is not None
        st.parked = False
        if st.after and len(st.leases) < st.local:  # what the requests before it stored since
            again: list[Any] = store.lookup_prefix(st.keys[:st.local])
            keep, drop = (again, st.leases) if len(again) > len(st.leases) else (st.leases, again)
            for s in drop:
                s.release()
            st.leases = keep
        if st.fetched_run:  # the fetched run follows the local prefix; after a gap it is of no use
            if len(st.leases) == st.local:
                st.leases.extend(st.fetched_run)
            else:
                for s in st.fetched_run:
                    s.release()
                st.fetched = 0
            st.fetched_run = []
        usable = (st.prompt_len - 1) // self.spec.block_size
        for s in st.leases[usable:]:
            s.release()
        slots = st.leases[:usable]
        st.leases, st.reused = slots, len(slots)
        st.fetched = min(st.fetched, st.reused)
        st.msg = None
        spans: list[Span] = []
        for i, s in enumerate(slots):  # reused blocks travel right away, while the rest computes
            self._span(st, i, store.offset(s), 0, store.block_bytes, spans)
        self._write(st, spans)
        stream = self.spec.stream_layers
        st.t_engine = time.monotonic()
        self.engine.add_request(msg.prompt, msg.params,
                                request_id=str(st.rid), restored_kv=[store.view(s) for s in slots],
                                prefill_only=True, hold_kv=True,
                                on_layer=functools.partial(self._on_layer, st) if stream else None)
        self.up(Started(st.rid))  # the conductor's queue: running from now, not from dispatch

    def _span(self, st: _PState, block: int, src_off: int, span_off: int, n: int, out: list[Span]) -> None:
        off = st.dest.blocks[block] if block < len(st.keys) else st.dest.partial
        if off is not None:  # None: the decode instance already holds this block
            out.append(Span(src_off + span_off, off + span_off, n))

    def _write(self, st: _PState, spans: list[Span]) -> None:
        if spans:
            self.transport.write(st.rid, st.dest_ep, spans)

    def _slot(self, st: _PState, i: int) -> Any:
        if i < len(st.keys):
            if i not in st.new_slots:
                st.new_slots[i] = self.store.reserve(st.keys[i])
            return st.new_slots[i]
        if st.partial is None:
            st.partial = self.store.reserve_scratch(st.rid)
        return st.partial

    def _save(self, st: _PState, blocks: tuple[int, ...] | range, partial: int | None, layer: int | None) -> None:
        store, engine = self.store, self.engine
        layout = self.layout
        span_off, n = (0, layout.block_nbytes) if layer is None else (layout.layer_span(layer).offset,
                                                                    layout.layer_nbytes)
        spans: list[Span] = []
        full = [i for i in blocks if i >= st.reused]
        if full:  # one call gathers every full block (or its layer) straight into its slot
            slots = [self._slot(st, i) for i in full]
            engine.save_blocks_each(str(st.rid), full, slots, layer)
            for i, s in zip(full, slots):
                self._span(st, i, store.offset(s), span_off, n, spans)
        if partial is not None:
            s = self._slot(st, partial)
            engine.save_block(str(st.rid), partial, store.view(s), layer)
            self._span(st, partial, store.offset(s), span_off, n, spans)
        self._write(st, spans)

    def _on_layer(self, st: _PState, ev: Any) -> None:
        if st.error is not None:
            return
        try:
            self._save(st, ev.blocks, ev.partial_block, ev.layer)
        except Exception as e:  # noqa: BLE001 - never break the engine's step; fail the request
            st.error = f"{type(e).__name__}: {e}"

    # ---- engine outputs and completion
    def on_outputs(self, outs: list[Any]) -> None:
        bs = self.spec.block_size
        for out in outs:
            st = self.reqs.get(int(out.request_id))
            if st is None or not out.finished:
                continue
            if out.error is not None:  # the engine failed this request alone
                self._drop(st.rid)
                self.up(Failed(st.rid, out.error))
                continue
            st.first = out.token_ids[0] if out.token_ids else None
            st.finish = out.finish_reason
            st.t_compute = time.monotonic()
            if not self.spec.stream_layers and st.finish == "prefill":
                nfull = st.prompt_len // bs
                partial = nfull if st.prompt_len % bs else None
                try:
                    self._save(st, range(nfull), partial, None)
                except Exception as e:  # noqa: BLE001 - fail the request, not the instance
                    st.error = f"{type(e).__name__}: {e}"
            # its share of this instance's time: one request of a batched step carries
            # the step, the others only their save (the sum is the time spent)
            end = time.monotonic()
            st.busy_s, self._free_at = end - max(st.t_engine, self._free_at), end
            st.done = True

    def poll(self) -> None:
        for st in [st for st in self.reqs.values() if st.in_fetch]:
            try:
                mf = st.fetch
                if mf is not None and mf.poll():
                    self._fetched(st, mf)
            except Exception as e:  # noqa: BLE001 - fails alone, like a bad Prefill
                self._drop(st.rid)
                self.up(Failed(st.rid, f"{type(e).__name__}: {e}"))
        for rid in [r for r, st in self.reqs.items() if st.done and not self.transport.pending(r)]:
            self._complete(self.reqs.pop(rid))
        # in arrival order, so a request whose predecessor is handed over now waits for it
        for st in [st for st in self.reqs.values() if st.parked or st.deferred]:
            try:
                if st.deferred and not self._computing_before(st):  # its dequeue: the fetch starts
                    st.deferred = False
                    assert st.msg is not None
                    self._fetch(st, st.msg)
                elif st.parked and not any(r in self.reqs for r in st.after):
                    self._compute(st)
            except Exception as e:  # noqa: BLE001 - fails alone, like a bad Prefill
                self._drop(st.rid)
                self.up(Failed(st.rid, f"{type(e).__name__}: {e}"))

    def _complete(self, st: _PState) -> None:
        store, transport = self.store, self.transport
        err = st.error or transport.error(st.rid)
        for wb in st.new_slots.values():
            if err is None:
                store.commit(wb)
            else:
                wb.abort()
        if st.partial is not None:
            st.partial.abort()
        for s in st.leases:
            s.release()
        self.engine.release(str(st.rid))
        if err is not None:
            transport.take_bytes(st.rid)
            self.up(Failed(st.rid, f"KV hand-off failed: {err}"))
            return
        self.flush()  # the index learns the new blocks before the request ends
        report = PrefillReport(st.reused, st.fetched, transport.take_bytes(st.rid) + st.fetch_bytes, st.t_start,
                               st.t_compute, time.monotonic(), st.sources, st.fetch_s if st.sources else 0.0,
                               st.busy_s)
        link = self.peers.get(st.decode)
        if link is not None:  # a lost decode instance: the cluster fails the request
            link.send(KvReady(st.rid, st.first, st.finish or "prefill", report))

    def _cancel(self, rid: int) -> None:
        try:
            if not self._drop(rid) and rid not in self._seen:
                self._overtaken.add(rid)
        finally:
            # The cluster holds back the decode instance's cancel (which frees the slots we
            # write into) and the holder's unpin (of the slots we read) until this ack.
            self.up(Cancelled(rid))

    def _drop(self, rid: int) -> bool:
        st = self.reqs.pop(rid, None)
        if st is None:
            return False
        engine, transport = self.engine, self.transport
        engine.abort(str(rid))
        engine.release(str(rid))
        while transport.pending(rid):  # copies from our slots must end before reuse
            time.sleep(0.001)
        for wb in st.new_slots.values():
            wb.abort()
        if st.partial is not None:
            st.partial.abort()
        for s in (*st.leases, *st.fetched_run):
            s.release()
        if st.fetch is not None:  # waits for its reads (they write into its slots), then frees them
            st.fetch.abort()
            st.fetch = None
        transport.take_bytes(rid)
        return True


def shared_blocks(a: BlockHashes, b: BlockHashes, limit: int) -> int:
    """The number of leading blocks two prompts share, at most ``limit``. The hashes are
    chained (each covers every token before it), so the shared blocks are a prefix and
    equality of the ``n``-th hashes decides it: a binary search."""
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
