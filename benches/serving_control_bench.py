"""Router CPU per request and control messages per request of a serving Cluster.

End to end (default): runs the tiny model (CPU) in a 1 prefill + 1 decode cluster,
in-process and/or with worker processes, serves ``--requests`` distinct prompts per
round (all submitted at once through ``generate``) and reads the router thread's CPU
clock (``time.pthread_getcpuclockid``) around each round: router CPU per request is
its CPU time over the round divided by the requests. Prints the median over
``--rounds``, and the control messages per request when the cluster counts them
(``message_counts``). On a shared machine this figure swings with the load (other
threads of the process compete for the GIL while the router runs).

``--isolated``: the router alone, in this thread, fed the exact message sequence one
request produces (a real Conductor; the instances are fakes whose links only encode
what they are sent, as a worker's socket would): the router's own CPU per request,
far less noisy. It runs the old router (before the redesign, dict messages) or the new
one, whichever ``mooncake_rs`` is importable; compare the two by running it against
an export of the old commit, or both in one process with ``--old-src`` (the old
``serving`` package is loaded beside this one; requests alternate old / new, so both
see the same noise):

    python benches/serving_control_bench.py --requests 64 --rounds 5 --max-tokens 4 --mode both
    git archive 51be5db python | tar -x -C "$OLD"
    python benches/serving_control_bench.py --isolated --old-src "$OLD/python" --requests 2000 --rounds 9
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


def _conductor():
    from mooncake_rs import Conductor, ConductorConfig

    c = Conductor(ConductorConfig(block_size=16))
    c.add_prefill(0)
    c.add_decode(1)
    return c


class _Sink:
    """An instance link that encodes what it is sent (``encode``) and drops it."""

    def __init__(self, encode):
        self.encode = encode
        self.sent = 0

    def to_instance(self, msg) -> None:
        self.encode(msg)
        self.sent += 1


def isolated_old(requests: int, max_tokens: int, encode: bool, pkg: str = "mooncake_rs.serving"):  # noqa: ANN201
    """The pre-redesign router (dict messages, ``Router(cluster)``), from package ``pkg``."""
    import importlib
    import pickle
    import queue

    C = importlib.import_module(pkg + ".cluster")
    R = importlib.import_module(pkg + ".router")
    RequestHandle = importlib.import_module(pkg + ".handle").RequestHandle
    ClusterMetrics = importlib.import_module(pkg + ".metrics").ClusterMetrics

    class Member:
        def __init__(self):
            self.alive, self.proc = True, None
            self.ch = _Sink((lambda m: pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)) if encode else (lambda m: m))

    class FakeCluster:
        block_size, prefix_reuse, _closed = 16, True, False

        def __init__(self):
            self._events, self._lock, self._reqs = queue.Queue(), threading.Lock(), {}
            self._members = {0: Member(), 1: Member()}
            self.metrics, self.conductor = ClusterMetrics(), _conductor()

        def _now(self):
            return time.monotonic()

    fc = FakeCluster()
    router = R.Router(fc)
    ep = {"name": "decode-0", "address": "", "region": 1}
    rng = random.Random(0)

    def one(rid: int) -> float:
        prompt = [rng.randrange(256) for _ in range(50)]
        keys = [rng.getrandbits(128) for _ in range(3)]
        d = fc.conductor.schedule(rid, keys, len(prompt), fc._now())
        req = C._Req(rid, prompt, None, keys, d, RequestHandle(rid, prompt), time.monotonic())
        with fc._lock:
            fc._reqs[rid] = req
        msgs = [(-1, {"op": "new", "rid": rid}),
                (1, {"op": "expected", "rid": rid, "arena": ep, "blocks": [4096 * i for i in range(3)],
                     "partial": 16384}),
                (0, {"op": "prefill_started", "rid": rid}),
                (0, {"op": "prefilled", "rid": rid, "first": 5, "finish": "prefill", "reused_blocks": 0,
                     "fetched_blocks": 0, "bytes": 65536, "t_start": 0.0, "t_compute": 0.1, "t_ready": 0.2}),
                (1, {"op": "decode_started", "rid": rid, "t": 0.3})]
        msgs += [(1, {"op": "tokens", "rid": rid, "tokens": [7], "finish": "length" if i == max_tokens - 2 else None,
                      "t": 0.4}) for i in range(max_tokens - 1)]
        msgs.append((0, {"op": "store", "events": [("stored", k, "dram") for k in keys]}))
        t0 = time.thread_time()
        for inst, m in msgs:
            fc._events.put((inst, m))
            router.handle(*fc._events.get())
        return time.thread_time() - t0

    return one


def isolated_new(requests: int, max_tokens: int, encode: bool):  # noqa: ANN201 - the redesigned router
    from mooncake_rs.base.outputs import RequestOutput
    from mooncake_rs.base.params import SamplingParams
    from mooncake_rs.serving import protocol as P
    from mooncake_rs.client.handle import RequestHandle
    from mooncake_rs.serving.lifecycle import Plan
    from mooncake_rs.serving.metrics import ClusterMetrics
    from mooncake_rs.serving.router import New, RequestRecord, Router

    codec = P.Codec()

    class Port:
        prefix_reuse, block_size = True, 16

        def __init__(self):
            self.metrics, self.conductor = ClusterMetrics(), _conductor()
            self.sink = _Sink(codec.encode if encode else (lambda m: m))

        def send(self, inst, msg):
            self.sink.to_instance(msg)

        def output(self, record, reason):  # what Cluster's port does (the old router built the same)
            m = record.metrics
            return RequestOutput(str(record.plan.rid), record.plan.prompt, record.tokens, reason, [],
                                 m.reused_tokens, 0, m)

        def now(self):
            return time.monotonic()

    port = Port()
    router = Router(port, {0: "prefill-0", 1: "decode-0"})
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens)
    report = P.PrefillReport(0, 0, 65536, 0.0, 0.1, 0.2)

    def one(rid: int) -> float:
        prompt = [rng.randrange(256) for _ in range(50)]
        keys = [rng.getrandbits(128) for _ in range(3)]
        d = port.conductor.schedule(rid, keys, len(prompt), port.now())
        rec = RequestRecord(Plan(rid, prompt, params, P.pack_keys(keys), d.prefill, d.decode), RequestHandle(rid, prompt),
                            time.monotonic())
        msgs = [(-1, New(rec)), (1, P.Tokens(rid, [5], None, report))]
        msgs += [(1, P.Tokens(rid, [7], "length" if i == max_tokens - 2 else None)) for i in range(max_tokens - 1)]
        # the store's own event bytes (MCE1: kind 0 = stored, tier 0 = dram, then the key)
        msgs.append((0, P.StoreEvents(b"MCE1" + b"".join(b"\0\0" + k.to_bytes(16, "little") for k in keys))))
        t0 = time.thread_time()
        for inst, m in msgs:
            router.events.put((inst, m))
            router.handle(*router.events.get())
        return time.thread_time() - t0

    return one


def isolated(requests: int, rounds: int, max_tokens: int) -> None:
    from mooncake_rs.serving import router as R

    new = hasattr(R, "RequestRecord")
    for encode in (False, True):
        make = isolated_new if new else isolated_old
        one = make(requests, max_tokens, encode)
        for rid in range(1, 200):  # warm up (first RequestOutput import, conductor)
            one(rid)
        per = []
        rid = 1000
        for _ in range(rounds):
            total = 0.0
            for _ in range(requests):
                rid += 1
                total += one(rid)
            per.append(total / requests)
        label = f"{'new' if new else 'old'} router, {'encoding (processes=True)' if encode else 'in-process'}"
        print(f"{label}: router_cpu_us_per_request median {statistics.median(per) * 1e6:.1f} "
              f"(min {min(per) * 1e6:.1f}, max {max(per) * 1e6:.1f}, {rounds} rounds of {requests})", flush=True)


def load_reference(old_src: str) -> str:
    """Loads the ``serving`` package of an older checkout (``old_src``: its ``python``
    directory) as ``mooncake_rs._serving_ref``, beside this one, sharing this
    ``mooncake_rs`` (its ``_core``, errors, engine): both routers in one process."""
    import importlib.util
    import os
    import sys

    name = "mooncake_rs._serving_ref"
    path = os.path.join(old_src, "mooncake_rs", "serving")
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return name


def side_by_side(old_src: str, requests: int, rounds: int, max_tokens: int) -> None:
    """Old and new router in one process, rounds interleaved: per-round ratios."""
    pkg = load_reference(old_src)
    for encode in (False, True):
        old, new = isolated_old(requests, max_tokens, encode, pkg), isolated_new(requests, max_tokens, encode)
        for rid in range(1, 200):
            old(rid)
            new(rid)
        rid, pairs = 1000, []
        for _ in range(rounds):
            t_old = t_new = 0.0
            for _ in range(requests):  # alternate request by request: the same noise for both
                rid += 1
                t_old += old(rid)
                t_new += new(rid)
            pairs.append((t_old / requests, t_new / requests))
        o = statistics.median(p[0] for p in pairs)
        n = statistics.median(p[1] for p in pairs)
        r = statistics.median(p[1] / p[0] for p in pairs)
        label = "encoding (processes=True)" if encode else "in-process"
        print(f"{label}: old {o * 1e6:.1f} us, new {n * 1e6:.1f} us per request (medians of {rounds} rounds of "
              f"{requests}); new/old median of per-round ratios {r:.2f} "
              f"(range {min(p[1] / p[0] for p in pairs):.2f}-{max(p[1] / p[0] for p in pairs):.2f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--mode", choices=["inproc", "processes", "both"], default="both")
    ap.add_argument("--isolated", action="store_true", help="the router alone, fed one request's messages")
    ap.add_argument("--old-src", help="with --isolated: an older checkout's python/ dir, run side by side")
    a = ap.parse_args()
    if a.isolated and a.old_src:
        side_by_side(a.old_src, a.requests, a.rounds, a.max_tokens)
        return
    if a.isolated:
        isolated(a.requests, a.rounds, a.max_tokens)
        return
    modes = {"inproc": [False], "processes": [True], "both": [False, True]}[a.mode]
    for processes in modes:
        r = run(processes, a.requests, a.rounds, a.max_tokens)
        label = "processes=True " if processes else "processes=False"
        print(f"{label}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
