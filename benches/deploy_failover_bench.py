"""Leader failover on a real etcd: time from SIGKILL of the leading candidate to the
moment the standby leads, against the lease TTL.

    python benches/deploy_failover_bench.py --rounds 5 --ttl 2

Starts its own etcd (Debian's ``etcd-server``; ``MOONCAKE_ETCD`` to point elsewhere) on
127.0.0.1 with a temporary data directory. The leader is a separate process (as a
``serve`` would be); the standby polls every ``--poll`` seconds. This measures the
election alone: a ``serve`` process does not exist yet, so "first request served by the
new leader" adds whatever its startup costs on top (issue 12).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from etcd_helpers import EtcdServer, etcd_binary  # noqa: E402

from mooncake_rs.deploy import EtcdClient, LeaderElection  # noqa: E402

_LEADER = """
import sys, time
from mooncake_rs.deploy import EtcdClient, LeaderElection
e = LeaderElection(EtcdClient(sys.argv[1]), sys.argv[2], "leader", ttl_s=int(sys.argv[3]))
assert e.campaign(timeout_s=30)
print("leading", flush=True)
time.sleep(600)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ttl", type=int, default=2)
    ap.add_argument("--poll", type=float, default=0.1)
    args = ap.parse_args()
    binary = etcd_binary()
    if binary is None:
        sys.exit("etcd not found: apt-get install etcd-server (or set MOONCAKE_ETCD)")
    with tempfile.TemporaryDirectory() as tmp:
        server = EtcdServer(binary, Path(tmp) / "etcd")
        server.start()
        try:
            client = EtcdClient(server.url)
            times = []
            for r in range(args.rounds):
                prefix = f"/bench/{r}"
                p = subprocess.Popen([sys.executable, "-c", _LEADER, server.url, prefix, str(args.ttl)],
                                     stdout=subprocess.PIPE, text=True)
                assert p.stdout is not None and p.stdout.readline().strip() == "leading"
                standby = LeaderElection(client, prefix, "standby", ttl_s=args.ttl, poll_s=args.poll)
                time.sleep(args.ttl)  # the leader has refreshed its lease at least once
                t0 = time.monotonic()
                p.send_signal(signal.SIGKILL)
                p.wait()
                assert standby.campaign(timeout_s=args.ttl * 5)
                times.append(time.monotonic() - t0)
                standby.resign()
                print(f"round {r}: failover {times[-1]:.2f} s")
            print(f"failover p50 {statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f}) "
                  f"with lease TTL {args.ttl} s, poll {args.poll} s, {args.rounds} rounds")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
