#!/usr/bin/env python3
"""Per-batch latency of restricted writes at the serving bench's shape: the staged path
against shm (the same arena unrestricted), in one run.

  python benches/staged_step_probe.py [--batches 300] [--gap-ms 2] [--writes 8] [--kib 128] [--burn 2]

``benches/serving_bench.py --only transfer_grants`` writes, per layer of a prefill step,
one batch of (blocks in the step) x (one layer of one block) spans: with its wide-KV model
(4 layers, 4 KV heads x 64, block 64, fp32) and 512-token steps, 8 x 128 KiB = 1 MiB.
Its "GB/s in flight" is bytes over the time a batch was in flight (submit to end, as the
engine counts it), and between batches the prefill computes the next layer, so every
batch starts on a link that went idle. This probe does the same: one batch, wait for it,
sleep ``--gap-ms`` (the layer's compute), again; it prints the median time in ``submit``,
submit -> end (the engine's own timestamps), and bytes over the summed in-flight time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import numpy as np

import mooncake_rs as mc

ARENA = 64 << 20


def setup(restricted: bool):
    d = mc.TransferEngine("decode-0", auth_token="probe", registry=mc.TransferRegistry())
    p = mc.TransferEngine("prefill-0", auth_token="probe", registry=mc.TransferRegistry())
    arena = d.allocate(ARENA, restricted=restricted)
    if restricted:
        d.grant(arena, "prefill-0", 0, ARENA)
    src = p.allocate(ARENA)
    np.asarray(src)[:] = 7
    return d, p, arena, src, p.connect("decode-0", d.address)


def run(case, writes: int, size: int, batches: int, gap_s: float) -> dict[str, float]:
    d, p, arena, src, peer = case
    stride = 4 * size  # scattered like a step's blocks, not one contiguous range
    reqs = [mc.TransferRequest("write", src, i * stride, peer, arena.id, (writes - 1 - i) * stride, size)
            for i in range(writes)]
    q = mc.CompletionQueue()
    for _ in range(5):  # warm-up: connect, region lookups
        assert all(s.ok for s in p.submit(reqs).wait())
    in_submit, flight = [], []
    for b in range(batches):
        t0 = time.perf_counter_ns()
        p.submit(reqs, timeout_s=30, queue=q, tag=b)
        in_submit.append(time.perf_counter_ns() - t0)
        done = []
        while not done:
            done = q.wait(5.0)
        c = done[0]
        assert c.ok, c.error
        flight.append(c.finished_ns - c.submitted_ns)
        if gap_s:
            time.sleep(gap_s)
    nbytes = writes * size
    return {"submit_us": statistics.median(in_submit) / 1e3, "flight_us": statistics.median(flight) / 1e3,
            "p90_us": sorted(flight)[int(0.9 * len(flight))] / 1e3,
            "GBps": nbytes * batches / sum(flight)}


def _burn() -> None:
    while True:  # a compute thread's stand-in: never sleeps
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--writes", type=int, default=8)
    ap.add_argument("--kib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=("shm", "staged"), help="one path (to count its syscalls or switches)")
    ap.add_argument("--burn", type=int, default=0,
                    help="processes that spin meanwhile (the serving workers' torch threads compete like this)")
    args = ap.parse_args()
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burn)]
    for b in burners:
        b.start()
    cases = {k: setup(k == "staged") for k in ("shm", "staged") if args.only in (None, k)}
    try:
        print(f"{args.writes} x {args.kib} KiB a batch, {args.gap_ms} ms between batches, {args.batches} batches, "
              f"{args.burn} spinning processes beside")
        print(f"{'round':>5} {'path':>7} {'in submit us':>13} {'in flight us (median)':>22} {'p90 us':>8} {'GB/s in flight':>15}")
        ratios = []
        for r in range(args.rounds):
            got = {k: run(c, args.writes, args.kib << 10, args.batches, args.gap_ms / 1e3) for k, c in cases.items()}
            for k, v in got.items():
                print(f"{r:5d} {k:>7} {v['submit_us']:13.1f} {v['flight_us']:22.1f} {v['p90_us']:8.1f} {v['GBps']:15.2f}")
            if len(got) == 2:
                ratios.append(got["staged"]["GBps"] / got["shm"]["GBps"])
        if ratios:
            print(f"staged / shm, GB/s in flight: {', '.join(f'{x:.2f}' for x in ratios)} "
                  f"(median {statistics.median(ratios):.2f})")
        if "staged" in cases:
            assert cases["staged"][0].stats().bytes_staged > 0, "the staged path was not taken"
    finally:
        for b in burners:
            b.terminate()
        for d, p, *_ in cases.values():
            p.close()
            d.close()


if __name__ == "__main__":
    main()
