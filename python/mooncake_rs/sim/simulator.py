"""The discrete-event simulator of a disaggregated cluster (virtual clock).

Per request: arrival -> ``Conductor.schedule`` (the real one; ``Overloaded`` = rejected)
-> the prefill instance's FIFO queue -> prefill (fetch the missing prefix from its
holder first when the decision says so, then compute; durations from the cost models)
-> blocks stored in the instance's ``BlockCache`` (the store's real eviction code) and
reported to the conductor with whatever that evicted -> KV streamed to the decode
instance (layer by layer, overlapping the prefill) -> continuous batching there
(:mod:`.batching`) -> done. Every step is reported back to the conductor
(``on_prefill_started/finished``, ``on_decode_started/finished``).
"""

from __future__ import annotations

import heapq
import resource
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from .._core import BlockCache, Conductor
from ..errors import Overloaded
from .batching import ContinuousBatch
from .config import SimConfig
from .report import HotSample, Report, RequestResult
from .trace import Request

__all__ = ["Simulator"]

Progress = Callable[[int, int], None]

_PREFILL_DONE = 0
_KV_READY = 1
_DECODE_BOUNDARY = 2


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def make_caches(cfg: SimConfig, n: int, trace: Sequence[Request]) -> list[BlockCache]:
    """One cache per instance: ``capacity_tokens_per_instance // block_tokens`` blocks,
    or (unbounded) room for every block of the trace, so nothing is ever evicted."""
    cap = cfg.capacity_blocks
    if cap is None:
        cap = max(1, sum(r.input_length // cfg.block_tokens for r in trace))
    return [BlockCache(max(cap, 1), cfg.eviction) for _ in range(n)]


def store_chain(conductor: Conductor, cache: BlockCache, instance: int, keys: Sequence[int]) -> None:
    """Puts ``keys`` in ``instance``'s cache and tells the conductor what changed. A key
    evicted by an earlier key of the same chain and stored again later in it is in the
    cache at the end: only what is finally absent is reported evicted."""
    evicted = cache.insert(keys)
    if evicted:
        conductor.on_blocks_evicted(instance, [k for k in evicted if k not in cache])
        keys = [k for k in keys if k in cache]
    conductor.on_blocks_stored(instance, keys)


class State:
    """Per-request results, filled in as the run goes (lists indexed by request)."""

    def __init__(self, n: int) -> None:
        self.rejected: list[str | None] = [None] * n
        self.prefill: list[int | None] = [None] * n
        self.decode: list[int | None] = [None] * n
        self.fetch_from: list[int | None] = [None] * n
        self.planned: list[int] = [0] * n
        self.reused = [0] * n
        self.fetched = [0] * n
        self.start: list[float | None] = [None] * n
        self.stream_t = [0.0] * n
        self.ttft: list[float | None] = [None] * n
        #: when the first token came out (the end of the prefill)
        self.first = [0.0] * n
        self.tbt: list[float | None] = [None] * n
        self.max_gap: list[float | None] = [None] * n
        self.finish: list[float | None] = [None] * n


class Simulator:
    """Replays a trace on the cluster that ``config`` describes."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        #: the conductor and the per-instance caches of the last run (for inspection)
        self.conductor: Conductor | None = None
        self.caches: list[BlockCache] | None = None

    def run(self, trace: Sequence[Request], progress: Progress | None = None) -> Report:
        """Replays ``trace``; ``progress(done, total)`` is called as arrivals go by."""
        if self.config.architecture == "coupled":
            from .coupled import _Coupled

            c = _Coupled(self.config, trace, progress)
            self.conductor, self.caches = c.conductor, c.caches
            return c.go()
        r = _Run(self.config, trace, progress)
        self.conductor, self.caches = r.conductor, r.caches
        return r.go()


class EventLoop:
    """What both architectures' runs share: the virtual clock's event heap, the real
    Conductor, the requests' block keys, and admission through ``Conductor.schedule``."""

    def __init__(self, cfg: SimConfig, trace: Sequence[Request], progress: Progress | None) -> None:
        self.cfg = cfg
        self.trace = trace
        self.progress = progress
        self.pm, self.tm, self.dm = cfg.models()
        self.conductor = Conductor(cfg.conductor_config())
        self.heap: list[tuple[float, int, int, int, int, int]] = []
        self.seq = 0
        bt = cfg.block_tokens
        # Only full blocks are scheduled, cached and counted (see docs/sim.md).
        self.keys = [r.hash_ids[: r.input_length // bt] for r in trace]
        self.s = State(len(trace))
        self.compute_s = 0.0

    def push(self, t: float, kind: int, a: int, b: int = 0, c: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b, c))

    def handle(self, t: float, kind: int, a: int, b: int, c: int) -> None:
        """Runs one event popped from the heap (each architecture has its own kinds)."""
        raise NotImplementedError

    def arrive(self, i: int, t: float) -> None:
        raise NotImplementedError

    def before_arrival(self, t: float) -> None:
        """A hook run before each arrival (periodic sampling, replication)."""

    def finish_requests(self, batch: ContinuousBatch, k: int, t: float) -> None:
        """Records the requests that ``batch`` (on instance ``k``) finished at ``t``: frees
        their KV, tells the conductor, and computes TBT and the worst token gap. The gaps
        run from the first token (prefill end), so a KV transfer and any wait for room in
        the batch count in the first gap, which ends with the first step."""
        s = self.s
        for rid, join_t, tokens, worst, first in batch.pop_finished():
            r = self.trace[rid]
            self.kv_used[k] -= r.input_length + r.output_length
            self.conductor.on_decode_finished(rid, r.output_length, t)
            s.tbt[rid] = (t - s.first[rid]) / tokens if tokens else 0.0
            s.max_gap[rid] = max(worst, join_t - s.first[rid] + first) if tokens else 0.0
            s.finish[rid] = t

    def drive(self) -> None:
        """Merges the trace's arrivals with the event heap in time order (an event due
        strictly before the next arrival runs first) until both are exhausted."""
        trace, n = self.trace, len(self.trace)
        arrivals = [r.arrival_s / self.cfg.speedup for r in trace]
        heap = self.heap
        ai = 0
        tick = max(1, n // 100)
        inf = float("inf")
        while ai < n or heap:
            ta = arrivals[ai] if ai < n else inf
            if heap and heap[0][0] < ta:
                t, _, kind, a, b, c = heapq.heappop(heap)
                self.handle(t, kind, a, b, c)
                continue
            self.before_arrival(ta)
            self.arrive(ai, ta)
            ai += 1
            if self.progress is not None and (ai % tick == 0 or ai == n):
                self.progress(ai, n)

    def schedule_or_reject(self, i: int, t: float) -> Any:
        """The conductor's Decision for request ``i`` arriving at ``t``, or None when it
        was rejected (the reason is recorded)."""
        r = self.trace[i]
        expected = r.output_length if self.cfg.oracle_output_len else None
        try:
            return self.conductor.schedule(i, self.keys[i], r.input_length, t, expected)
        except Overloaded as e:
            self.s.rejected[i] = e.reason or "overloaded"
            return None


class _Run(EventLoop):
    def __init__(self, cfg: SimConfig, trace: Sequence[Request], progress: Progress | None) -> None:
        super().__init__(cfg, trace, progress)
        self.index = self.conductor.index
        P, D = cfg.prefill, cfg.decode
        self.pids = list(range(P))
        self.dids = list(range(P, P + D))
        for p in self.pids:
            self.conductor.add_prefill(p)
        for d in self.dids:
            self.conductor.add_decode(d, max_batch=cfg.decode_max_batch, kv_capacity_tokens=cfg.decode_kv_capacity_tokens)
        self.caches = make_caches(cfg, P, trace)
        self.queues: list[deque[int]] = [deque() for _ in self.pids]
        self.busy = [False] * P
        self.batches = [ContinuousBatch(self.dm) for _ in self.dids]
        self.pending: list[list[int]] = [[] for _ in self.dids]  # arrived, waiting for a step boundary
        self.waiting: list[deque[int]] = [deque() for _ in self.dids]  # no room in the batch yet
        self.kv_used = [0] * D
        self.hits: Counter[int] = Counter()
        self.counters = {"fetches": 0, "fetch_fallbacks": 0, "replicated_blocks": 0}

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
        self.queues[d.prefill].append(i)
        if not self.busy[d.prefill]:
            self.start_prefill(d.prefill, t)

    def start_prefill(self, p: int, t: float) -> None:
        i = self.queues[p].popleft()
        self.busy[p] = True
        self.conductor.on_prefill_started(i, t)
        keys = self.keys[i]
        s = self.s
        local = self.caches[p].lookup_prefix(keys)
        reused, fetched = local, 0
        src = s.fetch_from[i]
        if src is not None and s.planned[i] > local:
            self.counters["fetches"] += 1
            if self.cfg.cache == "global":
                held = self.caches[src].lookup_prefix(keys[: s.planned[i]])
                if held > local:
                    reused, fetched = held, held - local
                if held < s.planned[i]:
                    self.counters["fetch_fallbacks"] += 1
        bt = self.cfg.block_tokens
        L = self.trace[i].input_length
        fetch_s = self.tm.fetch(fetched * bt, 0.0) if fetched else 0.0
        compute = self.pm.predict(L, min(reused * bt, L))
        self.compute_s += compute
        s.reused[i] = reused
        s.fetched[i] = fetched
        s.start[i] = t
        s.stream_t[i] = t + fetch_s
        if reused:
            self.hits.update(keys[:reused])
        self.push(t + fetch_s + compute, _PREFILL_DONE, p, i)

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
        ready = max(t, self.s.stream_t[i] + self.tm.fetch(r.input_length, 0.0))
        d = self.s.decode[i]
        assert d is not None
        self.push(ready, _KV_READY, d - self.cfg.prefill, i)

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
        self._samples: list[HotSample] = []
        self.drive()
        if cfg.hot_top_k and n:
            self._samples.append(self.sample_hot(max(f for f in self.s.finish if f is not None) if any(self.s.finish) else span))
        return self.report(self._samples, time.perf_counter() - wall0)

    def report(self, samples: list[HotSample], wall: float) -> Report:
        return build_report(self.cfg, self.trace, self.keys, self.s, self.compute_s, samples, wall, self.counters)


def build_report(
    cfg: SimConfig,
    trace: Sequence[Request],
    keys: Sequence[Sequence[int]],
    s: State,
    compute_s: float,
    samples: list[HotSample],
    wall: float,
    counters: dict[str, int],
) -> Report:
    """The :class:`Report` of a finished run."""
    rows = [
        RequestResult(
            id=i,
            arrival_s=r.arrival_s / cfg.speedup,
            input_length=r.input_length,
            output_length=r.output_length,
            prompt_blocks=len(keys[i]),
            rejected=s.rejected[i],
            prefill_instance=s.prefill[i],
            decode_instance=s.decode[i],
            reused_blocks=s.reused[i],
            fetched_blocks=s.fetched[i],
            prefill_start_s=s.start[i],
            ttft_s=s.ttft[i],
            tbt_s=s.tbt[i],
            max_gap_s=s.max_gap[i],
            finish_s=s.finish[i],
        )
        for i, r in enumerate(trace)
    ]
    return Report(
        requests=rows,
        ttft_slo_s=cfg.ttft_slo_s,
        tbt_slo_s=cfg.tbt_slo_s,
        prefill_compute_s=compute_s,
        hot_samples=samples,
        config=cfg.to_dict(),
        wall_s=wall,
        peak_rss_mb=_peak_rss_mb(),
        counters=dict(counters),
    )
