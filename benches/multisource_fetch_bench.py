"""Multi-source prefix fetch vs a single-source one (issue 16, DualPath in the real data
path): a run of blocks pulled into a fresh store from one holder, then from two holders
at once (split by free bandwidth, here even), through the serving layer's transports and
the transfer engine, with each holder's link out emulated at ``--link`` bytes/s
(``Transport(link_bandwidth=...)``: a read completes no earlier than its bytes take on
its holder's link). Medians of ``--runs`` runs of each, interleaved; every run's blocks
are checked byte for byte against the holders'. ``--link 0`` measures the bare copies
(in-process memcpy, no emulation).

    python benches/multisource_fetch_bench.py [--blocks 128] [--block-kib 128] [--link 1e9] [--runs 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
from mooncake_rs import TransferRegistry
from mooncake_rs.serving.arena import StoreSlots
from mooncake_rs.serving.multisource import (
    FetchSource,
    Holder,
    MultiFetch,
    split_blocks,
)
from mooncake_rs.serving.transport import Transport


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--block-kib", type=int, default=128)
    ap.add_argument("--link", type=float, default=1e9, help="bytes/s of each holder's link; 0: no emulation")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--holders", type=int, default=2)
    a = ap.parse_args()
    bb = a.block_kib << 10
    link = a.link or None
    reg = TransferRegistry()
    rng = random.Random(0)
    keys = [rng.getrandbits(128) for _ in range(a.blocks)]
    data = {k: np.frombuffer(rng.randbytes(bb), dtype=np.uint8) for k in keys}
    holders = []
    for i in range(a.holders):
        st = StoreSlots(bb, bb * (a.blocks + 4), shared_memory=False, scope=i)
        order = keys[:]
        random.Random(i).shuffle(order)
        for k in order:
            assert st.store.put(k, data[k])
        t = Transport(f"holder-{i}", st.store, reg, None, peers_write=False)
        holders.append((st, t, FetchSource(i, t.endpoint, [st.store.slot_offset(k) for k in keys])))

    def once(n_src: int, run: int) -> float:
        st = StoreSlots(bb, bb * (a.blocks + 4), shared_memory=False, scope=100)
        t = Transport(f"reader-{n_src}-{run}", st.store, reg, link, peers_write=False)
        srcs = [h[2] for h in holders[:n_src]]
        for s in srcs:
            t.peer(s.endpoint)  # connect outside the timing (a cluster's links are up already)
        counts = split_blocks(len(keys), [Holder(s.holder, link) for s in srcs])
        t0 = time.perf_counter()
        res = MultiFetch(t, st, keys, srcs, counts).run()
        dt = time.perf_counter() - t0
        assert res.error is None and res.fetched == len(keys), res.error
        for b, k in zip(res.blocks, keys):
            assert np.array_equal(np.asarray(b), data[k]), "a fetched block differs from the holder's"
            b.release()
        t.close()
        return dt

    once(1, -1)
    once(a.holders, -1)  # warm-up (page faults of fresh arenas are in every run alike)
    single, multi = [], []
    for r in range(a.runs):
        single.append(once(1, r))
        multi.append(once(a.holders, r))
    s, m = statistics.median(single), statistics.median(multi)
    mib = a.blocks * bb / (1 << 20)
    lk = f"{a.link / 1e9:g} GB/s per holder link" if link else "no link emulation (bare memcpy)"
    print(f"fetch of {a.blocks} blocks x {a.block_kib} KiB = {mib:.0f} MiB, {lk}, median of {a.runs} runs")
    print(f"  single source : {s * 1e3:8.2f} ms  ({mib / s:8.0f} MiB/s)")
    print(f"  {a.holders} sources     : {m * 1e3:8.2f} ms  ({mib / m:8.0f} MiB/s)")
    print(f"  speed-up      : {s / m:.2f}x  (byte-for-byte equal in every run)")
    for _, t, _ in holders:
        t.close()


if __name__ == "__main__":
    main()
