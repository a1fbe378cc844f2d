"""A deployment across hosts, measured (issue 12's targets). Hosts are network namespaces
joined by veth pairs and a bridge (tests/netns_helpers.py); etcd runs on the bridge; the
workers and the ``serve`` processes are started as a user starts them
(tests/deploy_helpers.py), KV over TCP only. Needs root (CAP_NET_ADMIN) and etcd.

    python benches/deploy_bench.py                 # all three, ~3 minutes
    python benches/deploy_bench.py --only kv|latency|failover

1. kv: KV bandwidth during serving between the namespace hosts: bytes the prefill
   workers' transfer engines moved (into the decode worker) over the seconds they had a
   transfer in flight (the engines' own counts), on the wide-KV model (4 layers, 128 KiB
   layer spans, block 64) with cold 24-block prompts; against the transfer engine's own
   TCP figure between the same two kinds of host (a prefill host writing into the
   decode host) for the same request size and batch (24 requests of one layer span, or
   with ``--send-after`` the 96 of a request's whole KV),
   benches/transfer_netns_bench.py's client, rounds interleaved.
2. latency: added latency per request of the remote deployment over the embedded one:
   the same model (tiny), the same prompts, sequential, TTFT as the client sees it
   (submit to first streamed token): ``Cluster.connect`` to the namespace deployment
   vs ``Cluster(processes=True)`` in this process's namespace.
3. failover: SIGKILL the leading ``serve``, then time until the first request served by
   the standby (the client retries through etcd), ``--failovers`` times (a fresh standby
   each time), next to the lease TTL.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from deploy_helpers import Deployment, wait_until  # noqa: E402
from etcd_helpers import EtcdServer, etcd_binary  # noqa: E402
from netns_helpers import TestHosts, available  # noqa: E402
from text_helpers import write_llama_weights  # noqa: E402
from transfer_netns_bench import one  # noqa: E402

from mooncake_rs.engine import SamplingParams  # noqa: E402

P0, P1, D0, SERVE_A, SERVE_B = range(5)
LEASE_TTL = 2
WIDE = dict(vocab=256, hidden=256, inter=512, layers=4, heads=4, kv_heads=4, max_position_embeddings=8192)
SPAN = 64 * 2 * 4 * 64 * 4  # one layer of a 64-token block: K and V, 4 heads x 64 dims, float32


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def start(dep: Deployment, model: str, block: int, dram: int, serve_b: bool = True,
          extra: tuple[str, ...] = ()) -> object:
    dep.serve("serve-a", SERVE_A)
    if not dep.wait_log("serve-a", "leading", 30):
        sys.exit("serve did not lead:\n" + dep.log_tail())
    if serve_b:
        dep.serve("serve-b", SERVE_B)
    args = ["--block-size", str(block), "--dram-bytes", str(dram), *extra]
    for name, host, role in (("p0", P0, "prefill"), ("p1", P1, "prefill"), ("d0", D0, "decode")):
        dep.worker(name, host, role, model=model, extra=args)
    c = dep.client()
    if not wait_until(lambda: len(c.instances()) == 3, 120):
        sys.exit("workers did not join:\n" + dep.log_tail())
    return c


def bench_kv(hosts: TestHosts, dep: Deployment, model_dir: Path, rounds: int, sequential: bool,
             send_after: bool) -> None:
    c = start(dep, str(model_dir), 64, 256 << 20, serve_b=False,
              extra=("--no-stream-layers",) if send_after else ())
    rng = random.Random(2)
    one_tok = SamplingParams(max_tokens=1)
    for _ in range(3):  # warm-up: the first contact of each (prefill, decode) pair is not bandwidth
        c.generate([[rng.randrange(256) for _ in range(128)] for _ in range(4)], one_tok, timeout_s=120)
    names = c.instances()
    prefills = [i for i, n in names.items() if n.startswith("p")]
    serving, engine = [], []
    for r in range(rounds):
        base = c.instance_stats()
        prompts = [[rng.randrange(256) for _ in range(64 * 24)] for _ in range(8)]
        if sequential:  # one prefill computing at a time: less CPU contention on a small machine
            for p in prompts:
                c.generate([p], SamplingParams(max_tokens=2), timeout_s=300)
        else:
            c.generate(prompts, SamplingParams(max_tokens=2), timeout_s=300)
        st = c.instance_stats()
        moved = sum(st[i]["copied_bytes"] - base[i]["copied_bytes"] for i in prefills)
        busy = sum(st[i]["copy_busy_s"] - base[i]["copy_busy_s"] for i in prefills)
        serving.append(moved / busy / 1e9)
        # the reference between a prefill host (client) and the decode host (server), on
        # the same kind of link, while the deployment idles, with the batch the serving
        # path sends: one layer's 24 spans a batch, or (--send-after) a request's KV at
        # once, 24 blocks x 4 layers = 96 spans
        batch = 24 * WIDE["layers"] if send_after else 24
        ref = one(hosts, "engine", batch * SPAN * 16, "bench-token-0123456789abcdef", req=SPAN, batch=batch,
                  server=SERVE_B, client=P1)
        engine.append(ref["write"])
        print(f"  round {r}: serving {serving[-1]:.2f} GB/s ({moved / 1e6:.0f} MB in {busy:.3f} s in flight), "
              f"engine TCP {engine[-1]:.2f} GB/s", flush=True)
    s, e = med(serving), med(engine)
    print(f"== KV during serving across namespaces: {s:.2f} GB/s; the engine's TCP, same request size and batch: "
          f"{e:.2f} GB/s; ratio {s / e:.2f} (target >= 0.7); medians of {rounds} rounds")
    c.close()


def _ttft(cluster: object, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    h = cluster.submit(prompt, SamplingParams(max_tokens=4))  # type: ignore[attr-defined]
    it = iter(h)
    next(it)
    t = time.perf_counter() - t0
    for _ in it:
        pass
    return t


def bench_latency(dep: Deployment, n: int) -> None:
    from mooncake_rs import Cluster

    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(64, 512))] for _ in range(n)]
    remote = start(dep, "tiny", 16, 64 << 20, serve_b=False)
    embedded = Cluster("tiny", prefill=2, decode=1, processes=True, prefix_reuse=True)
    try:
        for c in (remote, embedded):  # warm-up
            for p in prompts[:3]:
                _ttft(c, [t ^ 1 for t in p])
        r, e = [], []
        for p in prompts:  # interleaved: the same noise for both
            r.append(_ttft(remote, p))
            e.append(_ttft(embedded, p))
    finally:
        embedded.close()
        remote.close()  # type: ignore[attr-defined]
    print(f"== TTFT p50 over {n} prompts of 64-511 tokens (tiny model, sequential, client-side): remote "
          f"{med(r) * 1e3:.1f} ms, embedded (processes=True) {med(e) * 1e3:.1f} ms: added {(med(r) - med(e)) * 1e3:+.1f} ms "
          f"({med(r) / med(e):.2f}x); p90 remote {sorted(r)[int(0.9 * n)] * 1e3:.1f} ms, "
          f"embedded {sorted(e)[int(0.9 * n)] * 1e3:.1f} ms")


def bench_failover(dep: Deployment, times: int) -> None:
    c = start(dep, "tiny", 16, 64 << 20, serve_b=True)
    leader, standby = ("serve-a", SERVE_A), ("serve-b", SERVE_B)
    took = []
    for k in range(times):
        c.generate([[1, 2, 3]], SamplingParams(max_tokens=2), timeout_s=60)  # served by the leader
        dep.procs[leader[0]].send_signal(signal.SIGKILL)
        t0 = time.perf_counter()
        while True:
            try:
                c.generate([[4, 5, 6]], SamplingParams(max_tokens=2), timeout_s=30)
                break
            except Exception:  # noqa: BLE001 - ServiceUnavailable until the standby leads
                if time.perf_counter() - t0 > 60:
                    sys.exit("no failover in 60 s:\n" + dep.log_tail())
                time.sleep(0.05)
        took.append(time.perf_counter() - t0)
        print(f"  failover {k}: {took[-1]:.2f} s", flush=True)
        dep.procs[leader[0]].wait(10)
        fresh = (f"serve-{k}", leader[1])  # a fresh standby where the leader was
        dep.serve(*fresh)
        leader, standby = standby, fresh
        time.sleep(1.0)
    print(f"== failover, SIGKILL of the leader -> first request served by the new one: p50 {med(took):.2f} s "
          f"(min {min(took):.2f}, max {max(took):.2f}, {times} runs); lease TTL {LEASE_TTL} s, poll 0.25 s")
    c.close()  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("kv", "latency", "failover"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sequential", action="store_true", help="kv: one request at a time")
    ap.add_argument("--send-after", action="store_true",
                    help="kv: prefill workers send KV after the whole prefill (--no-stream-layers)")
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--failovers", type=int, default=5)
    a = ap.parse_args()
    if not available():
        sys.exit("network namespaces need CAP_NET_ADMIN (run as root)")
    binary = etcd_binary()
    if binary is None:
        sys.exit("etcd is required (apt-get install etcd-server)")
    tmp = Path(tempfile.mkdtemp(prefix="mooncake-deploy-bench-"))
    model_dir = write_llama_weights(tmp / "wide", **WIDE)
    for part in ("kv", "latency", "failover"):
        if a.only not in (None, part):
            continue
        with TestHosts(5) as hosts:
            server = EtcdServer(binary, tmp / f"etcd-{part}", host=hosts.gateway)
            server.start()
            (tmp / part).mkdir()
            dep = Deployment(hosts, server, tmp / part)
            try:
                if part == "kv":
                    bench_kv(hosts, dep, model_dir, a.rounds, a.sequential, a.send_after)
                elif part == "latency":
                    bench_latency(dep, a.prompts)
                else:
                    bench_failover(dep, a.failovers)
            finally:
                dep.close()
                server.stop()


if __name__ == "__main__":
    main()
