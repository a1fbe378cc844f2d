#!/usr/bin/env python3
"""Writes into a restricted region from a same-host peer: the staged path against shm
(the same region unrestricted) and TCP (what restricted regions used before), in one run.

  python benches/transfer_staged_bench.py [--rounds 5] [--batches 50]

Two engines of one process that reach each other as same-host peers (separate
registries), both with a token. Each round moves ``--batches`` batches of 16 requests
per size through each path in turn; the medians over rounds of GB/s and of the ratio to
shm in the same round are printed. Serving's own figure (GB/s while a transfer is in
flight, KV-ready time) is ``benches/serving_bench.py --only transfer_grants``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import mooncake_rs as mc

ARENA = 64 << 20


def engines(transports):
    d = mc.TransferEngine("decode-0", auth_token="bench", transports=transports, registry=mc.TransferRegistry())
    p = mc.TransferEngine("prefill-0", auth_token="bench", transports=transports, registry=mc.TransferRegistry())
    return d, p


def setup(path):
    d, p = engines(["tcp"] if path == "tcp" else ["shm", "tcp"])
    arena = d.allocate(ARENA, restricted=path != "shm")
    if arena.restricted:
        d.grant(arena, "prefill-0", 0, ARENA)
    src = p.allocate(ARENA)
    np.asarray(src)[:] = 7
    return d, p, arena, src, p.connect("decode-0", d.address)


def rate(case, size, batches):
    d, p, arena, src, peer = case
    reqs = [mc.TransferRequest("write", src, i * size, peer, arena.id, i * size, size) for i in range(16)]
    assert all(s.ok for s in p.submit(reqs).wait())
    t0 = time.perf_counter()
    for _ in range(batches):
        st = p.submit(reqs, timeout_s=60).wait()
        assert all(s.ok for s in st), st[0]
    return 16 * size * batches / (time.perf_counter() - t0) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=50)
    args = ap.parse_args()
    paths = ("shm", "staged", "tcp")
    cases = {k: setup(k) for k in paths}
    try:
        staged_before = cases["staged"][0].stats().bytes_staged
        for size in (128 << 10, 1 << 20, 4 << 20):
            got = {k: [] for k in paths}
            for _ in range(args.rounds):
                for k in paths:
                    got[k].append(rate(cases[k], size, args.batches))
            med = {k: statistics.median(v) for k, v in got.items()}
            ratio = lambda k: statistics.median(a / b for a, b in zip(got[k], got["shm"]))  # noqa: E731
            print(f"16 x {size >> 10:5d} KiB writes: shm {med['shm']:6.2f} GB/s | restricted, staged "
                  f"{med['staged']:6.2f} ({ratio('staged'):.2f}x shm) | restricted, tcp {med['tcp']:6.2f} "
                  f"({ratio('tcp'):.2f}x shm)")
        assert cases["staged"][0].stats().bytes_staged > staged_before, "the staged path was not taken"
        assert cases["tcp"][0].stats().bytes_staged == 0
    finally:
        for d, p, *_ in cases.values():
            p.close()
            d.close()


if __name__ == "__main__":
    main()
