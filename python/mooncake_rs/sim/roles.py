"""The role-switch policy: when to move one instance between the prefill and the decode
pool, data in / data out (the simulator, or a cluster's control loop, applies it).

Inputs are the conductor's own view (``Conductor.snapshot``), not the simulator's
internals, so the same policy can run next to a real conductor:

- prefill pressure: the mean estimated queue (``queue_s``) of the prefill instances
  that take requests, as a share of the TTFT SLO;
- decode pressure: the mean occupancy of the decode instances that take requests, the
  largest of batch / ``max_batch``, reserved KV / capacity and predicted step time /
  TBT SLO.

A switch moves the least loaded instance of the cooler pool to the hotter one when the
hotter pool's pressure exceeds ``high`` while the cooler one's is below ``low``
(hysteresis: between the two nothing moves), at most one drain at a time, no sooner than
``min_dwell_s`` after the previous switch finished, and never below ``min_per_role``
instances in a pool. The instance is drained first (``Conductor.drain_instance``); it
changes role once it holds nothing (``Conductor.is_drained``) plus ``switch_s``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import InvalidArgument

__all__ = ["RolePolicy", "RoleSwitch", "pressures"]


@dataclass(frozen=True)
class RoleSwitch:
    """One decision: drain ``instance`` and then serve ``to_role`` ("prefill" | "decode")."""

    instance: int
    to_role: str


@dataclass(frozen=True)
class RolePolicy:
    #: a pool is hot above this pressure ...
    high: float = 0.6
    #: ... and may give an instance away below this one
    low: float = 0.3
    #: seconds between the end of one switch and the start of the next drain
    min_dwell_s: float = 30.0
    #: how often the load is checked (virtual seconds)
    check_every_s: float = 2.0
    #: seconds a drained instance is unavailable while it changes role
    switch_s: float = 1.0
    min_per_role: int = 1

    def __post_init__(self) -> None:
        for name in ("high", "low", "min_dwell_s", "switch_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise InvalidArgument(f"RolePolicy.{name} must be a finite number >= 0, got {v!r}")
        if not (isinstance(self.check_every_s, (int, float)) and math.isfinite(self.check_every_s) and self.check_every_s > 0):
            raise InvalidArgument(f"RolePolicy.check_every_s must be finite and > 0, got {self.check_every_s!r}")
        if self.low >= self.high:
            raise InvalidArgument(f"RolePolicy needs low < high (the hysteresis band), got low={self.low} high={self.high}")
        if isinstance(self.min_per_role, bool) or not isinstance(self.min_per_role, int) or self.min_per_role < 1:
            raise InvalidArgument(f"RolePolicy.min_per_role must be an integer >= 1, got {self.min_per_role!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def decide(
        self,
        snapshot: Any,
        ttft_slo_s: float,
        tbt_slo_s: float,
        draining: bool,
        now: float,
        last_switch_end: float,
    ) -> RoleSwitch | None:
        """The switch to start now, or None. ``snapshot`` is a ``ConductorSnapshot``
        (or anything with its ``prefill`` / ``decode`` lists), holding only instances
        that take requests; ``draining``: a drain is already under way."""
        if draining or now < last_switch_end + self.min_dwell_s:
            return None
        # instances marked draining (a ConductorSnapshot's loads say so) take nothing new
        snapshot = _View(
            [x for x in snapshot.prefill if not getattr(x, "draining", False)],
            [x for x in snapshot.decode if not getattr(x, "draining", False)],
        )
        p_load, d_load = pressures(snapshot, ttft_slo_s, tbt_slo_s)
        if p_load > self.high and d_load < self.low and len(snapshot.decode) > self.min_per_role:
            # the decode instance with the fewest members drains soonest
            d = min(snapshot.decode, key=lambda x: (x.batch, x.id))
            return RoleSwitch(d.id, "prefill")
        if d_load > self.high and p_load < self.low and len(snapshot.prefill) > self.min_per_role:
            p = min(snapshot.prefill, key=lambda x: (x.queued + x.running, x.queue_s, x.id))
            return RoleSwitch(p.id, "decode")
        return None


@dataclass(frozen=True)
class _View:
    prefill: list[Any]
    decode: list[Any]


def pressures(snapshot: Any, ttft_slo_s: float, tbt_slo_s: float) -> tuple[float, float]:
    """(prefill pressure, decode pressure) as the module docs define them (0 for an
    empty pool)."""
    ps, ds = snapshot.prefill, snapshot.decode
    p = sum(x.queue_s for x in ps) / len(ps) / ttft_slo_s if ps else 0.0
    d = (
        sum(
            max(x.batch / x.max_batch, x.kv_reserved_tokens / x.kv_capacity_tokens, x.est_tbt_s / tbt_slo_s)
            for x in ds
        )
        / len(ds)
        if ds
        else 0.0
    )
    return p, d
