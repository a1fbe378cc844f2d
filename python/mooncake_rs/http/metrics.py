"""The front's own counters, appended to the cluster's Prometheus text on ``/metrics``."""

from __future__ import annotations

import math
import threading
from collections import Counter


__all__ = ["FrontMetrics"]

_KEEP = 4096  # recent TTFT samples kept for the summary's quantiles


def _quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class FrontMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.responses: Counter[tuple[str, int]] = Counter()  # (route, status) -> count
        self.totals: Counter[str] = Counter()  # rejected, disconnects, stop_strings, prompt/completion tokens
        self.active_streams = 0
        self._ttft: list[float] = []
        self._ttft_sum = 0.0
        self._ttft_count = 0

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.totals[what] += n

    def response(self, route: str, status: int) -> None:
        with self._lock:
            self.responses[(route, status)] += 1

    def stream_delta(self, n: int) -> None:
        with self._lock:
            self.active_streams += n

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttft.append(seconds)
            if len(self._ttft) > 2 * _KEEP:
                del self._ttft[:-_KEEP]
            self._ttft_sum += seconds
            self._ttft_count += 1

    def prometheus(self) -> str:
        with self._lock:
            out = ["# HELP mooncake_front_responses_total HTTP responses of the OpenAI front by route and status.",
                   "# TYPE mooncake_front_responses_total counter"]
            for (route, status), n in sorted(self.responses.items()):
                out.append(f'mooncake_front_responses_total{{route="{route}",status="{status}"}} {n}')
            for name, key, help_ in (
                    ("front_rejected_total", "rejected", "Requests answered 429 (the conductor rejected them)."),
                    ("front_client_disconnects_total", "disconnects",
                     "Streams whose client went away before the end (their requests were cancelled)."),
                    ("front_stop_strings_total", "stop_strings", "Outputs ended by a stop string."),
                    ("front_prompt_tokens_total", "prompt_tokens", "Prompt tokens of requests the front answered."),
                    ("front_completion_tokens_total", "completion_tokens", "Tokens the front returned.")):
                out += [f"# HELP mooncake_{name} {help_}", f"# TYPE mooncake_{name} counter",
                        f"mooncake_{name} {self.totals[key]}"]
            out += ["# HELP mooncake_front_active_streams Streaming responses in progress.",
                    "# TYPE mooncake_front_active_streams gauge", f"mooncake_front_active_streams {self.active_streams}",
                    "# HELP mooncake_front_ttft_seconds Submit to first token at the front (recent requests).",
                    "# TYPE mooncake_front_ttft_seconds summary"]
            for q in (0.5, 0.9, 0.99):
                out.append(f'mooncake_front_ttft_seconds{{quantile="{q}"}} {_quantile(self._ttft[-_KEEP:], q):g}')
            out += [f"mooncake_front_ttft_seconds_sum {self._ttft_sum:g}",
                    f"mooncake_front_ttft_seconds_count {self._ttft_count}"]
            return "\n".join(out) + "\n"
