"""Shared helpers of the simulator reproduction scripts (benches/sim_*.py)."""

from __future__ import annotations

import os
from pathlib import Path
import resource
import sys
import time
from typing import Any

from mooncake_rs.sim import Report, Request, SimConfig, Simulator, load_trace

SHARED = Path(__file__).resolve().parents[2] / "shared"  # beside the checkout
TRACE = os.environ.get("MOONCAKE_TRACE", str(SHARED / "traces" / "synthetic_trace.jsonl"))


def trace():
    """The shared synthetic trace, read from its path (never copied into the repo)."""
    if not os.path.exists(TRACE):
        print(f"trace {TRACE} not found; set MOONCAKE_TRACE to a Mooncake JSONL trace", file=sys.stderr)
        raise SystemExit(0)
    return load_trace(TRACE)


def tiled(tr, copies: int = 4, limit: int = 12_000) -> list:
    """``tr`` repeated ``copies`` times one after the other, each copy's block hashes
    shifted apart (no reuse across copies), cut at ``limit`` requests: a longer trace
    of the same shape for throughput runs."""
    span = tr[-1].timestamp_ms + 1.0
    offset = max(max(r.hash_ids, default=0) for r in tr) + 1
    return [Request(r.timestamp_ms + c * span, r.input_length, r.output_length, tuple(h + c * offset for h in r.hash_ids))
            for c in range(copies) for r in tr][:limit]


def run(tr, **kw: Any) -> Report:
    return Simulator(SimConfig(**kw)).run(tr)


def table(header: list[str], rows: list[list[Any]]) -> None:
    def f(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [header] + [[f(c) for c in r] for r in rows]
    w = [max(len(r[j]) for r in cells) for j in range(len(header))]
    print("| " + " | ".join(c.ljust(w[j]) for j, c in enumerate(cells[0])) + " |")
    print("| " + " | ".join("-" * w[j] for j in range(len(header))) + " |")
    for r in cells[1:]:
        print("| " + " | ".join(c.ljust(w[j]) for j, c in enumerate(r)) + " |")


def footer(t0: float) -> None:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(f"\n(wall {time.perf_counter() - t0:.1f} s, peak RSS {rss:.0f} MiB; trace {TRACE})")
