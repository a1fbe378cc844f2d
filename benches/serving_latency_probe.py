"""Latency of a 1 prefill + 1 decode in-process Cluster (tiny model, CPU): the median
wall time and TTFT of 30 sequential requests (4 tokens each), and the median time of 5
rounds of 64 concurrent requests. Used side by side with an export of an older commit
(``PYTHONPATH=<export>/python``) to check the control plane's latency:

    python benches/serving_latency_probe.py
"""
import random, statistics, time, sys
import mooncake_rs
from mooncake_rs.engine import ModelConfig, SamplingParams
rng = random.Random(0)
params = SamplingParams(max_tokens=4, ignore_eos=True)
with mooncake_rs.Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=16, dram_bytes_per_instance=32<<20, seed=0) as c:
    c.generate([[rng.randrange(256) for _ in range(40)] for _ in range(4)], params)
    seq = []
    for _ in range(30):
        t = time.perf_counter(); o = c.generate([[rng.randrange(256) for _ in range(40)]], params)[0]; seq.append((time.perf_counter() - t, o.metrics.ttft_s))
    conc = []
    for _ in range(5):
        t = time.perf_counter(); c.generate([[rng.randrange(256) for _ in range(40)] for _ in range(64)], params); conc.append(time.perf_counter() - t)
print("seq total ms %.2f ttft ms %.2f | 64 concurrent s %.3f" % (statistics.median(s for s, _ in seq) * 1e3, statistics.median(t for _, t in seq) * 1e3, statistics.median(conc)))
