"""Replay speed and memory: the 3,993-request synthetic trace on 16P+16D (target
<= 10 s) and 12,000 requests (the trace repeated, ids and times shifted per copy;
target <= 30 s). Peak RSS from getrusage.

    python benches/sim_perf.py
"""

import resource
import time

from sim_common import table, tiled, trace

from mooncake_rs.sim import SimConfig, Simulator

tr = trace()
big = tiled(tr)
rows = []
for name, t in (("synthetic 3,993", tr), (f"tiled {len(big):,}", big)):
    for pol, extra in (("mooncake", {}), ("random", {}), ("mooncake", dict(architecture="coupled"))):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            rep = Simulator(SimConfig(policy=pol, speedup=8.0, **extra)).run(t)
            times.append(time.perf_counter() - t0)
        times.sort()
        rows.append([name, pol + (" coupled" if extra else ""), times[1], times[0], len(t) / times[1]])
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
table(["trace", "setup", "median wall s", "best wall s", "requests/s"], rows)
print(f"\npeak RSS of this process (all runs): {rss:.0f} MiB")
