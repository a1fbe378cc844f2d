#!/usr/bin/env python3
"""A steady stream of TCP batches between two engines of one process, for profilers,
with the CPU each thread spent.

  python benches/transfer_write_loop.py --token none --size 524288 --op write --seconds 8
  perf record -F 499 -g python benches/transfer_write_loop.py --token none --size 65536 --op write --seconds 8

Prints the rate it reached and, per thread name (the engine names its threads:
``mc-tcp-send``, ``mc-serve``, ...), CPU seconds per GB moved and the share of the wall
time that thread ran (from ``/proc/self/task/*/schedstat``, so it counts run time only,
whatever else loads the host); the profile (``perf report --no-children --sort dso,sym``)
says where inside a thread. BENCHMARKS.md, "The cost of security", used it for 64 KiB
and 512 KiB writes with and without a token. The batch walks a 256 MiB region call by
call (as ``transfer_bench.py`` does), so the bytes are not cache-resident.
"""

from __future__ import annotations

import argparse
import glob
import os
import time
from collections import defaultdict

import mooncake_rs as mc


def thread_cpu() -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds run so far) of every thread of this process."""
    out = {}
    for task in glob.glob(f"/proc/{os.getpid()}/task/*"):
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/schedstat") as f:
                out[int(task.rsplit("/", 1)[1])] = (name, int(f.read().split()[0]) / 1e9)
        except (OSError, ValueError, IndexError):
            pass  # a thread that just ended
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--token", default="none", help="the auth token both engines hold ('none': no token)")
    ap.add_argument("--protection", default=None, help="wire_protection with a token (encrypted, integrity)")
    ap.add_argument("--size", type=int, default=65536, help="bytes per request")
    ap.add_argument("--batch", type=int, default=32, help="requests per batch")
    ap.add_argument("--op", choices=("write", "read"), default="write")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--conns", type=int, default=None, help="connections_per_endpoint (default: the engine's)")
    args = ap.parse_args()
    tok = None if args.token == "none" else args.token
    prot = {} if tok is None else {"wire_protection": args.protection}
    region = 256 << 20
    total = args.size * args.batch
    if total > region:
        ap.error(f"--size x --batch = {total} B is more than the {region} B region")
    with mc.TransferEngine("srv", auth_token=tok, transports=["tcp"], **prot) as b, \
            mc.TransferEngine("cli", listen="", auth_token=tok, transports=["tcp"], **prot,
                              **({} if args.conns is None else {"connections_per_endpoint": args.conns})) as a:
        rb, la = b.allocate(region), a.allocate(region)
        p = a.connect("srv", b.address)

        def batch(k: int) -> list[mc.TransferRequest]:
            base = (k * total) % (region - total + 1)
            return [mc.TransferRequest(args.op, la, base + i * args.size, p, rb.id, base + i * args.size, args.size)
                    for i in range(args.batch)]

        for k in range(region // total + 1):  # fault every page of both regions in once
            a.submit(batch(k), timeout_s=60).wait()
        k, before, t0 = 0, thread_cpu(), time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            st = a.submit(batch(k), timeout_s=60).wait()
            assert all(s.ok for s in st), st[0]
            k += 1
        dt, after = time.perf_counter() - t0, thread_cpu()
    gb = k * total / 1e9
    by_name: dict[str, float] = defaultdict(float)
    for tid, (name, cpu) in after.items():
        by_name[name] += cpu - before.get(tid, (name, 0.0))[1]
    print(f"token={args.token} {args.protection or ''} {args.op} {args.size} B x {args.batch}: "
          f"{gb / dt:.2f} GB/s over {dt:.1f} s; load {os.getloadavg()[0]:.1f}")
    print(f"{'thread':20s} {'CPU s/GB':>9s} {'busy':>6s}")
    for name, cpu in sorted(by_name.items(), key=lambda kv: -kv[1]):
        if cpu > 0.001 * dt:
            print(f"{name:20s} {cpu / gb:9.3f} {cpu / dt:6.0%}")
    print(f"{'all threads':20s} {sum(by_name.values()) / gb:9.3f}")


if __name__ == "__main__":
    main()
