"""DualPath in the simulator: single-path vs multi-path prefix loading at equal hardware.

Agentic trace (``generate_trace(kind="agentic")``, tool loops over long shared
contexts, hit rate ~0.97, 0.25 tasks/s); 8 prefill + 8 decode instances; each prefill
instance keeps 8k tokens in DRAM and 4M tokens on its SSD share, so almost all of each
step's prefix is read back from the SSD tier. Links: NIC 50 GB/s each way, storage link 12.5 GB/s (a storage
NIC slower than the compute fabric, as in DualPath's clusters). Single-path: a prefill
reads SSD blocks through its own storage link and peer-DRAM blocks from the one holder
the conductor named. Multi-path: the SSD part is split with the decode instance's
storage link (relayed over its NIC), the peer-DRAM part across every DRAM holder, by
free bandwidth. Same trace, same conductor, same hardware.

- offline: every request arrives at once (speedup 1e6): throughput = requests / makespan
  (an open-loop trace: a task's steps are all queued at once, so a step can start
  before its previous one has stored its prefix and the hit rate drops);
- online: arrivals at the trace's rate x speedup: mean / p90 TTFT, effective capacity
  (TTFT <= 10 s, TBT <= 0.1 s).

    python benches/sim_multipath.py [--requests 1500] [--plot multipath.png]
"""

import argparse
import time

import resource

from sim_common import table

from mooncake_rs.sim import SimConfig, Simulator, generate_trace

ap = argparse.ArgumentParser()
ap.add_argument("--requests", type=int, default=1500)
ap.add_argument("--loads", default="1,2,3,4")
ap.add_argument("--max-load", type=float, default=4.0)
ap.add_argument("--plot", default=None, help="write a PNG: capacity and mean TTFT against load, both loadings")
ap.add_argument("--nic", type=float, default=50.0, help="GB/s")
ap.add_argument("--storage", type=float, default=12.5, help="GB/s")
ap.add_argument("--rate", type=float, default=0.25, help="agent tasks per second")
ap.add_argument("--dram", type=int, default=8192, help="DRAM tokens per prefill instance")
a = ap.parse_args()
t0 = time.perf_counter()
tr = generate_trace(a.requests, kind="agentic", rate=a.rate, seed=1)
hw = dict(
    prefill=8,
    decode=8,
    nic_bandwidth=a.nic * 1e9,
    storage_bandwidth=a.storage * 1e9,
    capacity_tokens_per_instance=a.dram,
    ssd_capacity_tokens_per_instance=4_000_000,
    ttft_slo_s=10.0,
)


def run(speedup: float, multipath: bool):
    return Simulator(SimConfig(speedup=speedup, multipath=multipath, **hw)).run(tr)


rows = []
single = run(1e6, False)
multi = run(1e6, True)
for name, rep in (("single-path", single), ("multi-path", multi)):
    b = rep.bytes_loaded_per_path
    rows.append(
        [
            name,
            f"{rep.throughput_rps:.2f}",
            f"{rep.makespan_s:.1f}",
            f"{rep.io_wait_fraction:.2f}",
            f"{rep.cache_hit_rate:.3f}",
            f"{b['ssd_direct'] / 1e12:.1f} / {b['ssd_relay'] / 1e12:.1f} / {b['dram_peer'] / 1e12:.1f}",
        ]
    )
print(f"offline: {a.requests} agentic requests at once, 8P+8D, NIC {a.nic:g} GB/s, storage {a.storage:g} GB/s\n")
table(["loading", "requests/s", "makespan s", "io_wait_fraction", "hit rate", "TB ssd direct / relay / peer dram"], rows)
print(f"\nmulti-path / single-path offline throughput: {multi.throughput_rps / single.throughput_rps:.2f}x\n")
rows = []
for s in [float(x) for x in a.loads.split(",")]:
    sp, mp = run(s, False), run(s, True)
    rows.append(
        [
            f"{s:g}x",
            f"{sp.mean_ttft_s:.2f} / {mp.mean_ttft_s:.2f}",
            f"{sp.p90_ttft_s:.2f} / {mp.p90_ttft_s:.2f}",
            f"{sp.io_wait_fraction:.2f} / {mp.io_wait_fraction:.2f}",
            f"{sp.effective_request_capacity:.3f} / {mp.effective_request_capacity:.3f}",
            f"{sp.mean_ttft_s / mp.mean_ttft_s:.2f}x",
        ]
    )
print("online (single / multi):\n")
table(["load", "mean TTFT s", "p90 TTFT s", "io_wait_fraction", "eff. capacity", "TTFT single/multi"], rows)
# online capacity: the highest load on a 0.25x grid still serving >= 90% within the SLOs
grid = [1.0 + 0.25 * j for j in range(int((a.max_load - 1.0) / 0.25) + 1)]
best = {}
curves: dict[bool, list[tuple[float, float, float]]] = {}
for mp in (False, True):
    reps = [(s, run(s, mp)) for s in grid]
    curves[mp] = [(s, r.effective_request_capacity, r.mean_ttft_s) for s, r in reps]
    ok = [s for s, r in reps if r.effective_request_capacity >= 0.9]
    best[mp] = max(ok) if ok else 0.0
print(
    f"\nonline: highest load with effective capacity >= 0.9 (grid of 0.25x up to {a.max_load:g}x):"
    f" single-path {best[False]:g}x, multi-path {best[True]:g}x"
    + (f" ({best[True] / best[False]:.2f}x)" if best[False] else "")
)
if a.plot:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for mp, name in ((False, "single-path"), (True, "multi-path")):
        xs = [c[0] for c in curves[mp]]
        ax[0].plot(xs, [c[1] for c in curves[mp]], marker="o", label=name)
        ax[1].plot(xs, [c[2] for c in curves[mp]], marker="o", label=name)
    ax[0].axhline(0.9, color="grey", linestyle="--")
    ax[0].set_xlabel("load (x the trace's rate)")
    ax[0].set_ylabel("effective request capacity")
    ax[1].set_xlabel("load (x the trace's rate)")
    ax[1].set_ylabel("mean TTFT (s)")
    ax[1].set_yscale("log")
    for x in ax:
        x.legend()
    fig.suptitle(f"agentic trace, 8P+8D, NIC {a.nic:g} GB/s, storage {a.storage:g} GB/s")
    fig.tight_layout()
    fig.savefig(a.plot, dpi=100)
print(f"\n(wall {time.perf_counter() - t0:.1f} s, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; generated agentic traces)")
