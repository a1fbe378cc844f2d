"""What a simulation run measured: per-request results, summary figures, plots."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Report", "RequestResult", "HotSample"]


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request. Times are virtual seconds from the start of the trace; the timing
    fields are None for a rejected request. ``tbt_s`` is the mean gap between the
    request's tokens, from the first (the end of its prefill) to the last: the KV
    transfer and any wait for room in a decode batch count in it (0.0 when the request
    produces at most one token)."""

    id: int
    arrival_s: float
    input_length: int
    output_length: int
    prompt_blocks: int
    rejected: str | None
    prefill_instance: int | None
    decode_instance: int | None
    reused_blocks: int
    fetched_blocks: int
    prefill_start_s: float | None
    ttft_s: float | None
    tbt_s: float | None
    finish_s: float | None
    #: the longest gap between two of its tokens (a stall counts whole here)
    max_gap_s: float | None = None


@dataclass(frozen=True, slots=True)
class HotSample:
    """Replica counts of the most-reused blocks at time ``t_s``."""

    t_s: float
    blocks: tuple[int, ...]
    hits: tuple[int, ...]
    replicas: tuple[int, ...]


def _quantile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Report:
    """A run's results. Summary fields are over the requests that ran (not rejected),
    except ``effective_request_capacity`` (over all requests: a rejected request does
    not meet its SLOs) and ``rejected``."""

    requests: list[RequestResult]
    ttft_slo_s: float
    tbt_slo_s: float
    prefill_compute_s: float
    hot_samples: list[HotSample] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    peak_rss_mb: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)
    #: seconds prefill instances spent waiting for KV loads (prefix fetches, SSD reads)
    #: before computing, summed over requests
    io_wait_s: float = 0.0
    #: seconds of prefill (waiting for loads + computing), summed over requests
    prefill_busy_s: float = 0.0
    #: bytes of prefix KV loaded into prefill instances, by path (filled with the link
    #: model on: ``dram_local``, ``dram_peer``, ``ssd_direct``, ``ssd_relay``)
    bytes_loaded_per_path: dict[str, int] = field(default_factory=dict)
    #: with ``adaptive_roles``: finished role switches, and each as (time, instance, new role)
    role_switches: int = 0
    role_events: list[tuple[float, int, str]] = field(default_factory=list)

    @property
    def io_wait_fraction(self) -> float:
        """Share of prefill time spent waiting on KV loads (0 when nothing ran)."""
        return self.io_wait_s / self.prefill_busy_s if self.prefill_busy_s > 0 else 0.0

    @property
    def throughput_rps(self) -> float:
        """Requests completed per virtual second, from the first arrival to the last finish."""
        done = [r for r in self.requests if r.finish_s is not None]
        if not done:
            return 0.0
        span = max(r.finish_s for r in done if r.finish_s is not None) - min(r.arrival_s for r in self.requests)
        return len(done) / span if span > 0 else math.inf

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.requests if r.rejected is None]

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft_s for r in self.requests if r.ttft_s is not None]

    @property
    def tbts(self) -> list[float]:
        return [r.tbt_s for r in self.requests if r.tbt_s is not None and r.output_length > 1]

    @property
    def mean_ttft_s(self) -> float:
        t = self.ttfts
        return sum(t) / len(t) if t else math.nan

    @property
    def p90_ttft_s(self) -> float:
        return _quantile(self.ttfts, 0.9)

    @property
    def p99_ttft_s(self) -> float:
        return _quantile(self.ttfts, 0.99)

    @property
    def mean_tbt_s(self) -> float:
        t = self.tbts
        return sum(t) / len(t) if t else math.nan

    @property
    def p90_tbt_s(self) -> float:
        return _quantile(self.tbts, 0.9)

    @property
    def p90_max_gap_s(self) -> float:
        """90th percentile over requests of each one's longest token gap."""
        return _quantile([r.max_gap_s for r in self.requests if r.max_gap_s is not None and r.output_length > 1], 0.9)

    def capacity_at(self, tbt_slo_s: float, ttft_slo_s: float | None = None, worst_gap: bool = False) -> float:
        """Effective request capacity under other SLOs; ``worst_gap`` judges each
        request by its longest token gap instead of its mean."""
        ttft = self.ttft_slo_s if ttft_slo_s is None else ttft_slo_s
        if not self.requests:
            return math.nan
        ok = 0
        for r in self.requests:
            if r.rejected is None and r.ttft_s is not None and r.ttft_s <= ttft:
                g = (r.max_gap_s if worst_gap else r.tbt_s) or 0.0
                ok += g <= tbt_slo_s
        return ok / len(self.requests)

    @property
    def rejected(self) -> int:
        return sum(1 for r in self.requests if r.rejected is not None)

    def meets_slo(self, r: RequestResult) -> bool:
        return (
            r.rejected is None
            and r.ttft_s is not None
            and r.ttft_s <= self.ttft_slo_s
            and (r.tbt_s or 0.0) <= self.tbt_slo_s
        )

    @property
    def effective_request_capacity(self) -> float:
        """Share of all requests that met both the TTFT and the TBT SLO."""
        if not self.requests:
            return math.nan
        return sum(1 for r in self.requests if self.meets_slo(r)) / len(self.requests)

    @property
    def cache_hit_rate(self) -> float:
        """Share of the prompt blocks (full blocks) of the requests that ran that were reused."""
        done = self.completed
        total = sum(r.prompt_blocks for r in done)
        return sum(r.reused_blocks for r in done) / total if total else 0.0

    @property
    def makespan_s(self) -> float:
        ends = [r.finish_s for r in self.requests if r.finish_s is not None]
        return max(ends) if ends else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self.requests),
            "rejected": self.rejected,
            "mean_ttft_s": self.mean_ttft_s,
            "p90_ttft_s": self.p90_ttft_s,
            "p99_ttft_s": self.p99_ttft_s,
            "mean_tbt_s": self.mean_tbt_s,
            "p90_tbt_s": self.p90_tbt_s,
            "p90_max_gap_s": self.p90_max_gap_s,
            "effective_request_capacity": self.effective_request_capacity,
            "cache_hit_rate": self.cache_hit_rate,
            "prefill_compute_s": self.prefill_compute_s,
            "makespan_s": self.makespan_s,
            "ttft_slo_s": self.ttft_slo_s,
            "tbt_slo_s": self.tbt_slo_s,
            "wall_s": self.wall_s,
            "peak_rss_mb": self.peak_rss_mb,
            **{f"count_{k}": v for k, v in self.counters.items()},
            # only with the link model on, so that other reports read as before
            **(
                {
                    "io_wait_fraction": self.io_wait_fraction,
                    "throughput_rps": self.throughput_rps,
                    **{f"bytes_{k}": v for k, v in self.bytes_loaded_per_path.items()},
                }
                if self.bytes_loaded_per_path
                else {}
            ),
            # only with adaptive roles on, for the same reason
            **({"role_switches": self.role_switches} if self.config.get("adaptive_roles") else {}),
        }

    def to_json(self, per_request: bool = True) -> str:
        """The summary, the config, hot-block samples and (by default) every request."""

        def clean(v: Any) -> Any:
            return None if isinstance(v, float) and not math.isfinite(v) else v

        doc: dict[str, Any] = {
            "summary": {k: clean(v) for k, v in self.summary().items()},
            "config": self.config,
            "hot_blocks": [
                {"t_s": s.t_s, "blocks": list(s.blocks), "hits": list(s.hits), "replicas": list(s.replicas)}
                for s in self.hot_samples
            ],
        }
        if per_request:
            fields = RequestResult.__slots__
            doc["requests"] = {"fields": list(fields), "rows": [[getattr(r, f) for f in fields] for r in self.requests]}
        return json.dumps(doc)

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Writes a PNG: TTFT and TBT distributions, TTFT over time, hot-block replicas."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
        for a, xs, slo, name in ((ax[0][0], self.ttfts, self.ttft_slo_s, "TTFT"), (ax[0][1], self.tbts, self.tbt_slo_s, "TBT")):
            s = sorted(xs)
            if s:
                a.plot(s, [(i + 1) / len(s) for i in range(len(s))])
            a.axvline(slo, color="red", linestyle="--", label=f"SLO {slo:g}s")
            a.set_xlabel(f"{name} (s)")
            a.set_ylabel("share of requests")
            a.set_title(f"{name} CDF")
            a.legend()
        done = [r for r in self.requests if r.ttft_s is not None]
        ax[1][0].scatter([r.arrival_s for r in done], [r.ttft_s for r in done], s=2)
        rej = [r.arrival_s for r in self.requests if r.rejected is not None]
        if rej:
            ax[1][0].scatter(rej, [0.0] * len(rej), s=2, color="red", label=f"rejected ({len(rej)})")
            ax[1][0].legend()
        ax[1][0].set_xlabel("arrival (s)")
        ax[1][0].set_ylabel("TTFT (s)")
        ax[1][0].set_title("TTFT over time")
        if self.hot_samples:
            ts = [s.t_s for s in self.hot_samples]
            mean = [sum(s.replicas) / len(s.replicas) if s.replicas else 0 for s in self.hot_samples]
            top = [max(s.replicas) if s.replicas else 0 for s in self.hot_samples]
            ax[1][1].plot(ts, mean, label="mean over hot blocks")
            ax[1][1].plot(ts, top, label="max")
            ax[1][1].legend()
        ax[1][1].set_xlabel("time (s)")
        ax[1][1].set_ylabel("replicas")
        ax[1][1].set_title("replicas of the hottest blocks")
        summ = self.summary()
        fig.suptitle(
            f"{self.config.get('architecture', '')} {self.config.get('policy', '')}: mean TTFT {summ['mean_ttft_s']:.2f}s,"
            f" p90 {summ['p90_ttft_s']:.2f}s, mean TBT {summ['mean_tbt_s'] * 1000:.1f}ms,"
            f" capacity {summ['effective_request_capacity']:.1%}, hit {summ['cache_hit_rate']:.1%}, rejected {summ['rejected']}"
        )
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=100)
        plt.close(fig)
