#!/usr/bin/env python3
"""A steady stream of TCP batches between two engines of one process, for profilers.

  perf record -F 499 -g python benches/transfer_write_loop.py --token none --size 65536 --op write --seconds 8

Prints the rate it reached; the profile (``perf report --no-children --sort dso,sym``)
says where the time went. BENCHMARKS.md, "The cost of security", used it for 64 KiB
writes with and without a token.
"""

from __future__ import annotations

import argparse
import time

import mooncake_rs as mc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--token", default="none", help="the auth token both engines hold ('none': no token)")
    ap.add_argument("--size", type=int, default=65536, help="bytes per request")
    ap.add_argument("--batch", type=int, default=32, help="requests per batch")
    ap.add_argument("--op", choices=("write", "read"), default="write")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--conns", type=int, default=None, help="connections_per_endpoint (default: the engine's)")
    args = ap.parse_args()
    tok = None if args.token == "none" else args.token
    with mc.TransferEngine("srv", auth_token=tok, transports=["tcp"]) as b, \
            mc.TransferEngine("cli", listen="", auth_token=tok, transports=["tcp"],
                              **({} if args.conns is None else {"connections_per_endpoint": args.conns})) as a:
        n = max(64 << 20, args.size * args.batch)
        rb, la = b.allocate(n), a.allocate(n)
        p = a.connect("srv", b.address)
        reqs = [mc.TransferRequest(args.op, la, i * args.size, p, rb.id, i * args.size, args.size)
                for i in range(args.batch)]
        a.submit(reqs).wait()
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            st = a.submit(reqs, timeout_s=60).wait()
            assert all(s.ok for s in st), st[0]
            k += 1
        dt = time.perf_counter() - t0
    print(f"token={args.token} {args.op} {args.size} B x {args.batch}: {k * args.batch * args.size / dt / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
