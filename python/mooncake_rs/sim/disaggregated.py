"""The event loop of the disaggregated cluster (virtual clock).

Per request: arrival -> ``Conductor.schedule`` (the real one; ``Overloaded`` = rejected)
-> the prefill instance's FIFO queue -> dequeue (the prefix lookup; the fetch of the
missing prefix from its holder starts when the decision says so) -> compute (durations
from the cost models) -> blocks stored in the instance's ``BlockCache`` (the store's real
eviction code) and reported to the conductor with whatever that evicted -> KV streamed to
the decode instance (layer by layer, overlapping the prefill) -> continuous batching there
(:mod:`.batching`) -> done. Every step is reported back to the conductor
(``on_prefill_started/finished``, ``on_decode_started/finished``).

A request waiting for its fetch does not hold its instance (as the serving ``Cluster``
does not: ``serving/prefill.py`` polls a request's fetch while its engine computes other
requests): a request whose fetch is not done at its dequeue steps aside, and the
instance takes the next request that is ready, first come first served among the ready
ones (:meth:`_Run.next_prefill`). The one set aside joins again when its fetch has
arrived, ahead of the requests dequeued after it; its wait counts in its own TTFT and in
``io_wait_s``. ``on_prefill_started`` comes when a request starts computing. One order is
kept: a request whose planned local prefix is still to be made by a request set aside
before it on that instance (the conductor counted it as local there: docs/conductor.md,
"Pending prefixes") waits for that request's prefill to end.

Prefetch at decision time (``SimConfig.prefetch_staging_bytes``): when the decision says
``prefetch``, the fetch starts at admission with what the holder has then, into the
prefill instance's staging memory; at dequeue the instance waits only for what is left
of it. A prefetch it cannot use (its own prefix lost a block the fetch builds on) is
dropped (so is one its own prefix has grown past) and the fetch happens at dequeue, as
without prefetch.

A fetch's blocks are stored in the prefill instance's DRAM (and reported to the
conductor) when they arrive, not when the conductor decides: until then the instance
does not hold them, and a peer that planned to fetch them from it would find nothing.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from .._core import BlockCache
from .batching import ContinuousBatch
from .config import SimConfig
from .loop import EventLoop, Progress, build_report, make_caches, store_chain
from .report import HotSample, Report
from .trace import Request

__all__ = ["run_disaggregated"]

_PREFILL_DONE = 0
_KV_READY = 1
_DECODE_BOUNDARY = 2
#: a prefetch has arrived: its blocks are in the instance's DRAM (servable to peers)
_PREFETCHED = 5
#: a fetch made at dequeue has arrived: the same, for its blocks
_FETCHED = 6
#: a request set aside for its fetch has its prefix: it is ready to compute
_LOADED = 7


class _Run(EventLoop):
    """The disaggregated cluster: prefill instances ``0..P-1`` (a FIFO each), decode
    instances ``P..P+D-1`` (a continuous batch each)."""

    def __init__(self, cfg: SimConfig, trace: Sequence[Request], progress: Progress | None) -> None:
        super().__init__(cfg, trace, progress)
        self.index = self.conductor.index
        P, D = cfg.prefill, cfg.decode
        self.pids = list(range(P))
        self.dids = list(range(P, P + D))
        #: decode instance id -> index of its batch (the adaptive-roles loop keeps one per instance: 0)
        self.doff = P
        for p in self.pids:
            self.conductor.add_prefill(p)
        for d in self.dids:
            self.conductor.add_decode(d, max_batch=cfg.decode_max_batch, kv_capacity_tokens=cfg.decode_kv_capacity_tokens)
        self.caches: list[BlockCache] = make_caches(cfg, P, trace)
        self.init_lines(P)
        #: per request: blocks its decision counted on its prefill instance (reused less
        #: fetched), and when its loads are done (it may compute from then on)
        self.plan_local = [0] * len(trace)
        self.ready_at = [0.0] * len(trace)
        #: request -> the requests waiting for its prefill to end (their planned local
        #: prefix is its prompt)
        self.blocked_on: dict[int, list[int]] = {}
        self.batches = [ContinuousBatch(self.dm) for _ in self.dids]
        self.pending: list[list[int]] = [[] for _ in self.dids]  # arrived, waiting for a step boundary
        self.waiting: list[deque[int]] = [deque() for _ in self.dids]  # no room in the batch yet
        self.kv_used = [0] * D
        self.hits: Counter[int] = Counter()
        #: set_aside: dequeued with a fetch under way (the instance went on without it);
        #: blocked: dequeued before the request making its planned prefix had computed it
        self.counters = {"fetches": 0, "fetch_fallbacks": 0, "replicated_blocks": 0, "set_aside": 0, "blocked": 0}
        #: per request with a prefetch under way: (first fetched block, end block, when done)
        self.prefetched: dict[int, tuple[int, int, float]] = {}
        #: per prefetch not arrived yet: its block range (stored at arrival)
        self.arrivals: dict[int, tuple[int, int]] = {}
        #: per fetch made at dequeue and not arrived yet: its block range (stored at arrival)
        self.fetch_arrivals: dict[int, tuple[int, int]] = {}
        if cfg.prefetch_staging_bytes:
            self.counters.update(prefetches=0, prefetch_unused=0)
        # hot-block sampling and replication times (set by go)
        self._sample_every = 0.0
        self._next_sample = 0.0
        self._next_repl = float("inf")
        self._samples: list[HotSample] = []

    # --- prefill: one request computes at a time; one waiting for its loads steps aside ---

    def init_lines(self, n: int) -> None:
        """Per instance: its FIFO queue (admitted, not dequeued yet), whether it is busy
        (computing, or loading from its own tiers), the requests dequeued and waiting for
        their loads or for a request they build on, and the heap (by request id, i.e.
        admission order) of those ready to go again: loaded (to compute) or unblocked (to
        be dequeued again). Everything in the heap was dequeued before the queue's head."""
        self.queues: list[deque[int]] = [deque() for _ in range(n)]
        self.busy = [False] * n
        self.aside: list[set[int]] = [set() for _ in range(n)]
        #: (request, 0: loaded, to compute; 1: unblocked, to dequeue again)
        self.back: list[list[tuple[int, int]]] = [[] for _ in range(n)]

    def prefill_idle(self, p: int) -> bool:
        """Nothing is queued, waiting or computing on prefill instance ``p``."""
        return not self.busy[p] and not self.queues[p] and not self.aside[p] and not self.back[p]

    def next_prefill(self, p: int, t: float) -> None:
        """Instance ``p`` is free at ``t``: it takes requests first come, first served among
        the ready ones (those set aside and ready again first: they were dequeued before
        the queue's head) until one occupies it or nothing is left. A dequeued request
        whose loads are not done steps aside (:meth:`dequeue`)."""
        back, q = self.back[p], self.queues[p]
        while not self.busy[p]:
            if back:
                i, again = heapq.heappop(back)
                if again:
                    self.dequeue(p, i, t)
                else:
                    self.join(p, i, t)
            elif q:
                self.dequeue(p, q.popleft(), t)
            else:
                return

    def blocked(self, p: int, i: int, local: int) -> bool:
        """Whether request ``i``, dequeued on ``p`` with ``local`` blocks of its prompt
        there, waits for a request set aside before it that will make the block it
        misses: its decision counted that block as local (a pending prefix), i.e. made
        by the request before it. It goes again when that one's prefill ends."""
        if local >= self.plan_local[i] or not self.aside[p]:
            return False
        k = self.keys[i][local]
        for j in sorted(self.aside[p]):
            kj = self.keys[j]
            if len(kj) > local and kj[local] == k:
                self.blocked_on.setdefault(j, []).append(i)
                self.aside[p].add(i)
                self.counters["blocked"] += 1
                return True
        return False

    def set_aside(self, p: int, i: int) -> None:
        """Request ``i``'s loads are under way at its dequeue: it does not hold ``p``."""
        self.aside[p].add(i)
        self.counters["set_aside"] += 1

    def waited(self, seconds: float) -> None:
        """A request waited ``seconds`` for its KV loads (its own TTFT pays them)."""
        self.io_wait_s += seconds
        self.prefill_busy_s += seconds

    def loaded(self, p: int, i: int, t: float, delay: float = 0.0) -> None:
        """Request ``i``, set aside on ``p``, has its loads at ``t`` (it may compute
        ``delay`` later: the transfer's setup latency): it is ready, and goes when ``p``
        is free, before anything dequeued after it."""
        self.aside[p].discard(i)
        start = self.s.start[i]
        assert start is not None
        self.ready_at[i] = t + delay
        self.waited(t + delay - start)
        heapq.heappush(self.back[p], (i, 0))
        self.next_prefill(p, t)

    def join(self, p: int, i: int, t: float) -> None:
        """Request ``i`` takes instance ``p`` at ``t`` and computes (from when its loads
        are done, if that is later)."""
        self.busy[p] = True
        self.conductor.on_prefill_started(i, t)
        self.compute(p, i, t, max(0.0, self.ready_at[i] - t))

    def arrive(self, i: int, t: float) -> None:
        d = self.schedule_or_reject(i, t)
        if d is None:
            return
        r = self.trace[i]
        cfg = self.cfg
        s = self.s
        s.prefill[i] = d.prefill
        s.decode[i] = d.decode
        s.fetch_from[i] = d.fetch_from
        s.planned[i] = d.reused_blocks
        self.plan_local[i] = d.reused_blocks - d.fetch_blocks
        if cfg.eager_index and self.keys[i]:
            # ours: the instance will hold the prompt's blocks once this prefill ends, and
            # anything routed there later runs after it (FIFO): tell the conductor now
            self.conductor.on_blocks_stored(d.prefill, self.keys[i])
        if d.prefetch and d.fetch_from is not None and cfg.cache == "global":
            self.start_prefetch(i, d, t)
        self.queues[d.prefill].append(i)
        self.next_prefill(d.prefill, t)

    def start_prefetch(self, i: int, d: Any, t: float) -> None:
        """Request ``i``'s fetch starts at its admission ``t`` (``d`` its decision), with
        the part of the planned range its holder has now."""
        lo = d.reused_blocks - d.fetch_blocks
        held = self.caches[d.fetch_from].lookup_prefix(self.keys[i][: d.reused_blocks])
        if held <= lo:
            return  # nothing there yet: fetched at dequeue
        fetch_s = self.tm.fetch((held - lo) * self.cfg.block_tokens, 0.0)
        if self.factor is not None:
            fetch_s *= self.factor[i]
        self.prefetched[i] = (lo, held, t + fetch_s)
        self.counters["prefetches"] += 1
        self.arrivals[i] = (lo, held)
        self.push(t + fetch_s, _PREFETCHED, d.prefill, i)

    def prefetch_arrived(self, p: int, i: int) -> None:
        """Request ``i``'s prefetched blocks are in ``p``'s DRAM: stored (and reported)
        there, so the index learns the replica now (not at admission)."""
        lo, held = self.arrivals.pop(i)
        store_chain(self.conductor, self.caches[p], p, self.keys[i][lo:held])

    def dequeue(self, p: int, i: int, t: float) -> None:
        """Request ``i`` leaves ``p``'s queue at ``t``: its prefix is looked up, its fetch
        starts (or what is left of its prefetch is waited for); with nothing to wait for
        it computes now, otherwise it steps aside until its fetch has arrived."""
        keys = self.keys[i]
        s = self.s
        local = self.caches[p].lookup_prefix(keys)
        if self.blocked(p, i, local):
            return
        reused, fetched = local, 0
        src = s.fetch_from[i]
        pre = self.prefetched.pop(i, None)
        wait_s: float | None = None
        if pre is not None and pre[2] <= t and local >= pre[1]:
            pre = None  # arrived before its dequeue: its blocks are local (prefetch_arrived)
        elif pre is not None and not pre[0] <= local < pre[1]:
            # a gap before the staged blocks, or its own prefix grew past them
            self.counters["prefetch_unused"] += 1
            pre = None
        if pre is not None:
            self.counters["fetches"] += 1
            _, held, ready = pre
            reused, fetched = held, held - local
            wait_s = max(0.0, ready - t)
            if held < s.planned[i]:
                self.counters["fetch_fallbacks"] += 1
        elif src is not None and s.planned[i] > local:
            self.counters["fetches"] += 1
            if self.cfg.cache == "global":
                held = self.caches[src].lookup_prefix(keys[: s.planned[i]])
                if held > local:
                    reused, fetched = held, held - local
                if held < s.planned[i]:
                    self.counters["fetch_fallbacks"] += 1
        fetch_s = self.tm.fetch(fetched * self.cfg.block_tokens, 0.0) if fetched and wait_s is None else 0.0
        if self.factor is not None:
            fetch_s *= self.factor[i]
        if wait_s is not None:
            fetch_s = wait_s  # what is left of the prefetch (its factor applied at its start)
        s.reused[i] = reused
        s.fetched[i] = fetched
        s.start[i] = t
        self.ready_at[i] = t
        if reused:
            self.hits.update(keys[:reused])
        if fetched and wait_s is None:
            self.fetch_arrivals[i] = (reused - fetched, reused)
            self.push(t + fetch_s, _FETCHED, p, i)
        if fetch_s > 0.0:
            self.set_aside(p, i)
            self.push(t + fetch_s, _LOADED, p, i)  # after _FETCHED: its blocks are stored first
        else:
            self.join(p, i, t)

    def compute(self, p: int, i: int, t: float, delay: float = 0.0) -> None:
        """Request ``i`` computes on ``p`` from ``t + delay``; its KV streams to decode
        from then on."""
        L = self.trace[i].input_length
        compute = self.pm.predict(L, min(self.s.reused[i] * self.cfg.block_tokens, L))
        if self.factor is not None:
            compute *= self.factor[i]
        self.compute_s += compute
        self.prefill_busy_s += compute
        self.s.stream_t[i] = t + delay
        self.push(t + delay + compute, _PREFILL_DONE, p, i)

    def prefill_freed(self, p: int, i: int, t: float) -> None:
        """Request ``i``'s prefill on ``p`` ended at ``t`` (its blocks are stored): those
        waiting for it are dequeued again, and ``p`` takes the next ready request."""
        self.busy[p] = False
        for j in self.blocked_on.pop(i, ()):
            self.aside[p].discard(j)
            heapq.heappush(self.back[p], (j, 1))
        self.next_prefill(p, t)

    def fetch_arrived(self, p: int, i: int) -> None:
        """Request ``i``'s fetch (made at its dequeue) has arrived: its blocks are stored
        (and reported) in ``p``'s DRAM, so peers may fetch them from there now."""
        lo, hi = self.fetch_arrivals.pop(i)
        store_chain(self.conductor, self.caches[p], p, self.keys[i][lo:hi])

    def prefill_done(self, p: int, i: int, t: float) -> None:
        c = self.conductor
        c.on_prefill_finished(i, t)
        keys = self.keys[i]
        if keys:
            store_chain(c, self.caches[p], p, keys)
        self.prefill_freed(p, i, t)
        r = self.trace[i]
        self.s.ttft[i] = t - r.arrival_s / self.cfg.speedup
        self.s.first[i] = t
        # the KV streams layer by layer while the prefill computes
        stream = self.tm.fetch(r.input_length, 0.0)
        if self.factor is not None:
            stream *= self.factor[i]
        ready = max(t, self.s.stream_t[i] + stream)
        d = self.s.decode[i]
        assert d is not None
        self.push(ready, _KV_READY, d - self.doff, i)

    # --- decode ---

    def kv_ready(self, k: int, i: int, t: float) -> None:
        r = self.trace[i]
        c = self.conductor
        if r.output_length <= 1:
            c.on_decode_started(i, t)
            c.on_decode_finished(i, r.output_length, t)
            self.s.tbt[i] = 0.0
            self.s.max_gap[i] = 0.0
            self.s.finish[i] = t
            return
        b = self.batches[k]
        if b.n == 0:
            b.idle_until(t)
            self.waiting[k].append(i)
            self.admit(k, t)
            self.schedule_boundary(k)
            return
        if self.pending[k]:
            self.pending[k].append(i)
            return
        self.pending[k].append(i)
        step, bt = b.boundary_after(t)
        b.version += 1
        self.push(bt, _DECODE_BOUNDARY, k, b.version, step)

    def admit(self, k: int, t: float) -> None:
        b = self.batches[k]
        w = self.waiting[k]
        cap = self.cfg.decode_kv_capacity_tokens
        while w:
            i = w[0]
            r = self.trace[i]
            need = r.input_length + r.output_length
            if b.n > 0 and (b.n >= self.cfg.decode_max_batch or self.kv_used[k] + need > cap):
                break
            w.popleft()
            self.kv_used[k] += need
            b.add(i, r.input_length, r.output_length - 1)
            self.conductor.on_decode_started(i, t)

    def schedule_boundary(self, k: int) -> None:
        b = self.batches[k]
        step = b.next_finish_step()
        if step is None:
            return
        b.version += 1
        self.push(b.time_of(step), _DECODE_BOUNDARY, k, b.version, step)

    def boundary(self, k: int, version: int, step: int) -> None:
        b = self.batches[k]
        if version != b.version:
            return
        t = b.advance_to(step)
        self.finish_requests(b, k, t)
        if self.pending[k]:
            self.waiting[k].extend(self.pending[k])
            self.pending[k].clear()
        self.admit(k, t)
        self.schedule_boundary(k)

    # --- periodic ---

    def sample_hot(self, t: float) -> HotSample:
        top = self.hits.most_common(self.cfg.hot_top_k)
        blocks = tuple(b for b, _ in top)
        return HotSample(t, blocks, tuple(h for _, h in top), tuple(len(self.index.holders(b)) for b in blocks))

    def replicate(self, t: float) -> None:
        for h in self.conductor.replication_hints(t):
            store_chain(self.conductor, self.caches[h.to_instance], h.to_instance, h.blocks)
            self.counters["replicated_blocks"] += len(h.blocks)

    # --- the loop ---

    def handle(self, t: float, kind: int, a: int, b: int, c: int) -> None:
        if kind == _PREFILL_DONE:
            self.prefill_done(a, b, t)
        elif kind == _KV_READY:
            self.kv_ready(a, b, t)
        elif kind == _PREFETCHED:
            self.prefetch_arrived(a, b)
        elif kind == _FETCHED:
            self.fetch_arrived(a, b)
        elif kind == _LOADED:
            self.loaded(a, b, t)
        else:
            self.boundary(a, b, c)

    def before_arrival(self, t: float) -> None:
        cfg = self.cfg
        if t >= self._next_sample and cfg.hot_top_k:
            self._samples.append(self.sample_hot(t))
            self._next_sample = t + self._sample_every
        if t >= self._next_repl:
            self.replicate(t)
            self._next_repl = t + (cfg.replicate_every_s or float("inf"))

    def go(self) -> Report:
        wall0 = time.perf_counter()
        cfg = self.cfg
        n = len(self.trace)
        span = self.trace[-1].arrival_s / cfg.speedup if n else 0.0
        self._sample_every = max(cfg.hot_sample_every_s, span / 64.0)
        self._next_sample = 0.0
        self._next_repl = cfg.replicate_every_s if cfg.replicate_every_s is not None else float("inf")
        self._samples = []
        self.drive()
        if cfg.hot_top_k and n:
            self._samples.append(self.sample_hot(max(f for f in self.s.finish if f is not None) if any(self.s.finish) else span))
        return self.report(self._samples, time.perf_counter() - wall0)

    def report(self, samples: list[HotSample], wall: float) -> Report:
        return build_report(
            self.cfg, self.trace, self.keys, self.s, self.compute_s, samples, wall, self.counters, self.io_wait_s, self.prefill_busy_s
        )


def run_disaggregated(cfg: SimConfig, trace: Sequence[Request], progress: Progress | None = None) -> Report:
    """Replays ``trace`` on the disaggregated cluster (see the module docs)."""
    return _Run(cfg, trace, progress).go()
