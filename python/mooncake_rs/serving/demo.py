"""``mooncake-rs demo``: an embedded disaggregated cluster serving a multi-turn chat trace.

2 prefill + 1 decode instances of the tiny model on CPU replay a generated trace
(conversations sharing a few system prompts, each turn extending the last), with the
conductor's prefill model calibrated on the real engine first. Prints TTFT and TBT
p50/p99, prefix hit rate, reused vs computed prompt tokens, cross-instance fetches and
rejections; then replays the same trace with prefix reuse disabled for comparison.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm import tqdm

from ..errors import Overloaded
from ..workload import ChatWorkload, generate_chat_workload
from .metrics import percentile

__all__ = ["run", "ServingReport"]


@dataclass
class ServingReport:
    label: str
    requests: int
    finished: int
    rejected: int
    failed: int
    ttft: list[float]
    tbt: list[float]
    prompt_tokens: int
    reused_tokens: int
    fetched_tokens: int
    computed_tokens: int
    transferred_bytes: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def lines(self) -> list[str]:
        ms = lambda v: f"{v * 1e3:8.1f} ms"  # noqa: E731
        return [
            f"== {self.label}: {self.finished}/{self.requests} requests in {self.seconds:.1f} s "
            f"({self.rejected} rejected, {self.failed} failed)",
            f"   TTFT  p50 {ms(percentile(self.ttft, 0.5))}   p99 {ms(percentile(self.ttft, 0.99))}",
            f"   TBT   p50 {ms(percentile(self.tbt, 0.5))}   p99 {ms(percentile(self.tbt, 0.99))}",
            f"   prefix hit rate {self.hit_rate:6.1%}   reused {self.reused_tokens} tokens "
            f"(fetched from another instance: {self.fetched_tokens}) vs computed {self.computed_tokens}",
            f"   KV moved between instances: {self.transferred_bytes / 1e6:.1f} MB",
        ]


def _replay(label: str, trace: list, *, prefix_reuse: bool, processes: bool, speedup: float, progress: bool,
            seed: int, calibrate: bool) -> ServingReport:
    from ..engine import SamplingParams
    from .cluster import Cluster

    with Cluster("tiny", prefill=2, decode=1, block_size=16, dram_bytes_per_instance=32 << 20, seed=seed,
                 processes=processes, prefix_reuse=prefix_reuse, rejection="early", ttft_slo_s=5.0,
                 tbt_slo_s=1.0) as c:
        if calibrate:
            c.calibrate(repeats=1)
        handles = []
        rejected = failed = 0
        bar = tqdm(total=len(trace), desc=label, unit="req", disable=not progress, leave=False)
        t0 = time.monotonic()
        for r in trace:
            wait = r.arrival_s / speedup - (time.monotonic() - t0)
            if wait > 0:
                time.sleep(wait)
            try:
                h = c.submit(r.prompt, SamplingParams(max_tokens=r.output_len, ignore_eos=True))
                handles.append(h)
            except Overloaded:
                rejected += 1
                bar.update(1)
            for h in [h for h in handles if h.done and not getattr(h, "_counted", False)]:
                h._counted = True  # type: ignore[attr-defined]
                bar.update(1)
        outs = []
        for h in handles:
            try:
                outs.append(h.result(600))
            except Exception:  # noqa: BLE001 - counted below
                failed += 1
            if not getattr(h, "_counted", False):
                bar.update(1)
        bar.close()
        secs = time.monotonic() - t0
    ms = [o.metrics for o in outs]
    return ServingReport(label, len(trace), len(outs), rejected, failed, [m.ttft_s for m in ms],
                         [m.tbt_s for m in ms if m.output_tokens > 1], sum(m.prompt_tokens for m in ms),
                         sum(m.reused_tokens for m in ms), sum(m.fetched_tokens for m in ms),
                         sum(m.computed_tokens for m in ms), sum(m.transferred_bytes for m in ms), secs)


def run(conversations: int = 32, turns: int = 5, seed: int = 0, processes: bool = False, speedup: float = 1.0,
        progress: bool = True, compare: bool = True, calibrate: bool = True) -> list[ServingReport]:
    """Replays the trace with prefix reuse (and, with ``compare``, without); prints and returns the reports."""
    cfg = ChatWorkload(conversations=conversations, turns=turns, system_prompts=3, system_prompt_len=384,
                       user_len=(16, 96), output_len=(8, 32), vocab=256, mean_interarrival_s=0.12, seed=seed)
    trace = generate_chat_workload(cfg)
    print(f"mooncake-rs demo: {len(trace)} requests ({conversations} conversations x {turns} turns, "
          f"3 shared system prompts), 2 prefill + 1 decode instances of the tiny model on CPU"
          f"{' (worker processes)' if processes else ''}")
    reports = [_replay("prefix reuse", trace, prefix_reuse=True, processes=processes, speedup=speedup,
                       progress=progress, seed=seed, calibrate=calibrate)]
    for ln in reports[0].lines():
        print(ln)
    if compare:
        reports.append(_replay("no prefix reuse", trace, prefix_reuse=False, processes=processes, speedup=speedup,
                               progress=progress, seed=seed, calibrate=calibrate))
        for ln in reports[1].lines():
            print(ln)
        a, b = reports
        p50 = lambda r: percentile(r.ttft, 0.5)  # noqa: E731
        # both sides and the direction: on a loaded machine reuse can lose on TTFT, and
        # "0.5x lower" would read as a gain
        ratio = p50(b) / p50(a)
        change = f"{ratio:.2f}x lower" if ratio >= 1 else f"{1 / ratio:.2f}x higher"
        print(f"== prefix reuse: TTFT p50 {p50(a) * 1e3:.1f} ms vs {p50(b) * 1e3:.1f} ms without ({change}), "
              f"{b.computed_tokens / max(a.computed_tokens, 1):.2f}x fewer prompt tokens computed")
    return reports
