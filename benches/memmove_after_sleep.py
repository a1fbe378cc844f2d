"""How fast one 16 MiB ``memmove`` runs in a busy loop vs right after a short sleep.

On an oversubscribed machine the scheduler runs a thread that just woke up ahead of the
busy ones for a while; a copy that follows a sleep (as each of Mooncake Store's local
copies follows an RPC) can then run at a whole core's speed while a copy loop gets its
fair share. BENCHMARKS.md ("Issue 24, second pass") uses this to read the local pool rows.

    python benches/memmove_after_sleep.py [--rounds 3] [--samples 30]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np

SIZE = 16 << 20


def gbps(dst: np.ndarray, src: np.ndarray, pause_s: float, samples: int) -> float:
    """Median GB/s of ``samples`` copies, each after ``pause_s`` of sleep (0: back to back)."""
    times = []
    for _ in range(samples):
        if pause_s:
            time.sleep(pause_s)
        t = time.perf_counter()
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, SIZE)
        times.append(time.perf_counter() - t)
    return SIZE / 1e9 / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=30)
    args = ap.parse_args()
    src = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    dst = np.ones_like(src)
    for _ in range(args.rounds):
        row = {f"after {p * 1000:g} ms sleep" if p else "busy loop": gbps(dst, src, p, args.samples)
               for p in (0.0, 0.005, 0.02)}
        print("  ".join(f"{k} {v:.2f} GB/s" for k, v in row.items()))


if __name__ == "__main__":
    main()
