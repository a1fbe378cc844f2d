"""Where prefill turns I/O-bound: the share of prefill time spent waiting on KV loads
(``Report.io_wait_fraction``) against the prefix hit rate and the link bandwidth.

Agentic traces (``generate_trace(kind="agentic")``) whose hit rate is set by how many
new tokens a tool step adds (0.25 tasks/s); 8 prefill + 8 decode instances; each
prefill instance keeps only 8k tokens in DRAM and 4M on its SSD share, so almost all of
a context is read back from the SSD tier at each step (the DualPath setting: the KV
lives in storage, not in the prefill's memory).
Each instance's NIC and storage link get the same bandwidth B (swept). mooncake policy.

    python benches/sim_io_bound.py [--requests 1500] [--plot io_bound.png]
"""

import argparse
import json
import time

import resource

from sim_common import table

from mooncake_rs.sim import MLALayout, SimConfig, Simulator, generate_trace

ap = argparse.ArgumentParser()
ap.add_argument("--requests", type=int, default=1500)
ap.add_argument("--bandwidths", default="6.25,12.5,25,50,100", help="GB/s per link")
ap.add_argument("--multipath", action="store_true")
ap.add_argument("--rate", type=float, default=0.25, help="agent tasks per second")
ap.add_argument("--dram", type=int, default=8192, help="DRAM tokens per prefill instance")
ap.add_argument("--layout", choices=("gqa", "mla"), default="gqa", help="gqa: LLaMA3-70B (327,680 B/token); mla: DeepSeek-V3-like (70,272)")
ap.add_argument("--plot", default=None, help="write a PNG of io_wait_fraction against bandwidth")
ap.add_argument("--json", default=None, help="write the rows as JSON")
a = ap.parse_args()
t0 = time.perf_counter()
bws = [float(x) for x in a.bandwidths.split(",")]
# new tokens per tool step -> hit rate (measured, printed)
steps = [("(4096, 16384)", (4096, 16384)), ("(1024, 4096)", (1024, 4096)), ("(256, 1024)", (256, 1024)), ("(32, 256)", (32, 256))]
rows = []
results = []
for label, tool in steps:
    tr = generate_trace(a.requests, kind="agentic", rate=a.rate, seed=1, tool_result_tokens=tool)
    row = [label]
    hit = None
    for bw in bws:
        rep = Simulator(
            SimConfig(
                prefill=8,
                decode=8,
                nic_bandwidth=bw * 1e9,
                storage_bandwidth=bw * 1e9,
                capacity_tokens_per_instance=a.dram,
                ssd_capacity_tokens_per_instance=4_000_000,
                multipath=a.multipath,
                layout=MLALayout(num_layers=61, block_size=512) if a.layout == "mla" else None,
            )
        ).run(tr)
        hit = rep.cache_hit_rate
        row.append(f"{rep.io_wait_fraction:.2f} ({rep.mean_ttft_s:.2f})")
        results.append(dict(tool_tokens=label, hit_rate=hit, bandwidth_gbs=bw, io_wait_fraction=rep.io_wait_fraction, mean_ttft_s=rep.mean_ttft_s, bytes=rep.bytes_loaded_per_path))
    row.insert(1, f"{hit:.3f}")
    rows.append(row)
print(f"io_wait_fraction (mean TTFT s), agentic {a.requests} requests at {a.rate:g} tasks/s, 8P+8D, DRAM {a.dram} tokens, multipath={a.multipath}, layout {a.layout}\n")
table(["new tokens a step", "hit rate"] + [f"B = {b:g} GB/s" for b in bws], rows)
if a.json:
    with open(a.json, "w") as f:
        json.dump(results, f, indent=1)
if a.plot:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, _ in steps:
        pts = [r for r in results if r["tool_tokens"] == label]
        ax.plot(
            [r["bandwidth_gbs"] for r in pts],
            [r["io_wait_fraction"] for r in pts],
            marker="o",
            label=f"{label} new tokens a step (hit {pts[-1]['hit_rate']:.3f})",
        )
    ax.axhline(0.5, color="grey", linestyle="--", label="half the prefill waiting")
    ax.set_xscale("log")
    ax.set_xlabel("NIC and storage link bandwidth per instance (GB/s)")
    ax.set_ylabel("io_wait_fraction")
    ax.set_title("prefill time waiting on KV loads, agentic trace")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.plot, dpi=100)
print(f"\n(wall {time.perf_counter() - t0:.1f} s, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; generated agentic traces)")
