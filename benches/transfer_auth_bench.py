"""Cost of per-frame tags: TCP write/read throughput with and without auth_token.

Two engines in one process over 127.0.0.1 (TCP only, so shm does not bypass the
server). Each case moves `--mib` MiB in 1 MiB requests; the median of `--rounds`
rounds is printed, and the tagged/untagged ratio. Run:

    python benches/transfer_auth_bench.py --mib 256 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import mooncake_rs as mc


def rate(token: str | None, op: str, mib: int, rounds: int) -> float:
    with mc.TransferEngine("srv", auth_token=token, transports=["tcp"]) as b, \
         mc.TransferEngine("cli", listen="", auth_token=token, transports=["tcp"]) as a:
        n = mib << 20
        rb, la = b.allocate(n), a.allocate(n)
        p = a.connect("srv", b.address)
        reqs = [mc.TransferRequest(op, la, off, p, rb.id, off, 1 << 20) for off in range(0, n, 1 << 20)]
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            st = a.submit(reqs, timeout_s=120).wait()
            dt = time.perf_counter() - t0
            assert all(s.ok for s in st), st[:3]
            out.append(n / dt / 1e9)
        return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"{'op':6} {'no token GB/s':>14} {'token GB/s':>11} {'ratio':>6}")
    for op in ("write", "read"):
        plain = rate(None, op, args.mib, args.rounds)
        tagged = rate("bench-token", op, args.mib, args.rounds)
        print(f"{op:6} {plain:14.2f} {tagged:11.2f} {tagged / plain:6.2f}")


if __name__ == "__main__":
    main()
