"""What the simulator's event loops share: the virtual clock, admission through the real
``Conductor``, per-request results, the caches, and the report of a finished run.

Two loops derive from :class:`EventLoop`: the disaggregated cluster
(:mod:`.disaggregated`) and the coupled baseline (:mod:`.coupled`); :mod:`.simulator`
picks one. This module imports neither, so the three form no cycle.
"""

from __future__ import annotations

import heapq
import math
import random
import resource
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from .._core import BlockCache, Conductor
from ..errors import Overloaded
from .batching import ContinuousBatch
from .config import SimConfig
from .report import HotSample, Report, RequestResult
from .trace import Request

__all__ = ["EventLoop", "Progress", "State", "build_report", "error_factors", "make_caches", "store_chain"]

#: ``progress(done, total)``: called as arrivals go by
Progress = Callable[[int, int], None]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def error_factors(cfg: SimConfig, n: int) -> list[float] | None:
    """Per request, the factor by which its true prefill and transfer times differ from
    the cost models': ``exp(e * z - e**2 / 2)``, ``z ~ N(0, 1)``, ``e = estimate_error``,
    seeded by ``seed``: a lognormal relative error of mean 1 (the estimates are unbiased,
    so the total work is the same in expectation; ``e`` is the std of its log). None when
    ``estimate_error`` is 0 (nothing is multiplied: results are exactly the models')."""
    if cfg.estimate_error == 0:
        return None
    rng = random.Random(0x5EED_E77 ^ cfg.seed)
    e = cfg.estimate_error
    shift = e * e / 2.0
    return [math.exp(e * rng.gauss(0.0, 1.0) - shift) for _ in range(n)]


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


class EventLoop(ABC):
    """What both architectures' runs share: the virtual clock's event heap, the real
    Conductor, the requests' block keys, and admission through ``Conductor.schedule``.

    A subclass provides:

    - :meth:`arrive` (a request of the trace arrives), :meth:`handle` (one event of its
      own kinds, pushed with :meth:`push`, pops from the heap) and :meth:`go` (run
      :meth:`drive` and build the :class:`Report`);
    - optionally :meth:`before_arrival` (periodic work between arrivals);
    - the attributes ``kv_used`` (per decoding instance, the KV tokens its batch
      holds; :meth:`finish_requests` frees them), ``caches`` (per instance, its
      ``BlockCache``, or None without caching; read after the run) and ``counters``
      (named counts for the report).
    """

    #: per decoding instance (indexed as its ``ContinuousBatch``), KV tokens in use
    kv_used: list[int]
    #: per instance, its cache (None: the architecture caches nothing)
    caches: list[BlockCache] | None
    #: architecture-specific counts, copied into ``Report.counters``
    counters: dict[str, int]

    def __init__(self, cfg: SimConfig, trace: Sequence[Request], progress: Progress | None) -> None:
        self.cfg = cfg
        self.trace = trace
        self.progress = progress
        # the instances run on the true models; the conductor estimates with its own
        self.pm, self.tm, self.dm = cfg.true_models()
        #: per request, true time / modelled time (None: exact)
        self.factor = error_factors(cfg, len(trace))
        self.conductor = Conductor(cfg.conductor_config())
        self.heap: list[tuple[float, int, int, int, int, int]] = []
        self.seq = 0
        bt = cfg.block_tokens
        # Only full blocks are scheduled, cached and counted (see docs/sim.md).
        self.keys = [r.hash_ids[: r.input_length // bt] for r in trace]
        self.s = State(len(trace))
        self.compute_s = 0.0
        #: prefill seconds spent waiting on KV loads, and waiting + computing
        self.io_wait_s = 0.0
        self.prefill_busy_s = 0.0

    def push(self, t: float, kind: int, a: int, b: int = 0, c: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b, c))

    @abstractmethod
    def handle(self, t: float, kind: int, a: int, b: int, c: int, /) -> None:
        """Runs one event popped from the heap (each architecture has its own kinds;
        ``a``, ``b``, ``c`` are what :meth:`push` was given, named as a subclass likes)."""

    @abstractmethod
    def arrive(self, i: int, t: float) -> None:
        """Request ``i`` of the trace arrives at ``t`` (virtual seconds)."""

    @abstractmethod
    def go(self) -> Report:
        """Runs the whole trace (:meth:`drive`) and returns its report."""

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


def build_report(
    cfg: SimConfig,
    trace: Sequence[Request],
    keys: Sequence[Sequence[int]],
    s: State,
    compute_s: float,
    samples: list[HotSample],
    wall: float,
    counters: dict[str, int],
    io_wait_s: float = 0.0,
    prefill_busy_s: float = 0.0,
    bytes_loaded_per_path: dict[str, int] | None = None,
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
        io_wait_s=io_wait_s,
        prefill_busy_s=prefill_busy_s,
        bytes_loaded_per_path=dict(bytes_loaded_per_path or {}),
    )
