"""Replay speed with the link model on, side by side with the model off (issue 16
target: 12,000 requests within 2x of the plain replay, <= 2 s). The 12,000 requests are
the synthetic trace repeated with shifted ids and times (as benches/sim_perf.py);
16P+16D mooncake at 8x; 3 runs each, interleaved, medians.

    python benches/sim_perf_links.py [--runs 3]
"""

import argparse
import time

from sim_common import footer, table, tiled, trace

from mooncake_rs.sim import SimConfig, Simulator

ap = argparse.ArgumentParser()
ap.add_argument("--runs", type=int, default=3)
a = ap.parse_args()
t00 = time.perf_counter()
tr = trace()
big = tiled(tr)
setups = [
    ("links off (today's replay)", {}),
    ("nic 50 GB/s", dict(nic_bandwidth=50e9)),
    (
        "nic 50 GB/s + SSD tier (1M DRAM, 20M SSD tokens, storage 10 GB/s)",
        dict(nic_bandwidth=50e9, storage_bandwidth=10e9, capacity_tokens_per_instance=1_000_000, ssd_capacity_tokens_per_instance=20_000_000),
    ),
    (
        "same + multipath",
        dict(
            nic_bandwidth=50e9,
            storage_bandwidth=10e9,
            capacity_tokens_per_instance=1_000_000,
            ssd_capacity_tokens_per_instance=20_000_000,
            multipath=True,
        ),
    ),
]
times: dict[str, list[float]] = {n: [] for n, _ in setups}
for _ in range(a.runs):
    for name, kw in setups:
        t0 = time.perf_counter()
        Simulator(SimConfig(speedup=8.0, **kw)).run(big)
        times[name].append(time.perf_counter() - t0)
base = sorted(times[setups[0][0]])[len(times[setups[0][0]]) // 2]
rows = []
for name, _ in setups:
    ts = sorted(times[name])
    med = ts[len(ts) // 2]
    rows.append([name, med, ts[0], med / base, len(big) / med])
print(f"{len(big):,} requests, 16P+16D mooncake, 8x, {a.runs} runs each (interleaved)\n")
table(["setup", "median wall s", "best wall s", "vs links off", "requests/s"], rows)
footer(t00)
