"""Cost models for one long prompt prefilled on several instances: chunked pipeline
parallelism (CPP, the Mooncake paper's §3.3) against sequence parallelism (SP, ring
attention), side by side. Closed forms from the conductor's ``PrefillCostModel``
(``c0 + c_new*n + c_new2*n^2 + c_cross*n*p`` for one 8-GPU instance, every layer), so
both use the same per-token and per-pair costs; what differs is how the work and the
traffic split.

Assumptions (docs/sim.md, "Long prompts: chunked pipeline vs sequence parallel"):

- **CPP** over ``N`` instances: instance ``s`` holds layers ``s*L/N .. (s+1)*L/N`` (a
  pipeline stage). The prompt is cut into chunks of ``chunk`` tokens; chunk ``j`` (its
  ``chunk`` new tokens over ``j*chunk`` earlier ones) costs each stage
  ``(c_new*C + c_new2*C^2 + c_cross*C*j*C) / N + c0`` (a forward launch per chunk and
  stage), plus sending its activations (``C * act_bytes_per_token``) to the next stage.
  Stages run chunks in order (a chunk starts on a stage when the stage is free and its
  activations have arrived); with stage times growing along the prompt the last chunk
  leaves at ``sum_j s_j + (N - 1) * (s_last + hop)`` (equal chunks).
- **SP** over ``N`` instances: each holds all layers and ``n / N`` tokens (balanced
  zig-zag ordering, so each does ``1/N`` of the causal pairs). Compute
  ``c0 + (c_new*n + c_new2*n^2) / N``; per layer the KV of every shard circulates the
  ring, so each instance sends and receives ``(N-1)/N * n * bytes_per_token`` over its
  NIC; the transfer overlaps the attention (ring attention), so the time is
  ``max(compute, traffic / nic_bandwidth) + ring steps * latency`` with ``L * (N - 1)``
  steps.
- Neither counts sending the finished KV to a decode instance (both end with it spread
  over ``N`` instances, by layer for CPP and by token for SP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._core import PrefillCostModel
from ..errors import InvalidArgument

__all__ = ["LongPrefillModel", "cpp_time", "sp_time", "cpp_stage_times"]


@dataclass(frozen=True)
class LongPrefillModel:
    """The hardware both schemes run on (defaults: the conductor's LLaMA3-70B-class
    instance; activations are ``hidden * 2`` bytes a token, 8192 x bf16)."""

    prefill: PrefillCostModel | None = None
    num_layers: int = 80
    bytes_per_token: float = 327_680.0
    act_bytes_per_token: float = 16_384.0
    nic_bandwidth: float = 50e9
    latency_s: float = 10e-6

    def __post_init__(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise InvalidArgument(f"num_layers must be an integer >= 1, got {self.num_layers!r}")
        for f in ("bytes_per_token", "act_bytes_per_token", "nic_bandwidth"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise InvalidArgument(f"{f} must be a positive finite number, got {v!r}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise InvalidArgument(f"latency_s must be a finite number >= 0, got {self.latency_s!r}")

    @property
    def pm(self) -> PrefillCostModel:
        return self.prefill or PrefillCostModel()


def _check(n: int, instances: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgument(f"prompt tokens must be an integer >= 1, got {n!r}")
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
        raise InvalidArgument(f"instances must be an integer >= 1, got {instances!r}")


def cpp_stage_times(m: LongPrefillModel, n: int, instances: int, chunk: int) -> list[float]:
    """Seconds each chunk spends in one pipeline stage (chunks in prompt order)."""
    _check(n, instances)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InvalidArgument(f"chunk must be an integer >= 1, got {chunk!r}")
    pm = m.pm
    out = []
    done = 0
    while done < n:
        c = min(chunk, n - done)
        work = pm.c_new * c + pm.c_new2 * c * c + pm.c_cross * c * done
        out.append(work / instances + pm.c0)
        done += c
    return out


def cpp_time(m: LongPrefillModel, n: int, instances: int, chunk: int) -> float:
    """Seconds to prefill ``n`` tokens with chunked pipeline parallelism (module docs):
    the pipeline's recurrence, a chunk starting on a stage when that stage is free and
    its activations have arrived from the previous one."""
    times = cpp_stage_times(m, n, instances, chunk)
    sizes = [min(chunk, n - j * chunk) for j in range(len(times))]
    end = [0.0] * instances  # per stage, when its last chunk so far finished
    for st, c in zip(times, sizes):
        hop = c * m.act_bytes_per_token / m.nic_bandwidth + m.latency_s
        ready = 0.0
        for s in range(instances):
            start = max(end[s], ready)
            end[s] = start + st
            ready = end[s] + hop
    return end[-1]


def sp_time(m: LongPrefillModel, n: int, instances: int) -> float:
    """Seconds to prefill ``n`` tokens with sequence parallelism, ring attention."""
    _check(n, instances)
    pm = m.pm
    compute = pm.c0 + (pm.c_new * n + pm.c_new2 * n * n) / instances
    if instances == 1:
        return compute
    traffic = (instances - 1) / instances * n * m.bytes_per_token
    return max(compute, traffic / m.nic_bandwidth) + m.num_layers * (instances - 1) * m.latency_s
