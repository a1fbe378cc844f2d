"""Cluster totals and the Prometheus text exposition (a request's own metrics are
``base.metrics.RequestMetrics``)."""

from __future__ import annotations

import bisect
import collections
import math
import threading
from collections.abc import Sequence

from ..base.metrics import RequestMetrics

__all__ = ["ClusterMetrics", "Histogram", "tbt_of", "percentile"]

#: recent samples kept for the summaries' quantiles (a server runs for months: the
#: lifetime distribution lives in the fixed-size histograms, not in a list)
RECENT_SAMPLES = 10_000
#: bucket upper bounds (seconds) of the TTFT and TBT histograms
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def tbt_of(intervals: list[float]) -> float:
    """The paper's TBT: the mean of the longest 10% of token intervals (0 with none)."""
    n = len(intervals)
    if n <= 10:  # the longest 10% is the longest one (most requests: no sort)
        return max(intervals) if n else 0.0
    k = math.ceil(n * 0.1)
    top = sorted(intervals, reverse=True)[:k]
    return sum(top) / k


class Histogram:
    """Counts of observations per bucket (upper bounds, seconds), with their sum: a
    Prometheus histogram. Fixed size whatever the number of observations."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.total += v
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for bound, c in zip(self.bounds, self.counts):
            cum += c
            out.append(f'{name}_bucket{{le="{bound:g}"}} {cum}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.total:g}")
        out.append(f"{name}_count {self.n}")
        return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class ClusterMetrics:
    """Totals over a cluster's lifetime (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.finished = 0
        self.rejected = 0
        self.failed = 0  # instance lost, transfer failed, internal error, deadline passed
        self.cancelled = 0  # ended early on purpose (RequestHandle.cancel): not a failure
        self.timed_out = 0  # of ``failed``: those that passed their deadline
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.reused_tokens = 0
        self.fetched_tokens = 0
        self.computed_tokens = 0
        self.transferred_bytes = 0
        self.multi_source_fetches = 0  # finished requests whose prefix came from 2+ holders at once
        # the most recent samples (summary quantiles), and the lifetime histograms
        self.ttft: collections.deque[float] = collections.deque(maxlen=RECENT_SAMPLES)
        self.tbt: collections.deque[float] = collections.deque(maxlen=RECENT_SAMPLES)
        self.ttft_hist = Histogram(TTFT_BUCKETS)
        self.tbt_hist = Histogram(TBT_BUCKETS)

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + n)

    def ended(self, outcome: str) -> None:
        """A request ended without finishing: ``outcome`` is ``"cancelled"``,
        ``"timed_out"`` (counted in ``failed`` too) or ``"failed"``."""
        with self._lock:
            if outcome == "cancelled":
                self.cancelled += 1
                return
            self.failed += 1
            if outcome == "timed_out":
                self.timed_out += 1

    def summary(self) -> dict[str, float]:
        """The totals as a dict (counters, prefix hit rate, TTFT / TBT medians)."""
        with self._lock:
            out: dict[str, float] = {k: float(getattr(self, k)) for k in (
                "requests", "finished", "rejected", "failed", "cancelled", "timed_out", "prompt_tokens",
                "output_tokens", "reused_tokens", "fetched_tokens", "computed_tokens", "transferred_bytes")}
            out["prefix_hit_rate"] = self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
            out["ttft_p50_s"] = percentile(self.ttft, 0.5)
            out["tbt_p50_s"] = percentile(self.tbt, 0.5)
            return out

    def add(self, m: RequestMetrics) -> None:
        with self._lock:
            self.finished += 1
            self.prompt_tokens += m.prompt_tokens
            self.output_tokens += m.output_tokens
            self.reused_tokens += m.reused_tokens
            self.fetched_tokens += m.fetched_tokens
            self.computed_tokens += m.computed_tokens
            self.transferred_bytes += m.transferred_bytes
            self.multi_source_fetches += m.fetch_sources > 1
            if not math.isnan(m.ttft_s):
                self.ttft.append(m.ttft_s)
                self.ttft_hist.observe(m.ttft_s)
            if m.token_intervals:
                self.tbt.append(m.tbt_s)
                self.tbt_hist.observe(m.tbt_s)

    @property
    def prefix_hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def prometheus(self, gauges: dict[str, float] | None = None) -> str:
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, help_: str, value: float, labels: str = "") -> None:
                lines.append(f"# HELP mooncake_{name} {help_}")
                lines.append(f"# TYPE mooncake_{name} {kind}")
                lines.append(f"mooncake_{name}{labels} {value:g}")

            metric("requests_total", "counter", "Requests submitted.", self.requests)
            metric("requests_finished_total", "counter", "Requests finished.", self.finished)
            metric("requests_rejected_total", "counter", "Requests rejected by the conductor (Overloaded).",
                   self.rejected)
            metric("requests_failed_total", "counter",
                   "Requests failed (instance lost, transfer failed, internal error, deadline passed).", self.failed)
            metric("requests_cancelled_total", "counter",
                   "Requests ended early on purpose (cancel: a stop string, a client gone); not failures.",
                   self.cancelled)
            metric("requests_timed_out_total", "counter",
                   "Requests that passed their deadline (also counted in requests_failed_total).", self.timed_out)
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
            metric("output_tokens_total", "counter", "Generated tokens of finished requests.", self.output_tokens)
            metric("reused_tokens_total", "counter", "Prompt tokens whose KV came from a store.", self.reused_tokens)
            metric("fetched_tokens_total", "counter", "Reused prompt tokens fetched from another instance.",
                   self.fetched_tokens)
            metric("computed_tokens_total", "counter", "Prompt tokens prefilled.", self.computed_tokens)
            metric("kv_transferred_bytes_total", "counter", "KV bytes moved between instances.",
                   self.transferred_bytes)
            for name, vals, hist, help_ in (
                    ("ttft_seconds", self.ttft, self.ttft_hist, "Time to first token"),
                    ("tbt_seconds", self.tbt, self.tbt_hist, "Per-request TBT (mean of the longest 10% intervals)")):
                lines.append(f"# HELP mooncake_{name} {help_}, quantiles of the last {RECENT_SAMPLES} requests.")
                lines.append(f"# TYPE mooncake_{name} summary")
                for q in (0.5, 0.9, 0.99):
                    v = percentile(vals, q)
                    lines.append(f'mooncake_{name}{{quantile="{q}"}} {0.0 if math.isnan(v) else v:g}')
                lines.append(f"mooncake_{name}_sum {sum(vals):g}")
                lines.append(f"mooncake_{name}_count {len(vals)}")
                lines.append(f"# HELP mooncake_request_{name} {help_}, every finished request.")
                lines.append(f"# TYPE mooncake_request_{name} histogram")
                lines.extend(hist.lines(f"mooncake_request_{name}"))
            # one TYPE line per family, its samples together (the text format allows one
            # TYPE per name; per-instance gauges arrive interleaved by instance)
            families: dict[str, list[str]] = {}
            for k, v in (gauges or {}).items():
                name, _, labels = k.partition("{")
                families.setdefault(name, []).append(f"mooncake_{name}{'{' + labels if labels else ''} {v:g}")
            for name, samples in families.items():
                lines.append(f"# TYPE mooncake_{name} gauge")
                lines.extend(samples)
            return "\n".join(lines) + "\n"
