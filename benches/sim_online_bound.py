"""How far above the best baseline must *any* online placement be? Issue 25's property
asks that ``mooncake``'s mean TTFT never be above the best of ``local_cache_aware`` and
``load_balance``. A policy that places each request on arrival places the first m
requests of a trace the same way as it places that trace's first m requests alone (it
cannot tell the two apart when it decides). So on a trace and its prefix it is above the
best baseline of one of them by at least the *unavoidable excess*: the least, over every
vector of prefill instances, of the larger of its two excesses
(tests/placement_helpers.py simulates every vector: 2 prefill instances, 1 decode, the
link model on at 1 GB/s, where the conductor fetches nothing on these traces).

Lists every (trace, m) with an unavoidable excess, then a summary; the cases kept in
tests/test_sim_online_bound.py came from here.

    nice python benches/sim_online_bound.py [--cases 300] [--seed 7] [--max-requests 9]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from placement_helpers import best_baseline, every_placement, excess_over  # noqa: E402

from mooncake_rs.sim import generate_trace  # noqa: E402

SHAPE = dict(prefill=2, decode=1, nic=1e9)
MIN_REQUESTS = 5  # the property test's smallest trace: both traces of a pair are at least this long


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-requests", type=int, default=9,
                    help="longest trace (every vector is simulated: 2**n runs; default 9)")
    a = ap.parse_args()
    if not MIN_REQUESTS < a.max_requests <= 12:
        ap.error(f"--max-requests must be in {MIN_REQUESTS + 1}..12")
    rng = random.Random(a.seed)
    t0 = time.perf_counter()
    found: list[tuple[float, str]] = []
    for case in range(a.cases):
        kind, n = rng.choice(["agentic", "chat"]), rng.randint(MIN_REQUESTS + 1, a.max_requests)
        seed, rate = rng.randint(0, 10**6), rng.choice([0.5, 1.0, 2.0, 5.0])
        trace = generate_trace(n, kind=kind, seed=seed, rate=rate)
        # the whole trace's 2**n placements once, against each of its prefixes
        full, best_full = every_placement(trace, **SHAPE), best_baseline(trace, **SHAPE)
        for m in range(MIN_REQUESTS, n):
            head = trace[:m]
            excess = excess_over(full, best_full, every_placement(head, **SHAPE), best_baseline(head, **SHAPE))
            if excess > 0:
                line = f"{kind} n={n} seed={seed} rate={rate} m={m}: unavoidable excess {excess * 1e3:.2f} ms"
                found.append((excess, line))
                print(line, flush=True)
        print(f"\r{case + 1}/{a.cases} cases, {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    worst = max(found)[1] if found else "none"
    print(f"{len(found)} (trace, prefix) pairs of {a.cases} traces where no online placement is within the best "
          f"baseline on both; largest: {worst}")


if __name__ == "__main__":
    main()
