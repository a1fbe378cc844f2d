"""Store benchmarks from Python, side by side with references run in the same process
and session:

* put / get_into of 4 MiB blocks vs ``np.copyto`` of the same bytes (target >= 0.8x);
* the cost of ``get`` (a view) for 4 KiB vs 4 MiB blocks (should be the same);
* 1 KiB put+get pairs/s in batch calls (target >= 300k/s);
* Mooncake Store (``../shared/peers/mooncake/store_bench.py``, ``local`` topology,
  run as a subprocess right after ours) at 512 KiB / 4 MiB and small keys
  (targets: >= 1.5x its bytes/s, >= 50x its small-key ops/s).

    python benches/store_bench.py [--no-peer] [--rounds 5]

Prints medians over rounds; the machine is shared, so only same-run ratios mean much.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from pathlib import Path
import statistics
import subprocess
import tempfile
import time

import numpy as np

import mooncake_rs as mr

KiB, MiB = 1 << 10, 1 << 20
PEER_DIR = os.environ.get("MOONCAKE_PEER_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "peers" / "mooncake"))
PEER_PY = os.environ.get("MC_PEER_VENV", os.path.join(tempfile.gettempdir(), "peer-mc")) + "/bin/python"


def med(xs: list[float]) -> float:
    return statistics.median(xs)


class Keys:
    def __init__(self) -> None:
        self.n = 0

    def take(self, k: int) -> list[int]:
        self.n += k
        return list(range(self.n - k, self.n))


def bandwidth(block: int, n: int, rounds: int) -> dict[str, float]:
    """GB/s of put, get_into, put_many, get_many_into, and np.copyto of the same bytes."""
    s = mr.Store(block, (2 * n + 2) * block)
    keys = Keys()
    src = np.random.default_rng(1).integers(0, 256, (n, block), dtype=np.uint8)
    dst = np.zeros((n, block), dtype=np.uint8)
    names = ("copyto", "put", "get_into", "put_many", "get_many_into", "np_arena_put", "np_arena_get")
    res: dict[str, list[float]] = {k: [] for k in names}
    # A reference for the working set: np.copyto into / out of a numpy buffer as large as
    # the store's arena, rows taken round-robin as the store takes slots.
    arena = np.zeros((2 * n + 2, block), dtype=np.uint8)
    at = 0
    gb = n * block / 1e9
    for r in range(rounds + 1):  # round 0 warms the arena and the destination
        t = time.perf_counter()
        for i in range(n):
            np.copyto(dst[i], src[i])
        t_copy = time.perf_counter() - t
        rows = [(at + i) % len(arena) for i in range(n)]
        at += n
        t = time.perf_counter()
        for i, j in enumerate(rows):
            np.copyto(arena[j], src[i])
        t_nput = time.perf_counter() - t
        t = time.perf_counter()
        for i, j in enumerate(rows):
            np.copyto(dst[i], arena[j])
        t_nget = time.perf_counter() - t
        ks = keys.take(n)
        t = time.perf_counter()
        for k, row in zip(ks, src):
            s.put(k, row)
        t_put = time.perf_counter() - t
        t = time.perf_counter()
        for k, row in zip(ks, dst):
            s.get_into(k, row)
        t_get = time.perf_counter() - t
        assert np.array_equal(dst, src)
        ks = keys.take(n)
        t = time.perf_counter()
        s.put_many(ks, src)
        t_pm = time.perf_counter() - t
        t = time.perf_counter()
        s.get_many_into(ks, dst)
        t_gm = time.perf_counter() - t
        if r:
            for name, dt in zip(res, (t_copy, t_put, t_get, t_pm, t_gm, t_nput, t_nget)):
                res[name].append(gb / dt)
    return {k: med(v) for k, v in res.items()}


def view_cost(block: int, reps: int = 20000) -> float:
    s = mr.Store(block, 4 * max(block, 4096))
    s.put(1, np.zeros(block, np.uint8))
    samples = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            b = s.get(1)
            del b
        samples.append((time.perf_counter() - t) / reps * 1e9)
    return min(samples)  # least disturbed by the other tenants of the machine


def small_pairs(block: int, batch: int, total: int, rounds: int) -> dict[str, float]:
    """put+get pairs/s: batch calls (put_many + get_many_into, put_many + get_many
    views) and single calls (put + get)."""
    s = mr.Store(block, 8192 * 4096)
    keys = Keys()
    data = np.random.default_rng(2).integers(0, 256, (batch, block), dtype=np.uint8)
    out = np.zeros_like(data)
    res: dict[str, list[float]] = {"batch_into": [], "batch_views": [], "single": [], "put_ops": [], "get_ops": []}
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(total // batch):
            ks = keys.take(batch)
            s.put_many(ks, data)
            s.get_many_into(ks, out)
        res["batch_into"].append(total / (time.perf_counter() - t))
        t = time.perf_counter()
        for _ in range(total // batch):
            ks = keys.take(batch)
            s.put_many(ks, data)
            views = s.get_many(ks)
            del views
        res["batch_views"].append(total / (time.perf_counter() - t))
        row = data[0]
        n1 = total // 4
        ks = keys.take(n1)
        t = time.perf_counter()
        for k in ks:
            s.put(k, row)
            s.get(k)
        res["single"].append(n1 / (time.perf_counter() - t))
        ks = keys.take(n1)
        t = time.perf_counter()
        for k in ks:
            s.put(k, row)
        res["put_ops"].append(n1 / (time.perf_counter() - t))
        t = time.perf_counter()
        for k in ks:
            s.get(k)
        res["get_ops"].append(n1 / (time.perf_counter() - t))
    return {k: med(v) for k, v in res.items()}


def run_peer() -> dict[str, float] | None:
    if not os.path.isdir(PEER_DIR):
        print(f"peer: {PEER_DIR} not found (set MOONCAKE_PEER_DIR)")
        return None
    if not os.path.exists(PEER_PY):
        print(f"peer: {PEER_PY} not found (see {PEER_DIR}/README.md)")
        return None
    out = tempfile.mkdtemp(prefix="mcpeer_")
    env = dict(os.environ, MCPEER_RESULTS=out)
    t = time.perf_counter()
    p = subprocess.run(
        [PEER_PY, "store_bench.py", "--topologies", "local", "--rounds", "1"],
        cwd=PEER_DIR, env=env, capture_output=True, text=True, timeout=200,
    )
    files = sorted(glob.glob(os.path.join(out, "store_bench-*.json")))
    if p.returncode != 0 or not files:
        print(f"peer failed (rc={p.returncode}): {p.stderr[-800:]}")
        return None
    rows = json.load(open(files[-1]))["rows"]
    print(f"peer ran in {time.perf_counter() - t:.0f} s; results in {files[-1]}")
    return {r["op"]: r["round_rate_median"] for r in rows if r["topology"] == "local"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args()

    def ours_once() -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float]]:
        return (bandwidth(4 * MiB, 32, args.rounds), bandwidth(512 * KiB, 64, args.rounds),
                small_pairs(1 * KiB, 256, 256 * 200, max(3, args.rounds // 2)), small_pairs(128, 100, 100 * 200, 3))

    # Ours runs before and after the peer; each figure is the mean of the two medians,
    # so a change of machine load during the session hits both sides alike.
    first = ours_once()
    peer = None if args.no_peer else run_peer()
    second = ours_once() if peer is not None else first
    bw4, bw512, pairs, small128 = ({k: (a[k] + b[k]) / 2 for k in a} for a, b in zip(first, second))

    for label, bw in (("4 MiB", bw4), ("512 KiB", bw512)):
        print(f"## {label} blocks vs np.copyto (same bytes, same run; target >= 0.8x)")
        for k in ("put", "get_into", "put_many", "get_many_into", "np_arena_put", "np_arena_get"):
            print(f"  {k:14s} {bw[k]:6.2f} GB/s   vs np.copyto {bw['copyto']:6.2f} GB/s   ratio {bw[k] / bw['copyto']:.2f}x")

    print("## get() view cost (create + drop a Block; min of 5 x 20k)")
    v4k, v4m = view_cost(4 * KiB), view_cost(4 * MiB)
    print(f"  4 KiB {v4k:.0f} ns   4 MiB {v4m:.0f} ns   ratio {v4m / v4k:.2f}")

    print("## 1 KiB put+get pairs/s")
    for k in ("batch_into", "batch_views", "single"):
        print(f"  {k:12s} {pairs[k] / 1e3:8.0f} k pairs/s")

    print("## vs Mooncake Store (local topology, same session)")
    ours = {
        "get_into 512 KiB": bw512["get_into"], "batch_get_into 512 KiB x32": bw512["get_many_into"],
        "put_from 512 KiB": bw512["put"], "batch_put_from 512 KiB x32": bw512["put_many"],
        "get_into 4 MiB": bw4["get_into"], "batch_get_into 4 MiB x32": bw4["get_many_into"],
        "put_from 4 MiB": bw4["put"], "batch_put_from 4 MiB x32": bw4["put_many"],
    }
    for op, v in ours.items():
        theirs = peer.get(op) if peer else None
        ratio = f"{v / theirs:.2f}x" if theirs else "n/a"
        print(f"  {op:28s} ours {v:6.2f} GB/s   mooncake {theirs if theirs is None else round(theirs, 2)} GB/s   {ratio}")
    # small keys (128 B): single put / get calls, ops/s
    # batch rows: ours is put_many+get_many_into pairs/s (a pair = one put and one get)
    ours_ops = {"put small 128 B (n=5000)": small128["put_ops"], "get small 128 B (n=5000)": small128["get_ops"],
                "put_batch small 128 B x100": small128["batch_into"], "get_batch small 128 B x100": small128["batch_into"]}
    for op, v in ours_ops.items():
        theirs = peer.get(op) if peer else None
        ratio = f"{v / theirs:.0f}x" if theirs else "n/a"
        print(f"  {op:28s} ours {v / 1e3:8.0f} k ops/s   mooncake {theirs if theirs is None else round(theirs)} ops/s   {ratio}")


if __name__ == "__main__":
    main()
