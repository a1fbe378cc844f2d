"""Adaptive prefill/decode roles vs every fixed P:D split, on a workload whose
input/output mix shifts (long prompts + short outputs, then short prompts + long
outputs, then back; ``sim.phased_trace``). For each load, the share of requests that
meet both SLOs (``Report.effective_request_capacity``) with each fixed split, the best
of them (chosen in hindsight), and the adaptive run started from the even split and from
that best split; then the highest load of the grid at which each keeps >= --target.

    python benches/sim_adaptive_roles.py [--instances 8] [--loads 4,6,8,10] [--plot out.png]
"""

from __future__ import annotations

import argparse
import time

from mooncake_rs import sim


def phases(load: float, phase_s: float) -> tuple[sim.Phase, ...]:
    a = sim.Phase(phase_s, 1.25 * load, (8000, 16000), (8, 32))
    b = sim.Phase(phase_s, 4.0 * load, (256, 1024), (600, 1200))
    return (a, b, a)


def run(trace: list[sim.Request], p: int, n: int, adaptive: bool, policy: sim.RolePolicy) -> sim.Report:
    cfg = sim.SimConfig(
        prefill=p,
        decode=n - p,
        rejection="early",
        ttft_slo_s=10.0,
        tbt_slo_s=0.1,
        adaptive_roles=adaptive,
        role_policy=policy if adaptive else None,
    )
    return sim.Simulator(cfg).run(trace)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--loads", default="2,3,4,5,6,8")
    ap.add_argument("--phase-s", type=float, default=600.0)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, help="write a PNG of attainment vs load")
    a = ap.parse_args()
    n = a.instances
    policy = sim.RolePolicy()
    loads = [float(x) for x in a.loads.split(",")]
    rows = []
    wall0 = time.perf_counter()
    print(f"instances={n} phase_s={a.phase_s} policy={policy.to_dict()}")
    print(f"{'load':>5} {'reqs':>6}  fixed P=1..{n - 1}" + " " * 20 + "best(P)   adapt(even)  adapt(best)  switches")
    for load in loads:
        trace = sim.phased_trace(phases(load, a.phase_s), seed=a.seed)
        fixed = [run(trace, p, n, False, policy).effective_request_capacity for p in range(1, n)]
        best_p = 1 + max(range(n - 1), key=lambda i: fixed[i])
        even = run(trace, n // 2, n, True, policy)
        from_best = run(trace, best_p, n, True, policy)
        rows.append((load, fixed, best_p, even.effective_request_capacity, from_best.effective_request_capacity))
        fx = " ".join(f"{v:.3f}" for v in fixed)
        print(
            f"{load:5.1f} {len(trace):6d}  {fx}  {max(fixed):.3f}({best_p})  {even.effective_request_capacity:.3f}"
            f"        {from_best.effective_request_capacity:.3f}        {even.role_switches}/{from_best.role_switches}"
        )

    def capacity(vals: list[float]) -> float:
        ok = [ld for ld, v in zip(loads, vals) if v >= a.target]
        return max(ok) if ok else 0.0

    best_fixed_cap = max(capacity([r[1][i] for r in rows]) for i in range(n - 1))
    hindsight = [max(r[1]) for r in rows]  # the best split per load (an oracle per load, not per phase)
    print(f"capacity at >= {a.target:.0%} of requests meeting both SLOs (highest load of the grid):")
    print(f"  best single fixed split : {best_fixed_cap}")
    print(f"  best split per load     : {capacity(hindsight)}")
    print(f"  adaptive from P={n // 2}     : {capacity([r[3] for r in rows])}")
    print(f"  adaptive from best P    : {capacity([r[4] for r in rows])}")
    print(f"wall {time.perf_counter() - wall0:.1f}s")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(loads, hindsight, "k--", label="best fixed P:D per load (hindsight)")
        ax.plot(loads, [r[3] for r in rows], "o-", label=f"adaptive from {n // 2}:{n - n // 2}")
        ax.plot(loads, [r[4] for r in rows], "s-", label="adaptive from the best split")
        ax.axhline(a.target, color="grey", lw=0.5)
        ax.set_xlabel("load (x base rate)")
        ax.set_ylabel("share meeting TTFT and TBT SLO")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot)


if __name__ == "__main__":
    main()
