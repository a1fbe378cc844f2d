"""Router CPU per request and control messages per request of a serving Cluster.

Runs the tiny model (CPU) in a 1 prefill + 1 decode cluster, in-process and/or with
worker processes, serves ``--requests`` distinct prompts per round (all submitted at
once through ``generate``) and reads the router thread's CPU clock
(``time.pthread_getcpuclockid``) around each round: router CPU per request is its CPU
time over the round divided by the requests. Prints the median over ``--rounds``, and
the control messages per request when the cluster counts them (``message_counts``).

    python benches/serving_control_bench.py --requests 64 --rounds 5 --max-tokens 4 --mode both
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time


def router_cpu_s(cluster) -> float:
    t = next(t for t in threading.enumerate() if t.name == "mooncake-router")
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))


def run(processes: bool, requests: int, rounds: int, max_tokens: int) -> dict[str, float]:
    from mooncake_rs import Cluster
    from mooncake_rs.engine import ModelConfig, SamplingParams

    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    per_req, walls, hops = [], [], []
    with Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=16, dram_bytes_per_instance=32 << 20,
                 seed=0, processes=processes) as c:
        c.generate([[rng.randrange(256) for _ in range(40)] for _ in range(8)], params)  # warm up
        for _ in range(rounds):
            prompts = [[rng.randrange(256) for _ in range(rng.randrange(20, 60))] for _ in range(requests)]
            counts0 = c.message_counts() if hasattr(c, "message_counts") else None
            cpu0, t0 = router_cpu_s(c), time.perf_counter()
            c.generate(prompts, params)
            cpu1, t1 = router_cpu_s(c), time.perf_counter()
            per_req.append((cpu1 - cpu0) / requests)
            walls.append(t1 - t0)
            if counts0 is not None:
                counts1 = c.message_counts()
                hops.append(sum(counts1.values()) - sum(counts0.values()))
    out = {"router_cpu_us_per_request": statistics.median(per_req) * 1e6, "wall_s_per_round": statistics.median(walls)}
    if hops:
        out["messages_per_request"] = statistics.median(hops) / requests
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--mode", choices=["inproc", "processes", "both"], default="both")
    a = ap.parse_args()
    modes = {"inproc": [False], "processes": [True], "both": [False, True]}[a.mode]
    for processes in modes:
        r = run(processes, a.requests, a.rounds, a.max_tokens)
        label = "processes=True " if processes else "processes=False"
        print(f"{label}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
