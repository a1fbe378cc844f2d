#!/usr/bin/env python3
"""Writes into and reads from a restricted region of a same-host peer: the staged path
against shm (the same region unrestricted) and TCP (what restricted regions used before),
in one run.

  python benches/transfer_staged_bench.py [--rounds 5] [--batches 50] [--ops write,read]
                                          [--with-staging] [--sizes 128,1024,4096]

Two engines of one process that reach each other as same-host peers (separate
registries), both with a token. Each round moves ``--batches`` batches of 16 requests
per size and op through each path in turn; the medians over rounds of GB/s and of the ratio to
shm in the same round are printed. The staged path takes one copy where the kernel allows
(``MOONCAKE_STAGED_COPY``, docs/transfer.md); ``--with-staging`` adds a row for the same
path forced through its staging buffer (two copies), in the same rounds. Serving's own
figure (GB/s while a transfer is in flight, KV-ready time) is
``benches/serving_bench.py --only transfer_grants``.
"""

from __future__ import annotations

import argparse
import os
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
    # The staged-copy mode is read when an engine is made: "staging" forces two copies.
    old = os.environ.get("MOONCAKE_STAGED_COPY")
    if path == "staging":
        os.environ["MOONCAKE_STAGED_COPY"] = "staging"
    try:
        d, p = engines(["tcp"] if path == "tcp" else ["shm", "tcp"])
    finally:
        if old is None:
            os.environ.pop("MOONCAKE_STAGED_COPY", None)
        else:
            os.environ["MOONCAKE_STAGED_COPY"] = old
    arena = d.allocate(ARENA, restricted=path != "shm")
    if arena.restricted:
        d.grant(arena, "prefill-0", 0, ARENA)
    src = p.allocate(ARENA)
    np.asarray(src)[:] = 7
    return d, p, arena, src, p.connect("decode-0", d.address)


def rate(case, op, size, batches):
    d, p, arena, src, peer = case
    reqs = [mc.TransferRequest(op, src, i * size, peer, arena.id, i * size, size) for i in range(16)]
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
    ap.add_argument("--ops", default="write,read", help="comma-separated: write, read")
    ap.add_argument("--sizes", default="128,1024,4096", help="comma-separated request sizes in KiB")
    ap.add_argument("--with-staging", action="store_true", help="also the staged path through its staging buffer")
    args = ap.parse_args()
    ops = args.ops.split(",")
    paths = ("shm", "staged", "staging", "tcp") if args.with_staging else ("shm", "staged", "tcp")
    cases = {k: setup(k) for k in paths}
    # A build without staged reads (before issue 26's second part) has no read counter:
    # its "staged" read row is TCP, which is what an A/B against it should show.
    counters = {"write": "bytes_staged", "read": "bytes_staged_read"}
    counted = lambda op, k: getattr(cases[k][0].stats(), counters[op], 0)  # noqa: E731
    try:
        staged_before = {op: counted(op, "staged") for op in ops}
        for op in ops:
            for size in (int(k) << 10 for k in args.sizes.split(",")):
                got = {k: [] for k in paths}
                for _ in range(args.rounds):
                    for k in paths:
                        got[k].append(rate(cases[k], op, size, args.batches))
                med = {k: statistics.median(v) for k, v in got.items()}
                ratio = lambda k: statistics.median(a / b for a, b in zip(got[k], got["shm"]))  # noqa: E731
                two = (f" | staging buffer {med['staging']:6.2f} ({ratio('staging'):.2f}x shm)"
                       if "staging" in paths else "")
                print(f"16 x {size >> 10:5d} KiB {op + 's':6s}: shm {med['shm']:6.2f} GB/s | restricted, staged "
                      f"{med['staged']:6.2f} ({ratio('staged'):.2f}x shm){two} | restricted, tcp {med['tcp']:6.2f} "
                      f"({ratio('tcp'):.2f}x shm)", flush=True)
        for op in ops:
            staged = counted(op, "staged") > staged_before[op]
            if op == "write" or hasattr(cases["staged"][0].stats(), counters[op]):
                assert staged, f"the staged path was not taken for {op}s"
            else:
                print(f"(this build has no staged {op}s: its staged row went over TCP)")
            assert counted(op, "tcp") == 0
    finally:
        for d, p, *_ in cases.values():
            p.close()
            d.close()


if __name__ == "__main__":
    main()
