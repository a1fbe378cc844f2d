"""Fig. 10 of the Mooncake paper: global vs local cache, 10 prefill instances of 3M
tokens each: cache hit rate and total prefill compute time (the paper shows the global
cache ahead on both; the figure has no table of numbers).

Global: the mooncake policy, which may fetch a prefix from its holder. Local: each
instance reuses only what it holds (local_cache_aware routing on local caches).

    python benches/sim_fig10_global_local.py
"""

import time

from sim_common import footer, run, table, trace

t0 = time.perf_counter()
tr = trace()
rows = []
for speedup in (1.0, 4.0):
    g = run(tr, prefill=10, decode=10, capacity_tokens_per_instance=3_000_000, cache="global", policy="mooncake", speedup=speedup)
    loc = run(tr, prefill=10, decode=10, capacity_tokens_per_instance=3_000_000, cache="local", policy="local_cache_aware", speedup=speedup)
    rows.append([speedup, "global", g.cache_hit_rate, g.prefill_compute_s, g.mean_ttft_s, g.counters.get("fetches", 0)])
    rows.append([speedup, "local", loc.cache_hit_rate, loc.prefill_compute_s, loc.mean_ttft_s, 0])
    rows.append([speedup, "global / local", g.cache_hit_rate / loc.cache_hit_rate, g.prefill_compute_s / loc.prefill_compute_s, g.mean_ttft_s / loc.mean_ttft_s, ""])
table(["speedup", "cache", "hit rate", "prefill compute s", "mean TTFT s", "fetches"], rows)
print("\npaper: global > local in hit rate, global < local in prefill time")
footer(t0)
