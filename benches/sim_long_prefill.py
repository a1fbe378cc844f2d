"""Chunked pipeline parallelism (CPP, Mooncake §3.3) vs sequence parallelism (SP, ring
attention) for one long prompt on N instances, side by side (closed-form cost models
of sim/longprefill.py; assumptions in docs/sim.md). CPP's chunk is the best of 1k-16k
tokens for each cell. Seconds, and the speedup over one instance.

    python benches/sim_long_prefill.py [--nic 50] [--plot long_prefill.png]
"""

import argparse

from sim_common import table

from mooncake_rs.sim.longprefill import LongPrefillModel, cpp_time, sp_time

ap = argparse.ArgumentParser()
ap.add_argument("--nic", type=float, default=50.0, help="GB/s per instance")
ap.add_argument("--plot", default=None)
a = ap.parse_args()
m = LongPrefillModel(nic_bandwidth=a.nic * 1e9)
lens = [16384, 32768, 65536, 131072]
ns = [2, 4, 8]
chunks = [1024, 2048, 4096, 8192, 16384]
rows = []
pts = []
for n in lens:
    one = sp_time(m, n, 1)
    row = [f"{n // 1024}k", f"{one:.2f}"]
    for N in ns:
        c_best = min(chunks, key=lambda c: cpp_time(m, n, N, c))
        tc, ts = cpp_time(m, n, N, c_best), sp_time(m, n, N)
        row.append(f"{tc:.2f} ({one / tc:.2f}x, {c_best // 1024}k) / {ts:.2f} ({one / ts:.2f}x)")
        pts.append((n, N, one / tc, one / ts))
    rows.append(row)
print(f"one prompt, N instances of 8 GPUs (LLaMA3-70B-class cost model), NIC {a.nic:g} GB/s:")
print("CPP seconds (speedup, best chunk) / SP seconds (speedup)\n")
table(["prompt", "1 instance s"] + [f"N = {N}" for N in ns], rows)
if a.plot:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for N in ns:
        xs = [p[0] for p in pts if p[1] == N]
        ax.plot(xs, [p[2] for p in pts if p[1] == N], marker="o", label=f"CPP, N={N}")
        ax.plot(xs, [p[3] for p in pts if p[1] == N], marker="x", linestyle="--", label=f"SP, N={N}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("speedup over one instance")
    ax.set_title(f"long-prompt prefill, NIC {a.nic:g} GB/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.plot, dpi=100)
