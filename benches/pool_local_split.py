"""Where a local ``batch_put_from`` / ``batch_get_into`` of 32 objects spends its time,
through the Mooncake-compatible facade on the embedded pool (as benches/pool_bench.py
calls it): the whole call, the Rust copy call inside it (``Store.put_objects_from`` / ``get_objects_into``,
or the older ``put_from_addresses`` / ``get_into_addresses``; argument conversion
included), the Python before and after that
call, and one ``memmove`` of the same bytes between the same buffers. Each timed call
follows the same 20 ms pause as pool_bench.py's (on a shared host the caches are cold
after it, which is what a batch pays). Medians over rounds, microseconds.

    python benches/pool_local_split.py [--size 524288] [--rounds 30]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from mooncake_rs.compat import install_as_mooncake  # noqa: E402

MiB = 1 << 20


class TimedStore:
    """A class store whose two batch copy calls record when they start and end."""

    def __init__(self, store: object, marks: list[tuple[float, float]]) -> None:
        self._store, self._marks = store, marks

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    def _timed(self, name: str, *args: object) -> object:
        t = time.perf_counter()
        out = getattr(self._store, name)(*args)
        self._marks.append((t, time.perf_counter()))
        return out

    def put_from_addresses(self, *args: object) -> object:
        return self._timed("put_from_addresses", *args)

    def get_into_addresses(self, *args: object) -> object:
        return self._timed("get_into_addresses", *args)

    def put_objects_from(self, *args: object) -> object:
        return self._timed("put_objects_from", *args)

    def get_objects_into(self, *args: object) -> object:
        return self._timed("get_objects_into", *args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", type=int, default=512 << 10)
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    install_as_mooncake()
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 640 * MiB, 256 * MiB, "tcp", "", "127.0.0.1:50051") == 0
    marks: list[tuple[float, float]] = []
    for sc in s._store._backend.segment.classes:  # the embedded pool's size classes
        sc.store = TimedStore(sc.store, marks)
    vals = np.random.default_rng(0).integers(0, 256, (32, a.size), dtype=np.uint8)
    dst = np.zeros_like(vals)
    ptrs = [vals[i].ctypes.data for i in range(32)]
    dptrs = [dst[i].ctypes.data for i in range(32)]
    rows: dict[str, list[float]] = {}

    def timed(op: str, call) -> None:
        marks.clear()
        time.sleep(0.02)
        t = time.perf_counter()
        call()
        end = time.perf_counter()
        rows.setdefault(f"{op} whole call", []).append(end - t)
        rows.setdefault(f"{op} Rust copy call", []).append(sum(e - b for b, e in marks))
        rows.setdefault(f"{op} Python before it", []).append(marks[0][0] - t)
        rows.setdefault(f"{op} Python after it", []).append(end - marks[-1][1])

    for r in range(a.rounds):
        keys = [f"split-{r}-{i}" for i in range(32)]
        timed("put", lambda: s.batch_put_from(keys, ptrs, [a.size] * 32))
        dst[:] = 0
        timed("get", lambda: s.batch_get_into(keys, dptrs, [a.size] * 32))
        assert (dst == vals).all()
        dst[:] = 0
        time.sleep(0.02)
        t = time.perf_counter()
        ctypes.memmove(dst.ctypes.data, vals.ctypes.data, vals.nbytes)
        rows.setdefault("memmove, same bytes and buffers", []).append(time.perf_counter() - t)
        s.remove_all(True)
    s.close()
    gb = vals.nbytes / 1e9
    print(f"32 x {a.size} B ({vals.nbytes / MiB:.0f} MiB), median of {a.rounds} rounds")
    for name, ts in rows.items():
        med = statistics.median(ts)
        rate = f"  ({gb / med:.2f} GB/s)" if "whole" in name or "Rust" in name or "memmove" in name else ""
        print(f"{name:34s} {med * 1e6:8.0f} us{rate}")


if __name__ == "__main__":
    main()
