"""Conductor from Python vs a plain-Python Algorithm 1, same inputs, same run.

Workload (as benches/conductor_bench.rs): 16 prefill + 16 decode instances, 1M distinct
blocks in the index (15,625 chains of 64 blocks, each on one instance, half of them with
a second replica of a prefix elsewhere, 30% on SSD), 64-block prompts whose cached prefix
has a random length, ~512 requests in flight (prefill finishes 48 calls and decode 512
calls after scheduling; the replica a fetch made is evicted when its request finishes). Both sides run the "mooncake" policy with the same cost models and no
rejection; the bench reports per-call p50/p99 from Python, decisions/s of each, their
ratio, and how often the two chose the same prefill instance.

    python benches/conductor_bench.py [--calls N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from mooncake_rs import Conductor, ConductorConfig

N_INST = 16
BLOCKS = 64
BLOCK_SIZE = 512
CHAINS = 1_000_000 // BLOCKS
IN_FLIGHT = 512
PREFILL_LAG = 48
PROMPT_LEN = BLOCKS * BLOCK_SIZE + 100


class PyAlgorithm1:
    """The reference: Algorithm 1 of the Mooncake paper in plain Python (dict index)."""

    def __init__(self, cfg: ConductorConfig) -> None:
        p, t, d = cfg.prefill_model, cfg.transfer_model, cfg.decode_model
        self.p = (p.c0, p.c_new, p.c_new2, p.c_cross)
        self.t = (t.bytes_per_token, t.network_bandwidth, t.latency_s)
        self.ssd_bw = t.ssd_bandwidth
        self.d = (d.base_s, d.per_seq_s, d.per_token_s)
        self.bs = cfg.block_size
        self.threshold = cfg.balancing_threshold
        self.holders: dict[int, set[int]] = {}
        self.queue = {i: 0.0 for i in range(N_INST)}
        self.queued = {i: 0 for i in range(N_INST)}  # to reset the sum to exactly 0 when empty
        self.dec = {100 + i: [0, 0.0] for i in range(N_INST)}  # batch, context tokens
        self.reqs: dict[int, tuple[int, int, float | None, float]] = {}

    def store(self, inst: int, hashes: list[int]) -> None:
        for h in hashes:
            self.holders.setdefault(h, set()).add(inst)

    def prefill_time(self, prompt: int, prefix: int) -> float:
        c0, c1, c2, c3 = self.p
        prefix = min(prefix, prompt)
        n = prompt - prefix
        return c0 + c1 * n + c2 * n * n + c3 * n * prefix

    def schedule(self, rid: int, hashes: list[int], prompt_len: int, out_len: float):
        # Prefix held by each instance (leading blocks without a gap).
        prefix: dict[int, int] = {}
        alive = set(self.holders.get(hashes[0], ())) if hashes else set()
        for i in alive:
            prefix[i] = 1
        for h in hashes[1:]:
            if not alive:
                break
            hs = self.holders.get(h, ())
            alive = {i for i in alive if i in hs}
            for i in alive:
                prefix[i] += 1
        best_inst, best_len = None, 0
        for i in sorted(prefix):
            if prefix[i] > best_len:
                best_inst, best_len = i, prefix[i]
        bpt, bw, lat = self.t
        ssd_bw = self.ssd_bw
        ttft, choice = float("inf"), None
        for inst in range(N_INST):
            # The same float operations, in the same order, as the Rust policy, so that
            # near-ties resolve identically and the decisions can be compared one by one.
            local = prefix.get(inst, 0)
            t_queue = self.queue[inst]
            t_local = self.prefill_time(prompt_len, min(local * self.bs, prompt_len))
            best = (t_queue + 0.0 + t_local, 0, t_local)
            if best_inst is not None and best_inst != inst and best_len > local and best_len > self.threshold * local:
                tokens = min(best_len * self.bs, prompt_len) - min(local * self.bs, prompt_len)
                t_transfer = lat + tokens * bpt * ((1.0 - 0.0) / bw + 0.0 / min(bw, ssd_bw))
                t_pre = self.prefill_time(prompt_len, min(best_len * self.bs, prompt_len))
                if t_queue + t_transfer + t_pre < best[0]:
                    best = (t_queue + t_transfer + t_pre, best_len - local, t_transfer + t_pre)
            if best[0] < ttft:
                ttft, choice = best[0], (inst, best[1], best[2])
        inst, fetch, work = choice
        # SelectDecodingInstance: lowest predicted step time.
        base, per_seq, per_tok = self.d
        ctx = prompt_len + out_len / 2
        dec, tbt = None, float("inf")
        for d, (b, c) in self.dec.items():
            t = base + per_seq * (b + 1) + per_tok * (c + ctx)
            if t < tbt:
                dec, tbt = d, t
        if fetch:
            self.store(inst, hashes[best_len - fetch : best_len])
        self.queue[inst] += work
        self.queued[inst] += 1
        self.dec[dec][0] += 1
        self.dec[dec][1] += ctx
        self.reqs[rid] = (inst, dec, work, ctx)
        return inst, dec, ttft, tbt

    def evict(self, inst: int, hashes: list[int]) -> None:
        for h in hashes:
            hs = self.holders.get(h)
            if hs is not None:
                hs.discard(inst)
                if not hs:
                    del self.holders[h]

    def _dequeue(self, inst: int, work: float) -> None:
        self.queued[inst] -= 1
        self.queue[inst] = self.queue[inst] - work if self.queued[inst] else 0.0

    def prefill_done(self, rid: int) -> None:
        inst, dec, work, ctx = self.reqs[rid]
        self._dequeue(inst, work)
        self.reqs[rid] = (inst, dec, None, ctx)

    def finish(self, rid: int) -> None:
        inst, dec, work, ctx = self.reqs.pop(rid)
        if work is not None:
            self._dequeue(inst, work)
        self.dec[dec][0] -= 1
        self.dec[dec][1] -= ctx


def build(seed: int = 1):
    rng = random.Random(seed)
    cfg = ConductorConfig(block_size=BLOCK_SIZE, ttft_slo_s=1e9, tbt_slo_s=1e9, policy="mooncake", rejection="none")
    ours = Conductor(cfg)
    ref = PyAlgorithm1(cfg)
    for i in range(N_INST):
        ours.add_prefill(i)
        ours.add_decode(100 + i)
    for chain in range(CHAINS):
        hs = [(chain << 64) | i for i in range(BLOCKS)]
        home = rng.randrange(N_INST)
        tier = "ssd" if rng.random() < 0.3 else "dram"
        ours.on_blocks_stored(home, hs, tier)
        ref.store(home, hs)
        if rng.random() < 0.5:
            n = rng.randrange(1, BLOCKS)
            other = (home + 1 + rng.randrange(N_INST - 1)) % N_INST
            ours.on_blocks_stored(other, hs[:n], "dram")
            ref.store(other, hs[:n])
    prompts = []
    for p in range(4096):
        chain, cached = rng.randrange(CHAINS), rng.randint(0, BLOCKS)
        prompts.append([(chain << 64) | i if i < cached else (1 << 120) | (p << 32) | i for i in range(BLOCKS)])
    return ours, ref, prompts


def run(calls: int) -> None:
    t0 = time.perf_counter()
    ours, ref, prompts = build()
    print(f"setup: {len(ours.index):,} blocks indexed in {time.perf_counter() - t0:.1f} s")
    out_len = 256.0
    lat, agree = [], 0
    fetched: list[tuple[int, list[int]] | None] = [None] * IN_FLIGHT
    t_ours = t_ref = 0.0
    clock = time.perf_counter_ns
    for rid in range(calls):
        hs = prompts[rid % len(prompts)]
        now = rid * 0.01
        a = clock()
        d = ours.schedule(rid, hs, PROMPT_LEN, now, 256)
        b = clock()
        r = ref.schedule(rid, hs, PROMPT_LEN, out_len)
        e = clock()
        lat.append(b - a)
        t_ours += (b - a) / 1e9
        t_ref += (e - b) / 1e9
        agree += d.prefill == r[0]
        if rid >= PREFILL_LAG:
            ours.on_prefill_finished(rid - PREFILL_LAG)
            ref.prefill_done(rid - PREFILL_LAG)
        slot = rid % IN_FLIGHT
        if rid >= IN_FLIGHT:
            old = rid - IN_FLIGHT
            ours.on_decode_finished(old, 256)
            ref.finish(old)
            if fetched[slot] is not None:  # the replica lives as long as its request
                inst, blocks = fetched[slot]
                ours.on_blocks_evicted(inst, blocks)
                ref.evict(inst, blocks)
                fetched[slot] = None
        if d.fetch_blocks:
            fetched[slot] = (d.prefill, hs[d.reused_blocks - d.fetch_blocks : d.reused_blocks])
    lat.sort()
    p50 = lat[len(lat) // 2] / 1e3
    p99 = lat[int(len(lat) * 0.99)] / 1e3
    ours_rate, ref_rate = calls / t_ours, calls / t_ref
    print(f"calls: {calls:,} (16 prefill + 16 decode, 64-block prompts, mooncake, no rejection)")
    print(f"ours (Rust via Python): p50 {p50:.2f} us  p99 {p99:.2f} us  mean {statistics.fmean(lat) / 1e3:.2f} us  {ours_rate:,.0f} decisions/s")
    print(f"reference (plain Python Algorithm 1): {ref_rate:,.0f} decisions/s  mean {t_ref / calls * 1e6:.1f} us")
    print(f"ratio ours/reference: {ours_rate / ref_rate:.1f}x   same prefill choice: {agree / calls:.1%}")
    ours.check_integrity()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=30_000)
    run(ap.parse_args().calls)
