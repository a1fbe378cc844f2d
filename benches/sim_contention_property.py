"""Issue 25's property, measured rather than asserted: on random small traces with the
link model on at random bandwidths, how often is ``mooncake``'s mean TTFT above the
best of ``local_cache_aware`` and ``load_balance``, and by how much?

Also, per case above the best baseline, the excess of ``mooncake``'s total TTFT over
that baseline's in units of the baseline's largest single TTFT ("request-worths": the
tolerance tests/test_sim_contention.py states), and the cases by trace kind and rate.

    nice python benches/sim_contention_property.py [--cases 300] [--seed 1] [--kinds agentic,chat]
        [--prefetch-staging-bytes 64e9]   # prefetch at decision time (every policy's config)
        [--replicate-every-s 0.5 --replicate-for mooncake|all]   # hot-prefix replication
        [--list]   # every case above the best baseline, one line each
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
    ap.add_argument("--prefetch-staging-bytes", type=float, default=sim.SimConfig().prefetch_staging_bytes,
                    help="staging DRAM per prefill instance (default: the conductor's, 64 GB; 0: off)")
    ap.add_argument("--replicate-every-s", type=float, default=None,
                    help="act on the conductor's replication hints every this many seconds (default: never)")
    ap.add_argument("--replicate-for", choices=("mooncake", "all"), default="all",
                    help="with --replicate-every-s: replicate in mooncake's runs only, or in every policy's")
    ap.add_argument("--list", action="store_true",
                    help="print every case above the best baseline (its parameters, the winning baseline, the excess)")
    a = ap.parse_args()
    if a.replicate_every_s is not None and a.replicate_every_s <= 0:
        ap.error("--replicate-every-s must be > 0")
    rng = random.Random(a.seed)
    kinds = a.kinds.split(",")
    t0 = time.perf_counter()
    worse: list[tuple[float, dict]] = []
    wins = ties = 0
    replicated: dict[str, int] = {}  # per policy: cases whose run made any replica
    for _ in range(a.cases):
        case = dict(n=rng.randint(5, 80), kind=rng.choice(kinds), seed=rng.randint(0, 10**6), prefill=rng.randint(1, 4),
                    decode=rng.randint(1, 3), nic=10 ** rng.uniform(9, 11.5), rate=rng.choice([0.5, 1.0, 2.0, 5.0]))
        tr = sim.generate_trace(case["n"], kind=case["kind"], seed=case["seed"], rate=case["rate"])
        mean, worst = {}, {}
        for pol in ("load_balance", "local_cache_aware", "mooncake"):
            repl = a.replicate_every_s if (a.replicate_for == "all" or pol == "mooncake") else None
            cfg = sim.SimConfig(prefill=case["prefill"], decode=case["decode"], policy=pol, nic_bandwidth=case["nic"],
                                ttft_slo_s=1e9, tbt_slo_s=1e9, prefetch_staging_bytes=a.prefetch_staging_bytes,
                                replicate_every_s=repl)
            rep = sim.Simulator(cfg).run(tr)
            tt = [r.ttft_s for r in rep.requests]
            if rep.counters.get("replicated_blocks", 0):
                replicated[pol] = replicated.get(pol, 0) + 1
            mean[pol], worst[pol] = sum(tt) / len(tt), max(tt)
        bp = min(("load_balance", "local_cache_aware"), key=lambda p: mean[p])
        best = mean[bp]
        r = mean["mooncake"] / best
        if r > 1 + 1e-9:
            case["request_worths"] = round((mean["mooncake"] - best) * case["n"] / worst[bp], 2)
            case["winner"] = bp
            case["means"] = {p: round(m, 4) for p, m in mean.items()}
            worse.append((r, case))
        elif r < 1 - 1e-9:
            wins += 1
        else:
            ties += 1
    n = a.cases
    repl = "off" if a.replicate_every_s is None else f"every {a.replicate_every_s} s for {a.replicate_for}"
    print(f"{n} random small traces ({a.kinds}), link model on at 1-316 GB/s per NIC, replication {repl}:")
    print(f"  mooncake below the best baseline: {wins} ({100 * wins / n:.0f}%), equal: {ties} ({100 * ties / n:.0f}%),"
          f" above: {len(worse)} ({100 * len(worse) / n:.0f}%)")
    if a.replicate_every_s is not None:
        print(f"  cases whose run made a replica, per policy: {replicated}")
    if worse:
        rs = sorted(r for r, _ in worse)
        print(f"  when above: median {rs[len(rs) // 2]:.3f}x, worst {rs[-1]:.3f}x")
        lb_best = sum(1 for _, c in worse if c["kind"] == "chat")
        print(f"  of those, chat traces: {lb_best}; the 3 worst: {sorted(worse, key=lambda x: -x[0])[:3]}")
        ws = sorted(c["request_worths"] for _, c in worse)
        print(f"  excess in request-worths: median {ws[len(ws) // 2]:.2f}, max {ws[-1]:.2f};"
              f" within 3: {sum(w <= 3 for w in ws)} of {len(ws)}")
        for kind in kinds:
            for rate in (0.5, 1.0, 2.0, 5.0):
                sel = [(r, c) for r, c in worse if c["kind"] == kind and c["rate"] == rate]
                if sel:
                    print(f"  {kind} at {rate}/s: {len(sel)} above, request-worths {sorted(c['request_worths'] for _, c in sel)}")
    if a.list:
        print("  every case above (ratio, kind, n, rate/s, P+D, NIC GB/s, trace seed, winner, request-worths, means):")
        for r, c in sorted(worse, key=lambda x: -x[0]):
            print(f"    {r:.3f}x {c['kind']} n={c['n']} rate={c['rate']} {c['prefill']}P+{c['decode']}D"
                  f" nic={c['nic'] / 1e9:.2f} seed={c['seed']} winner={c['winner']} rw={c['request_worths']}"
                  f" means={c['means']}")
    print(f"(wall {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
