"""CPU a store node spends on one batch's control requests, for two builds in the same
run: ``Reserve``, ``Commit``, ``Lookup`` (leased) and ``Release`` of 32 objects, handled
in-process by a ``StoreNode``'s own dispatcher (``_handle``, no socket: what the node's
serving thread runs for each request, minus the frame decode and encode), timed with
``time.thread_time_ns``. Builds alternate (A, B, A, B...), each in its own process.

    python benches/pool_node_handlers.py --builds OTHER_CHECKOUT,. [--pairs 3] [--rounds 60] [--pause-ms 0]

``--pause-ms 20``: the thread sleeps that long before each request, as a node's serving
thread does between a batch's requests (its caches are cold when the next one comes:
what a request costs inside pool_bench.py's batches, each after a 20 ms pause).

Each build is a checkout with its extension built (``python/mooncake_rs/_core*.so``);
medians in microseconds per request, and B / A as the median of per-pair ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SIZES = (512 << 10, 4 << 20)
OPS = ("reserve", "commit", "lookup", "release")


def child(rounds: int, pause_s: float) -> dict:
    """Runs with one build on PYTHONPATH: medians per value size and request."""
    import time

    from mooncake_rs.pool.holds import ConnHolds
    from mooncake_rs.pool.node import StoreNode
    from mooncake_rs.pool.protocol import Commit, Lookup, Release, Reserve

    out: dict = {}
    node = StoreNode(name="handlers", listen="127.0.0.1:0", dram_bytes=1 << 30, auth_token=None, plaintext=True,
                     transports=("tcp",))
    try:
        conn = ConnHolds(node.te, 0, node._free)
        for size in SIZES:
            times: dict[str, list[float]] = {op: [] for op in OPS}
            for r in range(rounds + 10):  # the first 10 warm up
                keys = [f"h{size}-{r}-{i}" for i in range(32)]
                reqs = iter([lambda: Reserve(1, keys, [size] * 32, False, "client"),
                             lambda: Commit(2, rep.put_ids, [True] * 32),
                             lambda: Lookup(3, keys, 4096, True, "client"),
                             lambda: Release(4, leased.lease_ids)])
                spent = []
                for op in OPS:
                    msg = next(reqs)()
                    if pause_s:
                        time.sleep(pause_s)
                    t = time.thread_time_ns()
                    answer = node._handle(msg, conn)
                    spent.append((time.thread_time_ns() - t) / 1e3)
                    if op == "reserve":
                        rep = answer
                    elif op == "commit":
                        assert all(v == 0 for v in answer.values)
                    elif op == "lookup":
                        leased = answer
                        assert all(v == 0 for v in leased.statuses)
                if r >= 10:
                    for op, us in zip(OPS, spent):
                        times[op].append(us)
                node.segment.remove_all()
            out[str(size)] = {op: statistics.median(v) for op, v in times.items()}
        conn.close()
    finally:
        node.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--builds", required=True, help="two checkouts, comma-separated (A,B)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--pause-ms", type=float, default=0.0)
    a = ap.parse_args()
    builds = [str(Path(b).resolve()) for b in a.builds.split(",")]
    runs: list[list[dict]] = [[], []]
    for _ in range(a.pairs):
        for i, build in enumerate(builds):
            env = dict(os.environ, MOONCAKE_LOG="error", PYTHONPATH=str(Path(build) / "python"))
            r = subprocess.run([sys.executable, __file__, "child", str(a.rounds), str(a.pause_ms / 1e3)],
                               capture_output=True, text=True, env=env, timeout=600)
            if r.returncode != 0:
                raise RuntimeError(f"{build} failed:\n{r.stderr[-3000:]}")
            runs[i].append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"node CPU per request of 32 objects, us (median over {a.pairs} pairs of each run's median), "
          f"{a.pause_ms:g} ms pause before each; load {os.getloadavg()[0]:.1f}")
    print("| value size | request | A | B | B / A (per pair) |\n|---|---|---|---|---|")
    for size in SIZES:
        for op in OPS:
            va = [r[str(size)][op] for r in runs[0]]
            vb = [r[str(size)][op] for r in runs[1]]
            per = [y / x for x, y in zip(va, vb)]
            name = f"{size >> 10} KiB" if size < (1 << 20) else f"{size >> 20} MiB"
            print(f"| {name} | {op} | {statistics.median(va):.0f} | {statistics.median(vb):.0f} | "
                  f"**{statistics.median(per):.2f}x** ({', '.join(f'{x:.2f}' for x in per)}) |")
    print(f"\nA = {builds[0]}\nB = {builds[1]}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        print(json.dumps(child(int(sys.argv[2]), float(sys.argv[3]))))
    else:
        main()
