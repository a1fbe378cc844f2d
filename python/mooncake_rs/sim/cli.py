"""``mooncake-rs replay``: the simulator from the command line."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

from .config import CONDUCTOR_DEFAULTS

__all__ = ["add_replay_arguments", "replay"]

SWEEPS = ("policy", "rejection", "cache", "architecture")


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake JSONL trace (timestamp, input_length, output_length, hash_ids)")
    p.add_argument("--prefill", type=int, default=16, help="prefill instances (default 16)")
    p.add_argument("--decode", type=int, default=16, help="decode instances (default 16)")
    p.add_argument("--policy", default=CONDUCTOR_DEFAULTS.policy, help=f"conductor policy (default {CONDUCTOR_DEFAULTS.policy})")
    p.add_argument("--rejection", default=CONDUCTOR_DEFAULTS.rejection, help="none, early or predictive")
    p.add_argument("--cache", default="global", help="global or local")
    p.add_argument("--capacity-tokens", type=int, default=None, help="cache tokens per instance (default unbounded)")
    p.add_argument("--eviction", default="lru", help="store eviction policy (lru, s3fifo, prefix)")
    p.add_argument("--ttft-slo", type=float, default=30.0, help="TTFT SLO, seconds")
    p.add_argument("--tbt-slo", type=float, default=0.1, help="TBT SLO, seconds")
    p.add_argument("--bandwidth", type=float, default=None, help="network bandwidth between instances, bytes/s")
    p.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this (load factor)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--architecture", default="disaggregated", help="disaggregated or coupled")
    p.add_argument("--chunked-prefill", action="store_true", help="coupled: chunked prefill")
    p.add_argument("--no-prefix-caching", action="store_true", help="coupled: no local prefix cache")
    p.add_argument("--oracle-output-len", action="store_true", help="tell the conductor each true output length")
    p.add_argument("--estimate-error", type=float, default=0.0, help="per-request relative error of the true times (lognormal, mean 1)")
    p.add_argument("--nic-bandwidth", type=float, default=None, help="each instance's NIC, bytes/s each way (shared links on)")
    p.add_argument("--storage-bandwidth", type=float, default=None, help="each instance's link to the SSD tier, bytes/s")
    p.add_argument("--ssd-capacity-tokens", type=int, default=None, help="SSD tier tokens per prefill instance")
    p.add_argument("--multipath", action="store_true", help="DualPath: split loads across holders and the decode relay")
    p.add_argument("--adaptive-roles", action="store_true", help="instances switch between prefill and decode (sim.RolePolicy defaults)")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of the report here (needs matplotlib)")
    p.add_argument("--sweep", choices=SWEEPS, default=None, help="run every value of one setting and print a table")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _config(args: argparse.Namespace, **over: Any) -> Any:
    from .config import SimConfig

    kw: dict[str, Any] = dict(
        prefill=args.prefill,
        decode=args.decode,
        policy=args.policy,
        rejection=args.rejection,
        cache=args.cache,
        capacity_tokens_per_instance=args.capacity_tokens,
        eviction=args.eviction,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        bandwidth=args.bandwidth,
        speedup=args.speedup,
        seed=args.seed,
        architecture=args.architecture,
        chunked_prefill=args.chunked_prefill,
        prefix_caching=not args.no_prefix_caching,
        oracle_output_len=args.oracle_output_len,
    )
    # added later: passed only when set, so a default run's config reads as before
    for name, field, off in (
        ("estimate_error", "estimate_error", 0.0),
        ("nic_bandwidth", "nic_bandwidth", None),
        ("storage_bandwidth", "storage_bandwidth", None),
        ("ssd_capacity_tokens", "ssd_capacity_tokens_per_instance", None),
        ("multipath", "multipath", False),
        ("adaptive_roles", "adaptive_roles", False),
    ):
        v = getattr(args, name, off)
        if v != off:
            kw[field] = v
    kw.update(over)
    return SimConfig(**kw)


def _progress_bar(enabled: bool, desc: str) -> tuple[Callable[[int, int], None] | None, Callable[[], None]]:
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=0, desc=desc, unit="req", file=sys.stderr, leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    return update, bar.close


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


COLUMNS = (
    ("mean_ttft_s", "mean TTFT s"),
    ("p90_ttft_s", "p90 TTFT s"),
    ("mean_tbt_s", "mean TBT s"),
    ("effective_request_capacity", "eff. capacity"),
    ("cache_hit_rate", "hit rate"),
    ("prefill_compute_s", "prefill s"),
    ("rejected", "rejected"),
    ("wall_s", "wall s"),
)


def print_table(rows: list[tuple[str, dict[str, Any]]], key: str) -> None:
    header = [key] + [c[1] for c in COLUMNS]
    table = [header] + [[name] + [_fmt(s[c[0]]) for c in COLUMNS] for name, s in rows]
    widths = [max(len(r[j]) for r in table) for j in range(len(header))]
    for n, row in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def replay(args: argparse.Namespace) -> int:
    from .config import POLICIES, REJECTIONS
    from .simulator import Simulator
    from .trace import load_trace

    trace = load_trace(args.trace)
    if args.sweep is None:
        cfg = _config(args)
        update, close = _progress_bar(not args.no_progress, "replay")
        try:
            report = Simulator(cfg).run(trace, progress=update)
        finally:
            close()
        print_table([(cfg.policy, report.summary())], "policy")
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(report.to_json())
        if args.plot:
            report.plot(args.plot)
        return 0
    values: tuple[str, ...] = {
        "policy": POLICIES,
        "rejection": REJECTIONS,
        "cache": ("global", "local"),
        "architecture": ("disaggregated", "coupled"),
    }[args.sweep]
    rows = []
    summaries = {}
    for v in values:
        cfg = _config(args, **{args.sweep: v})
        update, close = _progress_bar(not args.no_progress, f"{args.sweep}={v}")
        try:
            s = Simulator(cfg).run(trace, progress=update).summary()
        finally:
            close()
        rows.append((v, s))
        summaries[v] = s
    print_table(rows, args.sweep)
    if args.out:
        import json

        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"sweep": args.sweep, "summaries": summaries}, f, default=lambda o: None)
    return 0
