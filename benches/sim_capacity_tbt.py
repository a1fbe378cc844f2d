"""Figs. 1, 6 and 7 of the Mooncake paper: effective request capacity (share of
requests meeting both SLOs) of disaggregated vs coupled serving as the TBT SLO varies
(paper: Mooncake serves 59%-498% more requests than the vLLM baseline within SLOs).

Same GPU count: 16 prefill + 16 decode (mooncake policy, global cache) against 32
coupled instances (vLLM-like continuous batching, local prefix caching, routed by
local_cache_aware), with and without chunked prefill (2048-token budget). TTFT SLO 10 s.

    python benches/sim_capacity_tbt.py
"""

import time

from sim_common import footer, run, table, trace

t0 = time.perf_counter()
tr = trace()
slos = (0.03, 0.05, 0.1, 0.2, 0.3)
for speedup in (4.0, 8.0):
    runs = {
        "disaggregated (mooncake)": run(tr, speedup=speedup, ttft_slo_s=10.0),
        "coupled, prefix caching": run(tr, speedup=speedup, ttft_slo_s=10.0, architecture="coupled", policy="local_cache_aware"),
        "coupled, prefix caching, chunked": run(
            tr, speedup=speedup, ttft_slo_s=10.0, architecture="coupled", policy="local_cache_aware", chunked_prefill=True
        ),
        "coupled, no caching (vLLM default)": run(
            tr, speedup=speedup, ttft_slo_s=10.0, architecture="coupled", policy="load_balance", prefix_caching=False
        ),
    }

    for worst in (False, True):
        what = "worst token gap" if worst else "mean token gap (TBT)"
        print(f"\nspeedup {speedup:g}: effective request capacity by TBT SLO, judged on each request's {what}")
        rows = [[name, *(rep.capacity_at(s, 10.0, worst) for s in slos)] for name, rep in runs.items()]
        dis = runs["disaggregated (mooncake)"]
        for name, rep in list(runs.items())[1:]:
            rows.append(
                [f"disaggregated / {name}", *(dis.capacity_at(s, 10.0, worst) / max(rep.capacity_at(s, 10.0, worst), 1e-9) for s in slos)]
            )
        table(["setup", *(f"TBT <= {s:g}s" for s in slos)], rows)
    print("mean TTFT s:", ", ".join(f"{n}: {r.mean_ttft_s:.2f}" for n, r in runs.items()))
print("\npaper: +59% .. +498% effective request capacity for Mooncake over vLLM")
footer(t0)
