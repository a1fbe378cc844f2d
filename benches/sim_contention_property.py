"""Issue 25's property, measured rather than asserted: on random small traces with the
link model on at random bandwidths, how often is ``mooncake``'s mean TTFT above the
best of ``local_cache_aware`` and ``load_balance``, and by how much?

(The test suite asserts the part that holds on every trace: tests/test_sim_contention.py;
this script reports the rest, misses included.)

    nice python benches/sim_contention_property.py [--cases 300] [--seed 1] [--kinds agentic,chat]
"""

from __future__ import annotations

import argparse
import random
import time

from mooncake_rs import sim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kinds", default="agentic,chat")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    kinds = a.kinds.split(",")
    t0 = time.perf_counter()
    worse: list[tuple[float, dict]] = []
    wins = ties = 0
    for _ in range(a.cases):
        case = dict(n=rng.randint(5, 80), kind=rng.choice(kinds), seed=rng.randint(0, 10**6), prefill=rng.randint(1, 4),
                    decode=rng.randint(1, 3), nic=10 ** rng.uniform(9, 11.5), rate=rng.choice([0.5, 1.0, 2.0, 5.0]))
        tr = sim.generate_trace(case["n"], kind=case["kind"], seed=case["seed"], rate=case["rate"])
        mean = {}
        for pol in ("load_balance", "local_cache_aware", "mooncake"):
            cfg = sim.SimConfig(prefill=case["prefill"], decode=case["decode"], policy=pol, nic_bandwidth=case["nic"],
                                ttft_slo_s=1e9, tbt_slo_s=1e9)
            mean[pol] = sim.Simulator(cfg).run(tr).mean_ttft_s
        best = min(mean["load_balance"], mean["local_cache_aware"])
        r = mean["mooncake"] / best
        if r > 1 + 1e-9:
            worse.append((r, case))
        elif r < 1 - 1e-9:
            wins += 1
        else:
            ties += 1
    n = a.cases
    print(f"{n} random small traces ({a.kinds}), link model on at 1-316 GB/s per NIC:")
    print(f"  mooncake below the best baseline: {wins} ({100 * wins / n:.0f}%), equal: {ties} ({100 * ties / n:.0f}%),"
          f" above: {len(worse)} ({100 * len(worse) / n:.0f}%)")
    if worse:
        rs = sorted(r for r, _ in worse)
        print(f"  when above: median {rs[len(rs) // 2]:.3f}x, worst {rs[-1]:.3f}x")
        lb_best = sum(1 for _, c in worse if c["kind"] == "chat")
        print(f"  of those, chat traces: {lb_best}; the 3 worst: {sorted(worse, key=lambda x: -x[0])[:3]}")
    print(f"(wall {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
