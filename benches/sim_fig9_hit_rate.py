"""Fig. 9 of the Mooncake paper: cache hit rate against capacity, 10^4 .. 10^9 tokens,
for every eviction policy of the store (one cache, requests in trace order).

    python benches/sim_fig9_hit_rate.py
"""

import time

from sim_common import footer, table, trace

from mooncake_rs.sim import hit_rate_curve

t0 = time.perf_counter()
tr = trace()
caps = [10**4, 3 * 10**4, 10**5, 3 * 10**5, 10**6, 3 * 10**6, 10**7, 10**8, 10**9]
curves = {p: hit_rate_curve(tr, caps, eviction=p) for p in ("lru", "s3fifo", "prefix")}
rows = [[f"{c:.0e}", *(curves[p][c] for p in curves), curves["lru"][10**9] if c == 10**9 else ""] for c in caps]
table(["capacity (tokens)", "lru", "s3fifo", "prefix", "paper (unbounded: 0.66)"], rows)
best = {c: max(curves, key=lambda p: curves[p][c]) for c in caps}
print("\nbest policy per capacity:", ", ".join(f"{c:.0e}: {p}" for c, p in best.items()))
footer(t0)
