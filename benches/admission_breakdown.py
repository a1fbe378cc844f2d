"""Where does an admitted request's TTFT go under overload? (issue 26, item 9)

    python benches/admission_breakdown.py --rate 600 --seconds 10

The cluster of ``admission_bench.py`` (2 prefill + 1 decode in one process, tiny preset,
``rejection="early"``, TTFT SLO 50 ms) under open-loop Poisson arrivals at ``--rate``.
Each admitted request's first token is split into the hops it takes, from timestamps
taken in this process (one clock):

- ``schedule``: the submitting thread's ``submit`` call (hashing, the conductor);
- ``router``: submit returned -> the router thread takes the request (its queue);
- ``to_prefill``: router -> decode instance (``Expect``) -> prefill instance (``Prefill``);
- ``prefill``: the prefill instance has it -> its engine step computed it (queue + step);
- ``kv``: computed -> its KV written to decode;
- ``back``: KV written -> the first token reaches the caller (prefill -> decode ->
  router -> handle).

And what a refusal costs the submitting thread: wall and CPU time of a ``submit`` that
raised ``Overloaded`` (the CPU time is GIL time the instances and the router wait for).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import threading
import time

from mooncake_rs import Cluster
from mooncake_rs.errors import Overloaded
from mooncake_rs.serving import decode as decode_mod
from mooncake_rs.serving import prefill as prefill_mod
from mooncake_rs.serving import router as router_mod

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from admission_bench import PARAMS, TBT_SLO, TTFT_SLO, prompt, q  # noqa: E402

STAMPS: dict[tuple[str, int], float] = {}
_lock = threading.Lock()


def _stamp(name: str, rid: int) -> None:
    STAMPS[(name, rid)] = time.monotonic()


def _patch() -> None:
    """Timestamps at each hop (wrappers around the real methods, nothing else changed)."""
    handle = router_mod.Router.handle

    def router_handle(self, src, ev):  # type: ignore[no-untyped-def]
        if isinstance(ev, router_mod.New):
            _stamp("router", ev.record.plan.rid)
        return handle(self, src, ev)

    router_mod.Router.handle = router_handle  # type: ignore[method-assign]
    expect = decode_mod.DecodeRole._expect

    def decode_expect(self, msg):  # type: ignore[no-untyped-def]
        _stamp("expect", msg.rid)
        return expect(self, msg)

    decode_mod.DecodeRole._expect = decode_expect  # type: ignore[method-assign]
    deliver = router_mod.Router._deliver

    def router_deliver(self, rid, tokens, report):  # type: ignore[no-untyped-def]
        if report is not None:
            STAMPS[("report", rid)] = report  # type: ignore[assignment]
        return deliver(self, rid, tokens, report)

    router_mod.Router._deliver = router_deliver  # type: ignore[method-assign]
    _ = prefill_mod  # (the prefill's own stamps travel in its report: t_start, t_compute, t_ready)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=600.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rejection", default="early")
    ap.add_argument("--switch-s", type=float, default=None, help="sys.setswitchinterval for this process")
    args = ap.parse_args(argv)
    if args.switch_s is not None:
        sys.setswitchinterval(args.switch_s)
    _patch()
    c = Cluster("tiny", prefill=2, decode=1, block_size=16, rejection=args.rejection, ttft_slo_s=TTFT_SLO,
                tbt_slo_s=TBT_SLO, seed=0)
    if args.rejection != "none":
        c.calibrate(repeats=1)
    rng = random.Random(1)
    trace: list[tuple[float, float, float]] = []  # (t, work scale, floor) every 0.5 s
    t_start = time.monotonic()

    def watch() -> None:
        while time.monotonic() < t_start + args.seconds:
            now = c._core.now()
            trace.append((time.monotonic() - t_start, c.conductor.calibration_scales(now)[0],
                          c.conductor.calibration_floor(now)))
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    admitted: list[tuple[int, float, float, object]] = []
    refusal_wall: list[float] = []
    refusal_cpu: list[float] = []
    admit_wall: list[float] = []
    t_end = time.monotonic() + args.seconds
    nxt = time.monotonic()
    while nxt < t_end:
        now = time.monotonic()
        if now < nxt:
            time.sleep(nxt - now)
        p = prompt(rng)
        t0, c0 = time.monotonic(), time.thread_time()
        try:
            h = c.submit(p, PARAMS)
            t1 = time.monotonic()
            admit_wall.append(t1 - t0)
            admitted.append((h.request_id, t0, t1, h))
        except Overloaded:
            refusal_wall.append(time.monotonic() - t0)
            refusal_cpu.append(time.thread_time() - c0)
        nxt += rng.expovariate(args.rate)
    hops: dict[str, list[float]] = {k: [] for k in ("schedule", "router", "to_prefill", "prefill", "kv", "back",
                                                       "ttft")}
    for rid, t0, t1, h in admitted:
        out = h.result(120)  # type: ignore[attr-defined]
        rep = STAMPS.get(("report", rid))
        tr, te = STAMPS.get(("router", rid)), STAMPS.get(("expect", rid))
        if rep is None or tr is None or te is None:
            continue
        first = t1 + out.metrics.ttft_s  # the router's t_submit is taken right after schedule
        hops["schedule"].append(t1 - t0)
        hops["router"].append(tr - t1)
        hops["to_prefill"].append(rep.t_start - tr)  # type: ignore[attr-defined]
        hops["prefill"].append(rep.t_compute - rep.t_start)  # type: ignore[attr-defined]
        hops["kv"].append(rep.t_ready - rep.t_compute)  # type: ignore[attr-defined]
        hops["back"].append(first - rep.t_ready)  # type: ignore[attr-defined]
        hops["ttft"].append(first - t0)
    c.close()
    per_s: dict[int, list[float]] = {}
    for (rid, t0, _t1, _h), ttft in zip(admitted, hops["ttft"]):
        per_s.setdefault(int(t0 - t_start), []).append(ttft)
    print("second: admitted, TTFT p90 ms | work scale, floor ms (at 0.5 s steps)")
    for sec in sorted(per_s):
        tr = [f"{w:.2f},{f * 1e3:.1f}" for (t, w, f) in trace if int(t) == sec]
        print(f"  {sec}: {len(per_s[sec])}, {q(per_s[sec], .9) * 1e3:.0f} | {' '.join(tr)}")
    n_off = len(admitted) + len(refusal_wall)
    print(f"rate {args.rate:g}/s for {args.seconds:g} s, rejection={args.rejection}: offered {n_off}, "
          f"admitted {len(admitted)} ({len(admitted) / max(1, n_off):.0%})")
    print("| hop | p50 ms | p90 ms | mean ms |")
    print("| --- | --- | --- | --- |")
    for k, xs in hops.items():
        if xs:
            print(f"| {k} | {q(xs, .5) * 1e3:.2f} | {q(xs, .9) * 1e3:.2f} | {sum(xs) / len(xs) * 1e3:.2f} |")
    if refusal_wall:
        print(f"refusal: wall p50 {q(refusal_wall, .5) * 1e6:.0f} us p90 {q(refusal_wall, .9) * 1e6:.0f} us, "
              f"CPU p50 {q(refusal_cpu, .5) * 1e6:.0f} us mean {sum(refusal_cpu) / len(refusal_cpu) * 1e6:.0f} us; "
              f"{len(refusal_wall) / args.seconds:.0f}/s = {sum(refusal_cpu) / args.seconds:.1%} of one core")
    if admit_wall:
        print(f"admitted submit: wall p50 {q(admit_wall, .5) * 1e6:.0f} us")
    _ = math
    return 0


if __name__ == "__main__":
    sys.exit(main())
