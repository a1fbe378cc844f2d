"""How the conductor's policies rank when its estimates are wrong.

The simulated instances run on the true cost models; the conductor schedules with its
own. ``estimate_error`` = e multiplies each request's true prefill and transfer times
by exp(e * z - e^2 / 2), z ~ N(0, 1) per request (seeded; mean 1, so the total work
stays the same in expectation), so the conductor's queue and TTFT
estimates drift from what happens. A last block of rows keeps the estimates unbiased per
request but makes the truth systematically slower (true prefill model 1.2x the
conductor's) — a cost model fitted on other hardware.

    python benches/sim_fidelity.py [--speedup 10] [--errors 0,0.1,0.25,0.5,1.0] [--seeds 3]
"""

import argparse
import time

from sim_common import footer, table, trace

from mooncake_rs import PrefillCostModel
from mooncake_rs.sim import SimConfig, Simulator

ap = argparse.ArgumentParser()
ap.add_argument("--speedup", type=float, default=10.0)
ap.add_argument("--errors", default="0,0.1,0.25,0.5,1.0")
ap.add_argument("--policies", default="random,load_balance,local_cache_aware,mooncake,ttft_optimal")
ap.add_argument("--seeds", type=int, default=3, help="runs per cell (seed 0..n-1: error draws, random policy); means")
a = ap.parse_args()
t0 = time.perf_counter()
tr = trace()
errors = [float(x) for x in a.errors.split(",")]
policies = a.policies.split(",")
base = PrefillCostModel()
slow = PrefillCostModel(c0=base.c0 * 1.2, c_new=base.c_new * 1.2, c_new2=base.c_new2 * 1.2, c_cross=base.c_cross * 1.2)
setups = [(f"error {e:g}", dict(estimate_error=e)) for e in errors]
setups.append(("truth 1.2x slower", dict(true_prefill_model=slow)))
cap: dict[str, list[float]] = {}
ttft: dict[str, list[float]] = {}
for name, kw in setups:
    for pol in policies:
        reps = [Simulator(SimConfig(policy=pol, speedup=a.speedup, ttft_slo_s=10.0, seed=sd, **kw)).run(tr) for sd in range(a.seeds)]
        cap.setdefault(name, []).append(sum(r.effective_request_capacity for r in reps) / len(reps))
        ttft.setdefault(name, []).append(sum(r.mean_ttft_s for r in reps) / len(reps))


def ranks(xs: list[float]) -> list[int]:
    order = sorted(range(len(xs)), key=lambda j: -xs[j])
    r = [0] * len(xs)
    for k, j in enumerate(order):
        r[j] = k + 1
    return r


print(f"effective request capacity (TTFT SLO 10 s, TBT SLO 0.1 s), 16P+16D, {a.speedup:g}x, mean of {a.seeds} seeds; (rank)\n")
rows = []
for name, _ in setups:
    rk = ranks(cap[name])
    rows.append([name] + [f"{c:.3f} ({r})" for c, r in zip(cap[name], rk)])
table(["setup"] + policies, rows)
print(f"\nmean TTFT (s), mean of {a.seeds} seeds\n")
table(["setup"] + policies, [[name] + [f"{x:.2f}" for x in ttft[name]] for name, _ in setups])
footer(t0)
