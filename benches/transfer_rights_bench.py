"""Cost of per-peer grants: small writes into an open vs a restricted region.

Two engines; `--path local` (one process, memcpy: the check is most of the per-request
cost) or `--path tcp` (127.0.0.1, through the server). Each round submits one batch of
`--requests` writes of `--size` bytes into each case, in turn (side by side): an open
region, a restricted one with 1 grant, and one with `--grants` grants where the
matching one is checked last (the rule is a linear scan). Prints the median request
rate of `--rounds` rounds per case and its ratio to the open region. Run:

    python benches/transfer_rights_bench.py --path local --rounds 7
    python benches/transfer_rights_bench.py --path tcp --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import mooncake_rs as mc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", choices=["local", "tcp"], default="local")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--grants", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    reg = mc.TransferRegistry()
    tr = ("local",) if args.path == "local" else ("tcp",)
    listen = "" if args.path == "local" else "127.0.0.1:0"
    token = None if args.path == "local" else "bench-token"
    n = args.requests * args.size
    with (
        mc.TransferEngine("decode-0", listen=listen, auth_token=token, transports=tr, registry=reg) as d,
        mc.TransferEngine("prefill-0", listen="", auth_token=token, transports=tr, registry=reg) as p,
    ):
        peer = p.connect("decode-0", d.address or None)
        src = p.allocate(n)
        cases = {"open": d.allocate(n), "1 grant": d.allocate(n, restricted=True)}
        d.grant(cases["1 grant"], "prefill-0", 0, n)
        many = d.allocate(n, restricted=True)
        for i in range(args.grants - 1):
            d.grant(many, f"prefill-{i + 1}", 0, n)  # other peers' grants, scanned first
        d.grant(many, "prefill-0", 0, n)
        cases[f"{args.grants} grants"] = many
        reqs = {
            k: [mc.TransferRequest("write", src, o, peer, r, o, args.size) for o in range(0, n, args.size)]
            for k, r in cases.items()
        }
        rates: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for k, rs in reqs.items():
                t0 = time.perf_counter()
                st = p.submit(rs, timeout_s=120).wait()
                dt = time.perf_counter() - t0
                assert all(s.ok for s in st), st[:3]
                rates[k].append(len(rs) / dt)
        base = statistics.median(rates["open"])
        print(f"path={args.path} requests={args.requests} size={args.size} rounds={args.rounds}")
        for k, v in rates.items():
            m = statistics.median(v)
            print(f"{k:>12}: {m / 1e3:8.1f} k req/s  ({m / base:.2f}x open; range {min(v) / 1e3:.1f}-{max(v) / 1e3:.1f})")
        assert d.stats().grant_refusals == 0


if __name__ == "__main__":
    main()
