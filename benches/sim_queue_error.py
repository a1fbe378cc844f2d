"""Issue 25: how wrong is the conductor's queue estimate in the link-model simulator,
and which term is wrong?

For every request the conductor predicts when its prefill will start:
``admit + est_queue_s`` (the estimated work of the requests queued ahead on its prefill
instance, plus what is left of the running one). The simulator records when it really
started (its dequeue: the queue ahead has drained for it). An instance is never idle
while a request is queued, and a request ahead holds it only while it computes (and
loads its own tiers, and waits out a transfer's setup latency): one waiting for its
fetch is set aside and does not hold it. So the difference is the sum, over the
requests ahead, of how much longer each one held the instance before this one's
dequeue than its estimate (its ``work_s``: ``est_prefill_s`` for every policy but
``ttft_optimal``, which adds own-tier loads this split does not price). This script
splits that per request ahead into:

- ``load``: the time it held the instance beyond its compute (own-tier loads, a
  transfer's setup latency);
- ``compute``: its compute against ``est_prefill_s`` (a different reuse than planned:
  blocks evicted, a fetch fallen back or abandoned, or a prefix another queued request
  left);
- ``aside``: minus the estimate of a request ahead that was still set aside for its
  fetch when this one started (it computed later, after it);
- ``running``: the running request's real remaining time against the estimate's
  ``max(est - elapsed, 0)`` (a request that overruns its estimate counts as done).

and prints the totals (seconds of start error summed over requests) and the worst
requests. Runs one case (the strict xfail of tests/test_sim_contention.py by default)
or one cell of benches/sim_contention.py.

    python benches/sim_queue_error.py                      # the xfail case, mooncake
    python benches/sim_queue_error.py --cell agentic-2 --pd 8 --gbps 25 [--n 2000]
    python benches/sim_queue_error.py --policy local_cache_aware ...
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

from mooncake_rs import sim
from mooncake_rs.sim import linked


class _Recorder(linked._LinkedRun):
    """The linked run, recording each request's decision and its real timeline."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.rec: dict[int, dict] = {}
        #: every flow: id -> [start, end, links, bytes, kind, request]
        self.flows: dict[int, list] = {}
        pop = self.net.pop_done

        def pop_done(t):
            done = pop(t)
            for f in done:
                self.flows[f.id][1] = t
            return done

        self.net.pop_done = pop_done

    def flow(self, t, links, nbytes, kind, i):
        f = super().flow(t, links, nbytes, kind, i)
        self.flows[f.id] = [t, math.inf, tuple(links), float(nbytes), kind, i]
        return f

    def schedule_or_reject(self, i, t):
        d = super().schedule_or_reject(i, t)
        if d is not None:
            self.rec[i] = dict(p=d.prefill, admit=t, q=d.est_queue_s, tr=d.est_transfer_s, pf=d.est_prefill_s,
                               planned=d.reused_blocks, fetch=d.fetch_blocks, src=d.fetch_from)
        return d

    def tick(self) -> int:
        self._tick = getattr(self, "_tick", 0) + 1
        return self._tick

    def dequeue(self, p, i, t):
        self.s.start[i] = None
        super().dequeue(p, i, t)
        if self.s.start[i] is not None:  # not waiting for the request it builds on
            self.rec[i].update(start=t, start_seq=self.tick())

    def join(self, p, i, t):
        self.rec[i].update(join=t, join_seq=self.tick())
        super().join(p, i, t)

    def compute(self, p, i, t, delay=0.0):
        super().compute(p, i, t, delay)
        r = self.rec[i]
        r["cstart"] = t + delay
        L = self.trace[i].input_length
        r["c"] = self.pm.predict(L, min(self.s.reused[i] * self.cfg.block_tokens, L))
        r["reused"] = self.s.reused[i]

    def prefill_done(self, p, i, t):
        self.rec[i]["end"] = t
        super().prefill_done(p, i, t)


def start_errors(rec: dict[int, dict]) -> list[tuple[int, float, dict[str, float]]]:
    """Per request: (request, real - predicted start, that error split by the requests
    ahead of it: ``running``, ``load``, ``compute``, ``aside``, and ``idle_or_other``
    for what those do not explain, 0 while the instance is never idle with a request
    queued)."""
    by_inst: dict[int, list[int]] = defaultdict(list)
    for i in sorted(rec, key=lambda i: rec[i]["admit"]):
        by_inst[rec[i]["p"]].append(i)
    for r in rec.values():
        r["load_err"] = (r["cstart"] - r["start"]) - r["tr"]  # its own wait for its loads, against the price
        r["hold"] = r["end"] - r["join"]
        r["comp_err"] = r["c"] - r["pf"]
    rows = []
    for ids in by_inst.values():
        for k, i in enumerate(ids):
            r = rec[i]
            a = r["admit"]
            err = r["start"] - (a + r["q"])
            parts = {"running": 0.0, "load": 0.0, "compute": 0.0, "aside": 0.0}
            for j in ids[:k]:
                o = rec[j]
                if o["end"] <= a:
                    continue
                if o["join"] <= a:  # computing at admission (the conductor heard it start at its join)
                    parts["running"] += (o["end"] - a) - max(o["pf"] - (a - o["join"]), 0.0)
                elif o["join_seq"] < r["start_seq"]:  # queued ahead, took the instance before this one's dequeue
                    parts["load"] += o["hold"] - o["c"]
                    parts["compute"] += o["comp_err"]
                else:  # set aside when this one started: it computed after it
                    parts["aside"] -= o["pf"]
            parts["idle_or_other"] = err - sum(parts.values())
            rows.append((i, err, parts))
    return rows


def analyse(rec: dict[int, dict], top: int) -> None:
    rows = start_errors(rec)
    n = len(rec)
    tot: dict[str, float] = defaultdict(float)
    for _, err, parts in rows:
        tot["start_err"] += err
        tot["start_err_pos"] += max(err, 0.0)
        for kk, v in parts.items():
            tot[kk] += v
    print(f"{n} requests; mean predicted queue {sum(r['q'] for r in rec.values()) / n:.3f} s, "
          f"mean real wait {sum(r['start'] - r['admit'] for r in rec.values()) / n:.3f} s")
    print(f"start error summed over requests (real - predicted start): {tot['start_err']:.2f} s "
          f"(positive part {tot['start_err_pos']:.2f})")
    for kk in ("running", "load", "compute", "aside", "idle_or_other"):
        print(f"  from {kk:14s} {tot[kk]:9.2f} s")
    causes: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for r in rec.values():
        if r["fetch"] and r["reused"] < r["planned"]:
            c = "fetch abandoned/fell back"
        elif r["reused"] < r["planned"]:
            c = "less reuse than planned"
        elif r["reused"] > r["planned"]:
            c = "more reuse than planned"
        elif r["fetch"]:
            c = "fetch as planned"
        else:
            c = "local as planned"
        causes[c][0] += 1
        causes[c][1] += r["load_err"] + r["comp_err"]
    print("each request's own work (real - estimated), by what it found when it started:")
    for c, (k, s) in sorted(causes.items()):
        print(f"  {c:28s} {k:5d} requests, work error {s:+9.2f} s")
    rows.sort(key=lambda x: -x[1])
    for i, err, parts in rows[:top]:
        r = rec[i]
        print(f"  req {i:5d} inst {r['p']} admit {r['admit']:.2f} q {r['q']:.3f} start err {err:+.3f} "
              + " ".join(f"{k}={v:+.3f}" for k, v in parts.items() if abs(v) > 1e-9))


def fetches(run: _Recorder) -> None:
    """Per fetch: its price against its real time, and the flows that shared the
    holder's NIC out with it (which of them the conductor knew of when it priced it)."""
    rec, tm = run.rec, run.tm
    kinds = {linked._LOAD: "fetch", linked._STREAM: "stream", linked._REPL: "replica", linked._WRITE: "write"}
    for i, r in sorted(rec.items()):
        if not r["fetch"] or r["src"] is None:
            continue
        bt = run.cfg.block_tokens
        L = run.trace[i].input_length
        tokens = min(r["planned"] * bt, L) - min((r["planned"] - r["fetch"]) * bt, L)
        idle = tm.fetch(tokens, 0.0)
        print(f"fetch of req {i} -> inst {r['p']} from {r['src']}: {r['fetch']} blocks, admitted {r['admit']:.3f}, "
              f"planned start {r['admit'] + r['q']:.3f} real {r['start']:.3f}; priced {r['tr']:.3f} s "
              f"(idle {idle:.3f}, wait {r['tr'] - idle:.3f}), real {r['cstart'] - r['start']:.3f} s")
        s0, s1 = r["start"], r["cstart"]
        for fid, (a, b, links, nb, kind, j) in sorted(run.flows.items(), key=lambda x: x[1][0]):
            if 3 * r["src"] not in links or b <= s0 or a >= s1 or (kind == linked._LOAD and j == i):
                continue
            o = rec.get(j) if kind in (linked._LOAD, linked._STREAM) else None
            known = o is not None and o["admit"] <= r["admit"]
            plan = ""
            if o is not None and kind == linked._STREAM:
                plan = f" planned stream start {o['admit'] + o['q'] + o['tr']:.3f}"
            elif o is not None:
                plan = f" planned start {o['admit'] + o['q']:.3f}"
            print(f"    {kinds.get(kind, kind)} of {j} {nb / 1e9:.2f} GB {a:.3f}-{b:.3f}"
                  f" ({'known' if known else 'admitted later'}{plan})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", help="agentic-S (a cell of benches/sim_contention.py); default: the xfail case")
    ap.add_argument("--pd", type=int, default=8)
    ap.add_argument("--gbps", type=float, default=25.0)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--policy", default="mooncake")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    if a.cell:
        tr = sim.generate_trace(a.n, kind="agentic", seed=int(a.cell.split("-")[1]))
        P = D = a.pd
        nic = a.gbps * 1e9
    else:  # tests/test_sim_contention.py::test_overloaded_agentic_late_fetch_case
        tr = sim.generate_trace(59, kind="agentic", seed=504471, rate=5.0)
        P, D, nic = 3, 3, 24322206782.8
    # the fetch at dequeue: the split below does not model a prefetch overlapping the queue
    cfg = sim.SimConfig(prefill=P, decode=D, policy=a.policy, nic_bandwidth=nic, ttft_slo_s=1e9, tbt_slo_s=1e9,
                        prefetch_staging_bytes=0.0)
    run = _Recorder(cfg, tr, None)
    rep = run.go()
    tt = [r.ttft_s for r in rep.requests]
    print(f"{a.policy}: mean TTFT {sum(tt) / len(tt):.4f} s, fetches {rep.counters['fetches']}, "
          f"abandoned {rep.counters['fetch_abandoned']}")
    analyse(run.rec, a.top)
    fetches(run)
    assert all(math.isfinite(r["end"]) for r in run.rec.values())


if __name__ == "__main__":
    main()
