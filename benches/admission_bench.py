"""Admission under overload (issue 26, item 9): do the requests admitted meet their SLOs?

    python benches/admission_bench.py                   # 2x and 4x, ~4 minutes
    python benches/admission_bench.py --seconds 10 --loads 2

The cluster ``mooncake-rs serve`` runs (2 prefill + 1 decode instances in one process,
the tiny preset, blocks of 16, TTFT SLO 0.05 s, TBT SLO 1 s, the prefill model calibrated
on the engine first as ``serve --rejection early`` does). Its capacity is measured first:
the completion rate of a closed loop of 8 clients without admission. Then, at 2x and 4x
that rate, open-loop Poisson arrivals for ``--seconds`` each, side by side in one run:

- ``none``: no admission (the reference: what the load does to latency);
- ``early``: ``rejection="early"``.

For the requests each admitted (and that did not fail): TTFT (submit to first token) and per-request TBT (the
mean interval between its tokens) at p50 / p90, the share within each SLO, and the
end-to-end p50; for the rejections: how many, their reasons, whether every estimate was
finite, and the ``Retry-After`` the HTTP front would send (p50 / max).
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import statistics
import sys
import threading
import time

from mooncake_rs import Cluster
from mooncake_rs.engine import SamplingParams
from mooncake_rs.errors import MooncakeError, Overloaded
from mooncake_rs.http.errors import from_exception

TTFT_SLO = 0.05
TBT_SLO = 1.0
PROMPT = 48
OUT = 16
PARAMS = SamplingParams(max_tokens=OUT, ignore_eos=True)


def cluster(rejection: str) -> Cluster:
    c = Cluster("tiny", prefill=2, decode=1, block_size=16, rejection=rejection, ttft_slo_s=TTFT_SLO,
                tbt_slo_s=TBT_SLO, seed=0)
    if rejection != "none":
        c.calibrate(repeats=1)
    return c


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 250) for _ in range(PROMPT)]


def capacity(seconds: float) -> float:
    """Completed requests per second of a closed loop of 8 clients, no admission."""
    c = cluster("none")
    done = [0]
    stop = time.monotonic() + seconds

    def client(i: int) -> None:
        rng = random.Random(i)
        while time.monotonic() < stop:
            c.submit(prompt(rng), PARAMS).result(120)
            done[0] += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rate = done[0] / (time.monotonic() - t0)
    c.close()
    return rate


def q(xs: list[float], p: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]


def run(rejection: str, rate: float, seconds: float, seed: int) -> dict:
    c = cluster(rejection)
    rng = random.Random(seed)
    handles: list[tuple[float, object]] = []
    reasons: collections.Counter[str] = collections.Counter()
    retry: list[float] = []
    finite = True
    t_end = time.monotonic() + seconds
    nxt = time.monotonic()
    while nxt < t_end:
        now = time.monotonic()
        if now < nxt:
            time.sleep(nxt - now)
        t_sub = time.monotonic()
        try:
            handles.append((t_sub, c.submit(prompt(rng), PARAMS)))
        except Overloaded as e:
            reasons[e.reason or "?"] += 1
            est = e.estimates
            if est is not None:
                finite &= math.isfinite(est.est_ttft_s) and math.isfinite(est.est_tbt_s)
            retry.append(float(from_exception(e).headers["Retry-After"]))
        nxt += rng.expovariate(rate)
    ttft, tbt, e2e = [], [], []
    failed = 0
    for _t_sub, h in handles:
        try:
            out = h.result(300)  # type: ignore[attr-defined]
        except MooncakeError:  # admitted, then failed (e.g. the decode store full without admission)
            failed += 1
            continue
        m = out.metrics
        ttft.append(m.ttft_s)
        iv = m.token_intervals
        tbt.append(statistics.fmean(iv) if iv else 0.0)
        e2e.append(m.ttft_s + sum(iv))
    c.close()
    n = len(ttft)
    return dict(rejection=rejection, offered=len(handles) + sum(reasons.values()), admitted=len(handles),
                failed=failed,
                rejected=sum(reasons.values()), reasons=dict(reasons), finite=finite,
                ttft_p50=q(ttft, 0.5), ttft_p90=q(ttft, 0.9), tbt_p50=q(tbt, 0.5), tbt_p90=q(tbt, 0.9),
                e2e_p50=q(e2e, 0.5), ttft_ok=sum(t <= TTFT_SLO for t in ttft) / max(1, n),
                tbt_ok=sum(t <= TBT_SLO for t in tbt) / max(1, n),
                retry_p50=q(retry, 0.5), retry_max=max(retry) if retry else math.nan)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--loads", type=float, nargs="+", default=[2.0, 4.0])
    ap.add_argument("--capacity-seconds", type=float, default=15.0)
    args = ap.parse_args(argv)
    cap = capacity(args.capacity_seconds)
    print(f"capacity (closed loop of 8, no admission): {cap:.1f} req/s; prompts of {PROMPT} tokens, {OUT} out; "
          f"TTFT SLO {TTFT_SLO}s, TBT SLO {TBT_SLO}s", flush=True)
    print("| load | admission | offered | admitted (failed) | rejected (reasons) | estimates finite | TTFT p50 / p90 | "
          "within TTFT SLO | TBT p50 / p90 | within TBT SLO | e2e p50 | Retry-After p50 / max |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for load in args.loads:
        for i, rejection in enumerate(("none", "early")):
            r = run(rejection, load * cap, args.seconds, seed=int(load * 100) + i)
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items())) or "-"
            print(f"| {load:g}x ({load * cap:.0f}/s) | {rejection} | {r['offered']} | {r['admitted']} ({r['failed']}) | "
                  f"{r['rejected']} ({reasons}) | {'yes' if r['finite'] else 'NO'} | "
                  f"{r['ttft_p50'] * 1e3:.0f} / {r['ttft_p90'] * 1e3:.0f} ms | {r['ttft_ok']:.0%} | "
                  f"{r['tbt_p50'] * 1e3:.1f} / {r['tbt_p90'] * 1e3:.1f} ms | {r['tbt_ok']:.0%} | "
                  f"{r['e2e_p50'] * 1e3:.0f} ms | {r['retry_p50']:g} / {r['retry_max']:g} s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
