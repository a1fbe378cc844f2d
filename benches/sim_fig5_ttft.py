"""Fig. 5 of the Mooncake paper: mean TTFT of random, load-balancing, local cache-aware
and global cache-aware (mooncake) scheduling on 16 prefill instances
(paper, conversation trace: 19.65 s, 5.27 s, 3.58 s, 3.07 s).

We replay the synthetic trace (the conversation trace is not published with the
paper) at several loads (``speedup`` divides the arrival times) and compare the order
and the ratios to mooncake.

    python benches/sim_fig5_ttft.py
"""

import time

from sim_common import footer, run, table, trace

t0 = time.perf_counter()
tr = trace()
paper = {"random": 19.65, "load_balance": 5.27, "local_cache_aware": 3.58, "mooncake": 3.07}
for speedup in (8.0, 10.0, 12.0):
    ttft = {p: run(tr, policy=p, speedup=speedup).mean_ttft_s for p in paper}
    print(f"\nspeedup {speedup:g} (16P + 16D, unbounded caches)")
    rows = [[p, ttft[p], paper[p], ttft[p] / ttft["mooncake"], paper[p] / paper["mooncake"]] for p in paper]
    table(["policy", "ours mean TTFT s", "paper s", "ours / mooncake", "paper / mooncake"], rows)
    order = sorted(paper, key=ttft.get, reverse=True)
    print("same order as the paper:", order == list(paper))
footer(t0)
