"""The disaggregated cluster with links as shared resources and the store's SSD tier.

Used instead of :mod:`.disaggregated`'s loop when ``SimConfig.links`` is on (any of
``nic_bandwidth``, ``storage_bandwidth``, ``ssd_capacity_tokens_per_instance``,
``multipath``). Scheduling, queues and decode batching are the same; what changes is how
long moving KV takes:

- every instance ``k`` has three links (:mod:`.links`, max-min fair): its NIC out
  (``3k``) and in (``3k+1``), each ``nic_bandwidth`` bytes/s, and its link to the SSD
  tier (``3k+2``, ``storage_bandwidth``; reads and demotion writes share it);
- a prefill first loads its reused prefix: blocks in its own DRAM cost nothing; blocks
  in a peer's DRAM cross the peer's NIC out and its own NIC in; blocks on SSD (its own
  or a peer's) are read through its own storage link — the SSD tier is a pool that
  every instance reaches through its storage link (3FS-like; each prefill instance's
  share of it is ``ssd_capacity_tokens_per_instance``, filled by what its DRAM evicts);
- ``multipath`` (DualPath): the SSD part is split between the prefill's own storage
  link and the decode instance's (storage -> decode -> its NIC out -> prefill NIC in),
  the peer-DRAM part across every peer holding the range in DRAM, each split in
  proportion to the path's free bandwidth at that moment (:meth:`_LinkedRun.avail`);
- what is fetched from a peer (its DRAM or its SSD blocks, and what is left of a
  prefetch) is the request's own wait: with it under way at its dequeue the request
  steps aside and the instance computes other requests meanwhile (as the serving
  ``Cluster`` does: ``serving/prefill.py`` polls a request's ``MultiFetch`` while its
  engine computes others); it joins again, first come first served among the ready
  ones, when the fetch has arrived (:mod:`.disaggregated`);
- the instance's own SSD blocks hold the instance: they load when the request takes
  it (the ``Cluster``'s store reads them on the instance's loop, ``lookup_prefix``
  promoting them into DRAM);
- the compute starts when every load flow is done (plus the transfer model's latency);
  the KV streams to the decode instance from then as one flow (prefill NIC out ->
  decode NIC in) and is ready at ``max(prefill end, stream end + latency)``.

The conductor is told every link's capacity and, with ``contention_aware`` (the
default), prices a fetch on the links as loaded: what it scheduled on them (fetches and
KV streams) corrected every ``link_report_every_s`` by each instance's report of the
bytes still queued on its links (:meth:`Links.queued`, what a transfer engine's counters
give). A fetch still running at the decision's ``fetch_abandon_s`` is given up for
recompute when finishing it at its current rate would take longer than recomputing the
blocks it brings (``abandon_late_fetches``). ``estimate_error`` applies to the compute
only here (the links give the transfer times).

With prefetch at decision time (the decision's ``prefetch``), a request's peer load
starts at its admission and overlaps its queue (:mod:`.linked_prefetch`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .._core import BlockCache
from .config import SimConfig
from .disaggregated import _KV_READY, _PREFILL_DONE, _Run
from .links import Flow, Links
from .linked_prefetch import PrefetchLoads, path_of
from .loop import Progress, build_report
from .report import HotSample, Report
from .tiers import prefix_runs, split_runs, store_tiered
from .trace import Request

__all__ = ["run_linked"]

_NET = 3
_ABANDON = 4
# what a flow is for (its tag is (kind, request)): a peer fetch (the request's own wait),
# a KV stream, a demotion write, a replica, a load from the instance's own SSD (holds it)
_LOAD, _STREAM, _WRITE, _REPL, _OWN = 0, 1, 2, 3, 4

PATHS = ("dram_local", "dram_peer", "ssd_direct", "ssd_relay")


class _LinkedRun(PrefetchLoads, _Run):
    def __init__(self, cfg: SimConfig, trace: Sequence[Request], progress: Progress | None) -> None:
        super().__init__(cfg, trace, progress)
        n = cfg.prefill + cfg.decode
        nic = cfg.nic_bandwidth if cfg.nic_bandwidth is not None else self.tm.network_bandwidth
        stor = cfg.storage_bandwidth if cfg.storage_bandwidth is not None else self.tm.ssd_bandwidth
        caps: list[float] = []
        for _ in range(n):
            caps += [nic, nic, stor]
        self.net = Links(caps)
        if cfg.contention_aware:
            for k in range(n):
                self.conductor.set_link_bandwidth(k, nic, stor)
        #: per request: its decision's fetch_abandon_s, and while its peer fetch runs,
        #: (prefill instance, local blocks, the fetch's flows)
        self.abandon_s = [math.inf] * len(trace)
        self.peer_loads: dict[int, tuple[int, int, list[Flow]]] = {}
        self._next_report = 0.0
        #: replicas on their way: flow tag -> (target instance, blocks)
        self.repl_pending: dict[int, tuple[int, list[int]]] = {}
        self._repl_seq = 0
        ssd = cfg.ssd_blocks
        self.ssd: list[BlockCache | None] = [BlockCache(max(ssd, 1), cfg.eviction) if ssd else None for _ in self.pids]
        self.block_bytes = cfg.block_tokens * self.tm.bytes_per_token
        self.bpt = self.tm.bytes_per_token
        self.outstanding = [0] * len(trace)
        #: per request: bytes of its own SSD prefix (loaded when it takes its instance)
        #: and, while they load, that load's flows not done yet
        self.own_ssd = [0.0] * len(trace)
        self.own_left = [0] * len(trace)
        self.own_ssd_t = [0.0] * len(trace)
        self.stream_left = [False] * len(trace)
        self.ended = [False] * len(trace)
        #: admitted with a prefetch and not dequeued yet (its loads' end starts nothing)
        self.in_queue = [False] * len(trace)
        #: per request with a prefetch under way: (first fetched block, end block, its flows)
        self.prefetch_flows: dict[int, tuple[int, int, list[Flow]]] = {}
        self.bytes = dict.fromkeys(PATHS, 0)
        #: per prefill instance, its flow of demotion writes (None: none active)
        self.writes: list[Flow | None] = [None] * cfg.prefill
        self.counters.update(kv_stream_bytes=0, ssd_write_bytes=0, multipath_splits=0, fetch_abandoned=0)
        self._net_version = 0
        #: when the pending network event is due (inf: none)
        self._net_at = math.inf
        self._net_touched = False

    # --- the network's clock ---

    def flow(self, t: float, links: Sequence[int], nbytes: float, kind: int, i: int) -> Flow:
        self._net_touched = True
        return self.net.add_unchecked(t, tuple(links), float(nbytes), (kind, i))

    def sync_net(self) -> None:
        """After a change: make sure an event comes at the next completion. One already
        due no later is kept (if it finds nothing done it schedules the next), so a
        change that only delays completions pushes nothing."""
        if not self._net_touched:
            return
        self._net_touched = False
        nxt = self.net.next_completion()
        if nxt is not None and nxt < self._net_at:
            self._net_version += 1  # the later event goes stale
            self._net_at = nxt
            self.push(nxt, _NET, self._net_version)

    def net_event(self, version: int, t: float) -> None:
        if version != self._net_version:
            return
        self._net_at = math.inf
        self._net_touched = True
        for f in self.net.pop_done(t):
            tag = f.tag
            assert isinstance(tag, tuple)
            kind: int = tag[0]
            i: int = tag[1]
            if kind == _LOAD:
                self.outstanding[i] -= 1
                if self.outstanding[i] == 0 and self.in_queue[i]:
                    self.prefetch_loaded(i, t)
                elif self.outstanding[i] == 0:
                    self.peer_loads.pop(i, None)
                    p = self.s.prefill[i]
                    assert p is not None
                    self.store_fetched(p, i, t)
                    self.loaded(p, i, t, self.tm.latency_s)
            elif kind == _OWN:
                self.own_left[i] -= 1
                if self.own_left[i] == 0:
                    p = self.s.prefill[i]
                    assert p is not None
                    start = self.own_ssd_t[i]
                    self.waited(t + self.tm.latency_s - start)
                    self.compute(p, i, t, self.tm.latency_s)
            elif kind == _REPL:
                to, blocks = self.repl_pending.pop(i)
                self.store(to, blocks, t)
            elif kind == _STREAM:
                self.stream_left[i] = False
                if self.ended[i]:
                    self.kv_to_decode(i, t + self.tm.latency_s)

    def handle(self, t: float, kind: int, a: int, b: int, c: int) -> None:
        if kind == _NET:
            self.net_event(a, t)
        elif kind == _PREFILL_DONE:
            self.prefill_done(a, b, t)
        elif kind == _KV_READY:
            self.kv_ready(a, b, t)
        elif kind == _ABANDON:
            self.maybe_abandon(a, t)
        else:
            self.boundary(a, b, c)
        if self._net_touched:
            self.sync_net()

    def schedule_or_reject(self, i: int, t: float) -> Any:
        d = super().schedule_or_reject(i, t)
        if d is not None and d.fetch_from is not None:
            self.abandon_s[i] = d.fetch_abandon_s
        return d

    def before_arrival(self, t: float) -> None:
        super().before_arrival(t)
        every = self.cfg.link_report_every_s
        if every is not None and self.cfg.contention_aware and t >= self._next_report:
            self.report_links(t)
            self._next_report = t + every

    def report_links(self, t: float) -> None:
        """Every instance tells the conductor what is queued on its links now."""
        net, c = self.net, self.conductor
        net.advance(t)
        for k in range(len(net.cap) // 3):
            c.report_link_load(k, t, net.queued(3 * k), net.queued(3 * k + 1), net.queued(3 * k + 2))

    def arrive(self, i: int, t: float) -> None:
        super().arrive(i, t)
        if self._net_touched:
            self.sync_net()

    # --- prefill: load, compute, store ---

    def dequeue(self, p: int, i: int, t: float) -> None:
        """Request ``i`` leaves ``p``'s queue at ``t``: its prefix is looked up and its
        fetch from a peer starts (or what is left of its prefetch is waited for); with
        nothing under way it takes ``p`` now, otherwise it steps aside until the fetch
        has arrived (its own SSD blocks load when it takes ``p``: :meth:`join`)."""
        keys = self.keys[i]
        s = self.s
        dram, ssd = self.caches, self.ssd
        runs = prefix_runs(dram[p], ssd[p], keys)
        local = sum(n for n, _ in runs)
        if self.blocked(p, i, local):
            return
        local_dram, local_ssd = split_runs(runs, 0, local)
        s.start[i] = t
        self.ready_at[i] = t
        self.own_ssd[i] = local_ssd * self.block_bytes
        reused, peer_dram, peer_ssd = local, 0, 0
        src = s.fetch_from[i]
        pre = self.take_prefetch(i, t, local) if self.in_queue[i] else None
        if pre is not None:
            self.resume_prefetched(p, i, t, local, local_dram, pre)
            return
        if src is not None and s.planned[i] > local:
            self.counters["fetches"] += 1
            if self.cfg.cache == "global":
                sruns = prefix_runs(dram[src], ssd[src], keys[: s.planned[i]])
                held = sum(n for n, _ in sruns)
                if held > local:
                    reused = held
                    peer_dram, peer_ssd = split_runs(sruns, local, held)
                if held < s.planned[i]:
                    self.counters["fetch_fallbacks"] += 1
        s.reused[i] = reused
        s.fetched[i] = reused - local
        if reused:
            self.hits.update(keys[:reused])
        bb = self.block_bytes
        self.bytes["dram_local"] += int(local_dram * bb)
        d = s.decode[i]
        assert d is not None
        n = 0
        if peer_ssd:
            n += self.load_ssd(t, i, p, d, peer_ssd * bb)
        if peer_dram:
            assert src is not None
            before = set(self.net.flows)
            n += self.load_peer(t, i, p, src, keys[local:reused], peer_dram * bb)
            if self.cfg.abandon_late_fetches and math.isfinite(self.abandon_s[i]):
                flows = [f for fid, f in self.net.flows.items() if fid not in before]
                self.peer_loads[i] = (p, local, flows)
                self.push(t + self.abandon_s[i], _ABANDON, i)
        self.outstanding[i] = n
        if n == 0:
            self.join(p, i, t)
        else:
            self.set_aside(p, i)

    def join(self, p: int, i: int, t: float) -> None:
        """Request ``i`` takes ``p`` at ``t``: its own SSD blocks load (``p`` waits for
        them), then it computes."""
        self.busy[p] = True
        self.conductor.on_prefill_started(i, t)
        nbytes = self.own_ssd[i]
        if nbytes:
            d = self.s.decode[i]
            assert d is not None
            self.own_ssd_t[i] = t
            self.own_left[i] = self.load_ssd(t, i, p, d, nbytes, _OWN)
            return
        self.compute(p, i, t, max(0.0, self.ready_at[i] - t))

    def load_ssd(self, t: float, i: int, p: int, d: int, nbytes: float, kind: int = _LOAD) -> int:
        direct = [3 * p + 2]
        if not self.cfg.multipath:
            self.flow(t, direct, nbytes, kind, i)
            self.bytes["ssd_direct"] += int(nbytes)
            return 1
        relay = [3 * d + 2, 3 * d, 3 * p + 1]
        net = self.net
        fd = self.avail(direct[0])
        fr = min(self.avail(k) for k in relay)
        a = nbytes * fd / (fd + fr)
        out = 0
        for links, part, name in ((direct, a, "ssd_direct"), (relay, nbytes - a, "ssd_relay")):
            if part > nbytes * 1e-6:
                self.flow(t, links, part, kind, i)
                self.bytes[name] += int(part)
                out += 1
        if out > 1:
            self.counters["multipath_splits"] += 1
        return out

    def load_peer(self, t: float, i: int, p: int, src: int, rng: Sequence[int], nbytes: float) -> int:
        holders = [src]
        if self.cfg.multipath and rng:
            first, last = rng[0], rng[-1]
            holders += [h for h in self.pids if h != p and h != src and first in self.caches[h] and last in self.caches[h]]
        if len(holders) == 1:
            self.flow(t, [3 * src, 3 * p + 1], nbytes, _LOAD, i)
            self.bytes["dram_peer"] += int(nbytes)
            return 1
        free = [self.avail(3 * h) for h in holders]
        tot = sum(free)
        out = 0
        for h, fr in zip(holders, free):
            part = nbytes * fr / tot
            if part > nbytes * 1e-6:
                self.flow(t, [3 * h, 3 * p + 1], part, _LOAD, i)
                out += 1
        self.bytes["dram_peer"] += int(nbytes)
        if out > 1:
            self.counters["multipath_splits"] += 1
        return out

    def abandon_due(self, i: int, t: float) -> None:
        """Request ``i``'s running fetch is checked for abandonment at ``t``."""
        self.push(t, _ABANDON, i)

    def maybe_abandon(self, i: int, t: float) -> None:
        """Request ``i``'s fetch is due: if it is still running and finishing it at its
        current rates takes longer than recomputing what it brings, give it up."""
        entry = self.peer_loads.pop(i, None)
        if entry is None:
            return
        p, local, flows = entry
        net = self.net
        live = [f for f in flows if f.id in net.flows]
        if not live:
            return
        net.advance(t)
        left_s = max((net.left_now(f) / f.rate if f.rate > 0 else math.inf) for f in live)
        s = self.s
        L = self.trace[i].input_length
        bt = self.cfg.block_tokens
        extra = self.pm.predict(L, min(local * bt, L)) - self.pm.predict(L, min(s.reused[i] * bt, L))
        if left_s <= extra:
            return
        for f in live:
            self.bytes["dram_peer"] -= int(net.left_now(f))  # never sent
            net.remove(t, f)
        self._net_touched = True
        self.counters["fetch_abandoned"] += 1
        s.reused[i] = local
        s.fetched[i] = 0
        self.outstanding[i] -= len(live)
        if self.outstanding[i] == 0:
            self.loaded(p, i, t)

    def avail(self, k: int) -> float:
        """The free bandwidth of link ``k`` for a new flow: what its flows leave unused,
        or, on a full link, the equal share a newcomer gets (cap / (flows + 1)); so a
        busy link still takes a part, in proportion to what it can give."""
        net = self.net
        return max(net.free(k), net.cap[k] / (len(net.on[k]) + 1))

    def compute(self, p: int, i: int, t: float, delay: float = 0.0) -> None:
        """Request ``i`` holds ``p`` and its loads are done at ``t``; the compute starts
        ``delay`` later (the transfer setup latency). The KV stream to decode starts at
        ``t`` (the network cannot take a flow in the future; ``delay`` is a millisecond
        of a much longer stream)."""
        s = self.s
        L = self.trace[i].input_length
        c = self.pm.predict(L, min(s.reused[i] * self.cfg.block_tokens, L))
        if self.factor is not None:
            c *= self.factor[i]
        self.compute_s += c
        self.prefill_busy_s += c
        s.stream_t[i] = t
        d = s.decode[i]
        assert d is not None
        nbytes = L * self.bpt
        self.flow(t, [3 * p, 3 * d + 1], nbytes, _STREAM, i)
        self.counters["kv_stream_bytes"] += int(nbytes)
        self.stream_left[i] = True
        self.ended[i] = False
        self.push(t + delay + c, _PREFILL_DONE, p, i)

    def store_fetched(self, p: int, i: int, t: float) -> None:
        """Request ``i``'s loads are done: the blocks it fetched from a peer (none if it
        was abandoned) are in ``p``'s DRAM from now, and reported (the index learns a
        fetch's replica when the bytes are there, not at the decision)."""
        s = self.s
        if s.fetched[i]:
            r = s.reused[i]
            self.store(p, self.keys[i][r - s.fetched[i] : r], t)

    def store(self, p: int, keys: Sequence[int], t: float) -> None:
        demoted = store_tiered(self.conductor, self.caches[p], self.ssd[p], p, keys)
        if demoted:
            nbytes = demoted * self.block_bytes
            w = self.writes[p]
            if w is not None and w.id in self.net.flows:
                # the instance's demotions form one queue of writes on its storage link
                self.net.extend(t, w, nbytes)
            else:
                self.writes[p] = self.flow(t, [3 * p + 2], nbytes, _WRITE, p)
            self.counters["ssd_write_bytes"] += int(nbytes)

    def prefill_done(self, p: int, i: int, t: float) -> None:
        c = self.conductor
        c.on_prefill_finished(i, t)
        keys = self.keys[i]
        if keys:
            self.store(p, keys, t)
        self.prefill_freed(p, i, t)
        r = self.trace[i]
        self.s.ttft[i] = t - r.arrival_s / self.cfg.speedup
        self.s.first[i] = t
        self.ended[i] = True
        if not self.stream_left[i]:
            self.kv_to_decode(i, t)

    def kv_to_decode(self, i: int, t: float) -> None:
        d = self.s.decode[i]
        assert d is not None
        self.push(t, _KV_READY, d - self.cfg.prefill, i)

    def replicate(self, t: float) -> None:
        """Acts on the conductor's hints: each replica crosses the holder's NIC out and the
        target's NIC in, and is stored (and indexed) when it has arrived."""
        for h in self.conductor.replication_hints(t):
            blocks = list(h.blocks)
            self._repl_seq += 1
            self.repl_pending[self._repl_seq] = (h.to_instance, blocks)
            self.flow(t, [3 * h.from_instance, 3 * h.to_instance + 1], len(blocks) * self.block_bytes, _REPL, self._repl_seq)
            self.counters["replicated_blocks"] += len(blocks)

    def report(self, samples: list[HotSample], wall: float) -> Report:
        return build_report(
            self.cfg,
            self.trace,
            self.keys,
            self.s,
            self.compute_s,
            samples,
            wall,
            self.counters,
            self.io_wait_s,
            self.prefill_busy_s,
            self.bytes,
        )


def run_linked(cfg: SimConfig, trace: Sequence[Request], progress: Progress | None = None) -> Report:
    """Replays ``trace`` on the disaggregated cluster with shared links (module docs)."""
    return _LinkedRun(cfg, trace, progress).go()
