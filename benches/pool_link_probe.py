"""Two quick probes of the remote bulk path across two network-namespace hosts (needs root:
tests/netns_helpers.py), interleaved so that a drifting load hits both sides alike:

    python benches/pool_link_probe.py cc --pairs 3
        a plain socket stream of 32 x 512 KiB and 32 x 4 MiB (pool_bench_roles.py
        ``stream-*``), one connection, with the namespace's congestion control (bbr here)
        against ``cubic`` (unpaced), alternating; prints each pair and the medians
    python benches/pool_link_probe.py ab --pairs 6 main=../main mine=. [mine2=.,MOONCAKE_RS_TCP_CONNECTIONS=4]
        the pool's remote batch_put_from / batch_get_into rows (plaintext node, the
        Mooncake facade, pool_bench_roles.py ``store`` with parts ["bulk"]) of each
        checkout (its python/ and built extension), alternating in order and reverse order,
        all on one pair of hosts and one etcd; each variant may add environment variables;
        prints each run and every variant's per-pair ratios against the first.
        ``--parts small``: the 128 B put / get / batch_is_exist x100 rows instead (``bulk,small``: both).
        ``--cpus N,C``: the node on CPU N, the client on CPU C (``taskset``; the same CPU or two):
        a small-key round trip costs several times more when the two sides wake each other
        across CPUs than on one, and the scheduler picks either between runs, so an A/B of
        per-call CPU pins both ways instead of drawing one

(benches/pool_bench.py is the full side-by-side run with Mooncake; this is for A/B pairs
of one change, a minute a pair.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import pool_bench as pb  # noqa: E402
from netns_helpers import TestHosts  # noqa: E402


def short(row: dict) -> str:
    return json.dumps({k.replace("batch_", "").replace(" 32 x", ""): round(v, 2) if v < 1000 else round(v)
                       for k, v in row.items() if isinstance(v, float)})


def per_pair(runs: dict[str, list[dict]], base: str) -> None:
    for label, rows in runs.items():
        if label == base:
            continue
        for k in runs[base][0]:
            if not isinstance(runs[base][0][k], float):
                continue
            rs = [b[k] / a[k] for a, b in zip(runs[base], rows)]
            print(f"{k}: {label} / {base} median {statistics.median(rs):.2f}x, per pair "
                  f"{', '.join(f'{x:.2f}' for x in rs)}; medians {statistics.median(a[k] for a in runs[base]):.2f} "
                  f"vs {statistics.median(b[k] for b in rows):,.2f} {'GB/s' if 'GB' in k or ' x ' in k else '/s'}")


def cc(pairs: int) -> None:
    runs: dict[str, list[dict]] = {"bbr": [], "cubic": []}
    with TestHosts(2) as hosts:
        ns = ["ip", "netns", "exec", hosts.names[0]]
        for p in range(pairs):
            for name in (("bbr", "cubic") if p % 2 == 0 else ("cubic", "bbr")):
                ss = hosts.popen(1, [sys.executable, pb.ROLES, "stream-server", json.dumps({"host": hosts.ip(1), "cc": name})],
                                 stdout=subprocess.PIPE, text=True, env=pb.our_env())
                got = pb.run_role(ns, sys.executable, "stream-client", {"cc": name, **json.loads(ss.stdout.readline())},
                                  pb.our_env())
                ss.wait(10)
                got.pop("link facts", None)
                runs[name].append({k.replace(f" {name}", ""): v for k, v in got.items()})
                print(f"pair {p} {name} load {os.getloadavg()[0]:.1f} {short(runs[name][-1])}", flush=True)
    per_pair(runs, "bbr")


def ab(pairs: int, specs: list[str], parts: list[str], cpus: str | None) -> None:
    node_cpu, _, client_cpu = (cpus or "").partition(",")
    pin_node = ["taskset", "-c", node_cpu] if cpus else []
    pin_client = ["taskset", "-c", client_cpu] if cpus else []
    from etcd_helpers import EtcdServer, etcd_binary
    from pool_helpers import start_node

    variants = []
    for spec in specs:
        label, _, rest = spec.partition("=")
        root, *envs = rest.split(",")
        variants.append((label, str(Path(root).resolve()), dict(e.split("=", 1) for e in envs)))
    runs: dict[str, list[dict]] = {v[0]: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp, TestHosts(2) as hosts:
        ns = ["ip", "netns", "exec", hosts.names[0]]
        etcd = EtcdServer(etcd_binary(), Path(tmp) / "etcd", host=hosts.gateway)
        etcd.start()
        addr = "etcd://" + etcd.url[len("http://"):]
        try:
            for p in range(pairs):
                for n, (label, root, extra) in enumerate(variants if p % 2 == 0 else variants[::-1]):
                    cluster = f"ab-{p}-{label}"
                    env = dict(os.environ, MOONCAKE_LOG="warn", PYTHONPATH=str(Path(root) / "python"))
                    env.pop("MOONCAKE_AUTH_TOKEN", None)
                    nenv = dict(env, **extra)  # (a variant's settings reach the node too: MOONCAKE_RS_SPIN_US)
                    node, _ = start_node(lambda argv, **kw: hosts.popen(1, [*pin_node, *argv], **{**kw, "env": nenv}),
                                         etcd.url,
                                         hosts.ip(1), 7600 + 10 * p + n, label, cluster, dram="1GB",
                                         extra=("--plaintext",))
                    cenv = dict(env, MOONCAKE_CLUSTER=cluster, MOONCAKE_RS_TRANSPORTS="tcp", MOONCAKE_RS_PLAINTEXT="1",
                                **extra)
                    try:
                        r = subprocess.run([*ns, *pin_client, sys.executable,
                                            str(Path(root) / "benches" / "pool_bench_roles.py"),
                                            "store", json.dumps({"impl": "ours", "host": hosts.ip(0), "meta": addr,
                                                                 "master": addr, "segment": 0, "parts": parts})],
                                           capture_output=True, text=True, env=cenv, timeout=300)
                    finally:
                        node.terminate()
                        node.wait(10)
                    if r.returncode:
                        raise SystemExit(f"{label} failed:\n{r.stderr[-3000:]}")
                    got = json.loads(r.stdout.strip().splitlines()[-1])
                    got.pop("memcpy 128 MiB in this process (control)", None)
                    runs[label].append(got)
                    print(f"pair {p} {label} load {os.getloadavg()[0]:.1f} {short(got)}", flush=True)
        finally:
            etcd.stop()
    per_pair(runs, variants[0][0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe", choices=["cc", "ab"])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--parts", default="bulk", help="ab: bulk, small or bulk,small (pool_bench_roles.py store)")
    ap.add_argument("--cpus", default=None, help="ab: NODE_CPU,CLIENT_CPU to pin both sides (taskset)")
    ap.add_argument("variants", nargs="*", help="ab: LABEL=CHECKOUT[,ENV=VALUE...], the first is the base")
    a = ap.parse_intermixed_args()
    if a.probe == "cc":
        cc(a.pairs)
    else:
        if len(a.variants) < 2:
            raise SystemExit("ab needs at least two variants: LABEL=CHECKOUT[,ENV=VALUE...]")
        ab(a.pairs, a.variants, a.parts.split(","), a.cpus)


if __name__ == "__main__":
    main()
