"""Where a remote 32 x 512 KiB batch's time goes, phase by phase, for two builds of the
pool client in the same run (pairs interleaved), each against a plaintext store node on a
second network-namespace host (needs root: tests/netns_helpers.py).

The client's backend is watched from outside (its transfer engine and node links are
wrapped; nothing in the package changes), so one script times any build:

- put: ``reserve`` (start -> the Reserve answered; 0 for a put into spare slots, which
  sends its Bind beside its writes and waits for no answer first), ``submit`` (-> the transfer batch
  submitted: the requests built and handed over), ``transfer`` (-> the engine's batch
  ended, its own clock), ``wake`` (-> the waiting Python thread has the result),
  ``commit`` (-> the Commit answered; a build whose node publishes each object as its last
  byte lands sends none, and this is only the put's return), ``total``, and the CPU time of the thread that
  called (``time.thread_time_ns``: its Python and what it runs in Rust, not the engine's
  threads; unlike the phases, a busy host's preemption does not move it);
- get: ``lookup``, ``submit``, ``transfer``, ``wake``, ``total`` (the Release is posted,
  not waited for);
- beside each, our transfer engine's own batch of the same bytes to a plain engine on the
  node's host (pool_bench_roles.py ``te-server``), timed in the same rounds.

    python benches/pool_remote_split.py --builds OTHER_CHECKOUT,. [--pairs 4] [--rounds 12]

Each build is a checkout with its extension built (``python/mooncake_rs/_core*.so``);
each build's client talks to a node of its own that runs the same build (node-side
changes are compared too);
medians in microseconds per phase, per build, and build-2 / build-1 ratios per pair.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
KiB = 1 << 10
SIZE, COUNT = 512 * KiB, 32


class Clock:
    """Timestamps (perf_counter_ns) of the phases of the batch being timed."""

    def __init__(self) -> None:
        self.marks: dict[str, int] = {}
        self.cpu: dict[str, int] = {}  # the calling thread's CPU time at each of its own marks

    def mark(self, name: str, ns: int | None = None) -> None:
        if name not in self.marks:
            self.marks[name] = time.perf_counter_ns() if ns is None else ns
            if ns is None:
                self.cpu[name] = time.thread_time_ns()


def client(args: dict) -> None:
    """Runs inside host 0 with one build on PYTHONPATH; prints the phase lists as JSON."""
    import numpy as np

    from mooncake_rs.pool.client import DistributedStore
    from mooncake_rs.pool.links import NodeLink
    from mooncake_rs.pool.protocol import Commit

    clock = Clock()
    mono_to_perf = time.perf_counter_ns() - time.monotonic_ns()  # engine clocks are monotonic ns

    class WatchedBatch:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def wait(self, *a: object, **kw: object) -> object:
            out = self.inner.wait(*a, **kw)  # type: ignore[attr-defined]
            clock.mark("waited")
            b = getattr(self.inner, "batch", self.inner)  # an ObjectBatch holds its Batch
            if b is not None and b.finished_ns is not None:
                clock.mark("ended", b.finished_ns + mono_to_perf)
            return out

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    class WatchedEngine:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def _submitted(self, b: object) -> WatchedBatch:
            clock.mark("submitted")
            return WatchedBatch(b)

        def submit(self, *a: object, **kw: object) -> WatchedBatch:
            return self._submitted(self.inner.submit(*a, **kw))  # type: ignore[attr-defined]

        def submit_objects(self, *a: object, **kw: object) -> WatchedBatch:
            return self._submitted(self.inner.submit_objects(*a, **kw))  # type: ignore[attr-defined]

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    send = NodeLink.submit

    def submit_watched(self: NodeLink, make: type, **fields: object) -> object:
        if make is Commit:
            clock.mark("commit_sent")
        return send(self, make, **fields)

    NodeLink.submit = submit_watched  # type: ignore[method-assign]
    s = DistributedStore.connect(args["etcd"], prefix=args["prefix"], plaintext=True, transports=("tcp",))
    backend = s._backend
    backend.te = WatchedEngine(backend.te)
    links_answer = backend.nodes.answer

    def answer_watched(node: str, asked: object) -> object:
        rep = links_answer(node, asked)
        clock.mark("answered")
        return rep

    backend.nodes.answer = answer_watched
    from mooncake_rs import TransferEngine, TransferRequest

    te = TransferEngine("split-te", listen="", transports=["tcp"])
    te_peer = te.connect("srv", args["te_address"])
    vals = np.random.default_rng(1).integers(0, 256, (COUNT, SIZE), dtype=np.uint8)
    te_local = te.register(vals)
    te_rows: dict[str, list[float]] = {"write": [], "read": []}

    def te_batch(op: str) -> float:
        """Our engine's own batch of the same bytes to a plain engine on the node's host."""
        reqs = [TransferRequest(op, te_local, i * SIZE, te_peer, args["te_region"], i * SIZE, SIZE)
                for i in range(COUNT)]
        time.sleep(0.02)
        t = time.perf_counter_ns()
        assert all(st.ok for st in te.submit(reqs, timeout_s=60).wait())
        return (time.perf_counter_ns() - t) / 1e3

    dst = np.zeros_like(vals)
    s.register_buffer(vals.ctypes.data, vals.nbytes)
    s.register_buffer(dst.ctypes.data, dst.nbytes)
    ptrs, dptrs = [[vals[i].ctypes.data] for i in range(COUNT)], [[dst[i].ctypes.data] for i in range(COUNT)]
    put = {k: [] for k in ("reserve", "submit", "transfer", "wake", "commit", "total", "calling thread's CPU")}
    get = {k: [] for k in ("lookup", "submit", "transfer", "wake", "total", "calling thread's CPU")}

    def span(a: str, b: str) -> float:
        return (clock.marks[b] - clock.marks[a]) / 1e3

    def cpu_of(a: str, b: str) -> float:
        return (clock.cpu[b] - clock.cpu[a]) / 1e3

    cpu_phases = {"cpu: to the answer": ("start", "answered"), "cpu: submit": ("answered", "submitted"),
                  "cpu: wait": ("submitted", "waited"), "cpu: after": ("waited", "end")}
    for k in cpu_phases:
        put[k], get[k] = [], []

    for r in range(args["rounds"] + 2):  # the first two warm the links up
        keys = [f"split-{r}-{i}" for i in range(COUNT)]
        time.sleep(0.02)
        clock.marks = {}
        clock.mark("start")
        cpu = time.thread_time_ns()
        rc = s.batch_put_from(keys, ptrs, [[SIZE]] * COUNT)
        cpu = time.thread_time_ns() - cpu
        clock.mark("end")
        assert all(x == 0 for x in rc), rc
        if r >= 2:
            m = clock.marks
            if "answered" not in m:  # (a put into spare slots waits for no Reserve)
                m["answered"], clock.cpu["answered"] = m["start"], clock.cpu["start"]
            for k, (a, b) in {"reserve": ("start", "answered"), "submit": ("answered", "submitted"),
                              "transfer": ("submitted", "ended"), "wake": ("ended", "waited"),
                              "commit": ("waited", "end"), "total": ("start", "end")}.items():
                put[k].append(span(a, b))
            put["calling thread's CPU"].append(cpu / 1e3)
            for k, (a, b) in cpu_phases.items():
                put[k].append(cpu_of(a, b))
            assert m.get("commit_sent", m["waited"]) >= m["waited"]  # (no Commit: published on landing)
        time.sleep(0.02)
        dst[:] = 0
        clock.marks = {}
        clock.mark("start")
        cpu = time.thread_time_ns()
        got = s.batch_get_into(keys, dptrs, [[SIZE]] * COUNT)
        cpu = time.thread_time_ns() - cpu
        clock.mark("end")
        assert all(x == SIZE for x in got) and (dst == vals).all()
        if r >= 2:
            for k, (a, b) in {"lookup": ("start", "answered"), "submit": ("answered", "submitted"),
                              "transfer": ("submitted", "ended"), "wake": ("ended", "waited"),
                              "total": ("start", "end")}.items():
                get[k].append(span(a, b))
            get["calling thread's CPU"].append(cpu / 1e3)
            for k, (a, b) in cpu_phases.items():
                get[k].append(cpu_of(a, b))
        if r >= 2:
            te_rows["write"].append(te_batch("write"))
            te_rows["read"].append(te_batch("read"))
        s.remove_all()
    s.close()
    te.close()
    put["our engine's batch, same bytes"] = te_rows["write"]
    get["our engine's batch, same bytes"] = te_rows["read"]
    print(json.dumps({"put": {k: statistics.median(v) for k, v in put.items()},
                      "get": {k: statistics.median(v) for k, v in get.items()}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--builds", required=True, help="two checkouts, comma-separated (A,B)")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=12)
    a = ap.parse_args()
    builds = [str(Path(b).resolve()) for b in a.builds.split(",")]
    from etcd_helpers import EtcdServer, etcd_binary
    from netns_helpers import TestHosts
    from pool_helpers import start_node

    runs: list[list[dict]] = [[], []]
    with tempfile.TemporaryDirectory() as tmp, TestHosts(2) as hosts:
        etcd = EtcdServer(etcd_binary(), Path(tmp) / "etcd", host=hosts.gateway)
        etcd.start()
        try:
            # one node per build, running that build: a node's Reserve / Commit / Lookup
            # handling is part of what the two builds compare
            nodes = []
            for i, build in enumerate(builds):
                def popen(argv: list[str], build: str = build, **kw: object) -> subprocess.Popen:
                    kw["env"] = dict(kw["env"], PYTHONPATH=str(Path(build) / "python"))  # type: ignore[arg-type]
                    return hosts.popen(1, argv, **kw)

                nodes.append(start_node(popen, etcd.url, hosts.ip(1), 7650 + i, f"split{i}", f"split{i}",
                                        dram="1GB", extra=("--plaintext",))[0])
            ts = hosts.popen(1, [sys.executable, str(HERE / "pool_bench_roles.py"), "te-server",
                                 json.dumps({"host": hosts.ip(1), "token": None})],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, MOONCAKE_LOG="error", PYTHONPATH=str(ROOT / "python")))
            te_info = json.loads(ts.stdout.readline())
            for pair in range(a.pairs):
                for i, build in enumerate(builds):
                    env = dict(os.environ, MOONCAKE_LOG="warn", PYTHONPATH=str(Path(build) / "python"))
                    arg = json.dumps({"etcd": etcd.url, "prefix": f"/mooncake/split{i}", "rounds": a.rounds,
                                      "te_address": te_info["address"], "te_region": te_info["region"]})
                    r = subprocess.run(["ip", "netns", "exec", hosts.names[0], sys.executable, __file__, "client", arg],
                                       capture_output=True, text=True, env=env, timeout=300)
                    if r.returncode != 0:
                        raise RuntimeError(f"client of {build} failed:\n{r.stderr[-3000:]}")
                    runs[i].append(json.loads(r.stdout.strip().splitlines()[-1]))
                    print(f"pair {pair + 1} build {i + 1}: put total {runs[i][-1]['put']['total']:.0f} us, "
                          f"get total {runs[i][-1]['get']['total']:.0f} us, load {os.getloadavg()[0]:.1f}",
                          file=sys.stderr)
            for node in nodes:
                node.terminate()
                node.wait(10)
            ts.stdin.close()
            ts.wait(10)
        finally:
            etcd.stop()
    for op in ("put", "get"):
        print(f"\n{op} 32 x 512 KiB, median over pairs of each run's median (us); B/A: median of per-pair ratios")
        print("| phase | A | B | B / A |\n|---|---|---|---|")
        for k in runs[0][0][op]:
            va, vb = [r[op][k] for r in runs[0]], [r[op][k] for r in runs[1]]
            ratio = statistics.median(b / x for x, b in zip(va, vb) if x > 0)
            print(f"| {k} | {statistics.median(va):.0f} | {statistics.median(vb):.0f} | {ratio:.2f}x |")
    print("\npool / our engine (throughput: the engine's batch time over the pool's total), per pair")
    print("| row | A | B |\n|---|---|---|")
    for op in ("put", "get"):
        cells = []
        for i in range(2):
            per = [r[op]["our engine's batch, same bytes"] / r[op]["total"] for r in runs[i]]
            cells.append(f"**{statistics.median(per):.2f}x** ({', '.join(f'{x:.2f}' for x in per)})")
        print(f"| {op} 32 x 512 KiB | {cells[0]} | {cells[1]} |")
    print(f"\nA = {builds[0]}\nB = {builds[1]}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "client":
        client(json.loads(sys.argv[2]))
    else:
        main()
