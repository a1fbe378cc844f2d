"""The coupled baseline (vLLM-like): every instance prefills and decodes.

``prefill + decode`` instances (the same GPU count as the disaggregated cluster), each
with one continuous batch. Without chunked prefill a waiting prompt runs as its own
iteration as soon as the current step ends, and the running batch stalls for it (the
interference that disaggregation removes). With ``chunked_prefill`` every iteration
decodes one token for each running sequence and adds up to ``chunk_tokens - batch``
prompt tokens of the oldest waiting prompt (its cost on top of the decode step). With
``prefix_caching`` each instance keeps a local ``BlockCache`` (the store's eviction
code) and reuses the prefix it holds; it never fetches from another instance.

Routing is the real conductor: ``policy`` over the instances' prefill queues (use
``"local_cache_aware"`` with prefix caching, ``"load_balance"`` without). Each instance
is registered as a prefill instance; its decode side is a stand-in decode entry that
only keeps the conductor's bookkeeping (rejection, when enabled, reads it).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from .._core import BlockCache
from .batching import ContinuousBatch
from .config import SimConfig
from .report import Report
from .loop import EventLoop, Progress, build_report, make_caches, store_chain
from .trace import Request

__all__ = ["run_coupled"]

_IDLE, _DECODE, _ITER = 0, 1, 2
_ITER_END, _BOUNDARY = 0, 1


class _Coupled(EventLoop):
    def __init__(self, cfg: SimConfig, trace: Sequence[Request], progress: Progress | None) -> None:
        super().__init__(cfg, trace, progress)
        n = cfg.prefill + cfg.decode
        self.n = n
        for k in range(n):
            self.conductor.add_prefill(k)
            self.conductor.add_decode(n + k, max_batch=cfg.decode_max_batch, kv_capacity_tokens=cfg.decode_kv_capacity_tokens)
        self.caches: list[BlockCache] | None = make_caches(cfg, n, trace) if cfg.prefix_caching else None
        self.waiting: list[deque[int]] = [deque() for _ in range(n)]
        self.batch = [ContinuousBatch(self.dm) for _ in range(n)]
        self.mode = [_IDLE] * n
        self.kv_used = [0] * n
        #: (request, tokens of its prompt already in the KV cache) of the prompt in progress
        self.current: list[tuple[int, int] | None] = [None] * n
        self.boundary_pending = [False] * n
        self.counters = {"prefill_iterations": 0}

    def arrive(self, i: int, t: float) -> None:
        d = self.schedule_or_reject(i, t)
        if d is None:
            return
        k = d.prefill
        self.s.prefill[i] = k
        self.s.decode[i] = k
        self.waiting[k].append(i)
        if self.mode[k] == _IDLE:
            self.batch[k].idle_until(t)
            self.kick(k, t)
        elif self.mode[k] == _DECODE and not self.boundary_pending[k]:
            # the prompt starts at the end of the step in flight
            b = self.batch[k]
            step, tb = b.boundary_after(t)
            b.version += 1
            self.boundary_pending[k] = True
            self.push(tb, _BOUNDARY, k, b.version, step)

    def room(self, k: int, i: int) -> bool:
        r = self.trace[i]
        b = self.batch[k]
        if b.n == 0:
            return True
        return b.n < self.cfg.decode_max_batch and self.kv_used[k] + r.input_length + r.output_length <= self.cfg.decode_kv_capacity_tokens

    def begin_prompt(self, k: int, i: int, t: float) -> int:
        """Starts request ``i``'s prefill on ``k``; returns the tokens it reuses."""
        self.conductor.on_prefill_started(i, t)
        reused = self.caches[k].lookup_prefix(self.keys[i]) if self.caches is not None else 0
        self.s.reused[i] = reused
        self.s.start[i] = t
        r = self.trace[i]
        self.kv_used[k] += r.input_length + r.output_length
        return min(reused * self.cfg.block_tokens, r.input_length)

    def kick(self, k: int, t: float) -> None:
        """At a step boundary of instance ``k`` (time ``t``): start the next iteration."""
        b = self.batch[k]
        w = self.waiting[k]
        pm = self.pm
        if self.current[k] is None and w and self.room(k, w[0]):
            i = w.popleft()
            self.current[k] = (i, self.begin_prompt(k, i, t))
        cur = self.current[k]
        if cur is not None:
            i, done = cur
            L = self.trace[i].input_length
            self.counters["prefill_iterations"] += 1
            if self.cfg.chunked_prefill:
                chunk = max(1, min(L - done, self.cfg.chunk_tokens - b.n))
                cost = pm.predict(done + chunk, done)
                extra = cost - pm.c0  # the chunk's work on top of the decode step
                if self.factor is not None:
                    cost *= self.factor[i]
                    extra *= self.factor[i]
                self.compute_s += cost
                if b.n > 0:
                    d = b.run_one(extra)
                else:
                    d = cost
                    b.idle_until(t + d)
                self.current[k] = (i, done + chunk)
            else:
                d = pm.predict(L, done)
                if self.factor is not None:
                    d *= self.factor[i]
                self.compute_s += d
                if b.n > 0:
                    b.stall(d)
                else:
                    b.idle_until(t + d)
                self.current[k] = (i, L)
            self.mode[k] = _ITER
            b.version += 1
            self.push(t + d, _ITER_END, k, b.version)
            return
        step = b.next_finish_step()
        if step is None:
            self.mode[k] = _IDLE
            return
        self.mode[k] = _DECODE
        b.version += 1
        self.boundary_pending[k] = False
        self.push(b.time_of(step), _BOUNDARY, k, b.version, step)

    def finish_decoded(self, k: int, t: float) -> None:
        self.finish_requests(self.batch[k], k, t)

    def iter_end(self, k: int, version: int, t: float) -> None:
        b = self.batch[k]
        if version != b.version:
            return
        self.finish_decoded(k, t)
        cur = self.current[k]
        if cur is not None and cur[1] >= self.trace[cur[0]].input_length:
            i = cur[0]
            self.current[k] = None
            r = self.trace[i]
            c = self.conductor
            c.on_prefill_finished(i, t)
            if self.caches is not None and self.keys[i]:
                store_chain(c, self.caches[k], k, self.keys[i])
            self.s.ttft[i] = t - r.arrival_s / self.cfg.speedup
            self.s.first[i] = t
            c.on_decode_started(i, t)
            if r.output_length <= 1:
                self.kv_used[k] -= r.input_length + r.output_length
                c.on_decode_finished(i, r.output_length, t)
                self.s.tbt[i] = 0.0
                self.s.max_gap[i] = 0.0
                self.s.finish[i] = t
            else:
                b.add(i, r.input_length, r.output_length - 1)
        self.kick(k, t)

    def boundary(self, k: int, version: int, step: int) -> None:
        b = self.batch[k]
        if version != b.version:
            return
        t = b.advance_to(step)
        self.boundary_pending[k] = False
        self.finish_decoded(k, t)
        self.kick(k, t)

    def handle(self, t: float, kind: int, k: int, a: int, b: int, /) -> None:
        if kind == _ITER_END:
            self.iter_end(k, a, t)
        else:
            self.boundary(k, a, b)

    def go(self) -> Report:
        wall0 = time.perf_counter()
        self.drive()
        return build_report(
            self.cfg, self.trace, self.keys, self.s, self.compute_s, [], time.perf_counter() - wall0, self.counters, 0.0, self.compute_s
        )


def run_coupled(cfg: SimConfig, trace: Sequence[Request], progress: Progress | None = None) -> Report:
    """Replays ``trace`` on coupled instances (see the module docs)."""
    return _Coupled(cfg, trace, progress).go()
