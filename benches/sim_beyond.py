"""Beyond the paper: a rule of ours against "mooncake" on effective request capacity.

`eager_index` (ours): a prompt's blocks are put in the conductor's index on its
prefill instance when the request is scheduled, not when its prefill ends. Instances
prefill in FIFO order, so a later request sent there finds them. Under load a
prompt's prefix is often still queued when the next request with that prefix arrives
(the next turn of a conversation, the same document); Algorithm 1 cannot see it and
computes it again elsewhere. `ttft_optimal` (the conductor's own policy) prices every
holder and tier without a balancing threshold.

    python benches/sim_beyond.py
"""

import time

from sim_common import footer, run, table, trace

t0 = time.perf_counter()
tr = trace()
rows = []
for speedup in (12.0, 16.0):
    for rej in ("none", "early"):
        base = dict(speedup=speedup, rejection=rej, ttft_slo_s=10.0)
        ref = run(tr, **base)
        for name, kw in (
            ("mooncake (paper)", {}),
            ("mooncake + eager_index (ours)", dict(eager_index=True)),
            ("ttft_optimal + eager_index (ours)", dict(policy="ttft_optimal", eager_index=True)),
        ):
            r = ref if not kw else run(tr, **base, **kw)
            rows.append(
                [speedup, rej, name, r.effective_request_capacity, r.effective_request_capacity / ref.effective_request_capacity,
                 r.mean_ttft_s, r.cache_hit_rate, r.rejected]
            )
table(["speedup", "rejection", "setup", "eff. capacity", "vs mooncake", "mean TTFT s", "hit rate", "rejected"], rows)
footer(t0)
