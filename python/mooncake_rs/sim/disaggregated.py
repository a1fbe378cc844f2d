"""The event loop of the disaggregated cluster (virtual clock).

Per request: arrival -> ``Conductor.schedule`` (the real one; ``Overloaded`` = rejected)
-> the prefill instance's FIFO queue -> prefill (fetch the missing prefix from its
holder first when the decision says so, then compute; durations from the cost models)
-> blocks stored in the instance's ``BlockCache`` (the store's real eviction code) and
reported to the conductor with whatever that evicted -> KV streamed to the decode
instance (layer by layer, overlapping the prefill) -> continuous batching there
(:mod:`.batching`) -> done. Every step is reported back to the conductor
(``on_prefill_started/finished``, ``on_decode_started/finished``).

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
        self.queues: list[deque[int]] = [deque() for _ in self.pids]
        self.busy = [False] * P
        self.batches = [ContinuousBatch(self.dm) for _ in self.dids]
        self.pending: list[list[int]] = [[] for _ in self.dids]  # arrived, waiting for a step boundary
        self.waiting: list[deque[int]] = [deque() for _ in self.dids]  # no room in the batch yet
        self.kv_used = [0] * D
        self.hits: Counter[int] = Counter()
        self.counters = {"fetches": 0, "fetch_fallbacks": 0, "replicated_blocks": 0}
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

    # --- prefill ---

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
        if cfg.eager_index and self.keys[i]:
            # ours: the instance will hold the prompt's blocks once this prefill ends, and
            # anything routed there later runs after it (FIFO): tell the conductor now
            self.conductor.on_blocks_stored(d.prefill, self.keys[i])
        if d.prefetch and d.fetch_from is not None and cfg.cache == "global":
            self.start_prefetch(i, d, t)
        self.queues[d.prefill].append(i)
        if not self.busy[d.prefill]:
            self.start_prefill(d.prefill, t)

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

    def start_prefill(self, p: int, t: float) -> None:
        i = self.queues[p].popleft()
        self.busy[p] = True
        self.conductor.on_prefill_started(i, t)
        keys = self.keys[i]
        s = self.s
        local = self.caches[p].lookup_prefix(keys)
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
        bt = self.cfg.block_tokens
        L = self.trace[i].input_length
        fetch_s = self.tm.fetch(fetched * bt, 0.0) if fetched and wait_s is None else 0.0
        compute = self.pm.predict(L, min(reused * bt, L))
        if self.factor is not None:
            f = self.factor[i]
            fetch_s *= f
            compute *= f
        if wait_s is not None:
            fetch_s = wait_s  # what is left of the prefetch (its factor applied at its start)
        self.compute_s += compute
        self.io_wait_s += fetch_s
        self.prefill_busy_s += fetch_s + compute
        s.reused[i] = reused
        s.fetched[i] = fetched
        s.start[i] = t
        s.stream_t[i] = t + fetch_s
        if reused:
            self.hits.update(keys[:reused])
        if fetched and wait_s is None:
            self.fetch_arrivals[i] = (reused - fetched, reused)
            self.push(t + fetch_s, _FETCHED, p, i)
        self.push(t + fetch_s + compute, _PREFILL_DONE, p, i)

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
        self.busy[p] = False
        if self.queues[p]:
            self.start_prefill(p, t)
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
