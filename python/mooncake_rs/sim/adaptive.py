"""The disaggregated cluster with adaptive roles (``SimConfig(adaptive_roles=True)``).

Every instance can serve either role, so each keeps a prefill FIFO, a cache and a
decode batch, indexed by its id (instances ``0..P-1`` start as prefill, ``P..P+D-1`` as
decode). Every ``RolePolicy.check_every_s`` (checked between arrivals) the policy
(:mod:`.roles`) reads the conductor's snapshot and may pick one instance to switch. The
switch goes through the conductor: ``drain_instance`` (no new request goes there; what it
holds runs to its end as usual) -> ``is_drained`` -> ``switch_s`` seconds unavailable ->
``switch_role``. A prefill instance counts as drained once nothing is queued or
prefilling on it: the KV streams of its finished prefills keep their modelled end time
(the stream is not cut by the switch). Its cache and the conductor's index entries stay:
peers may still fetch its blocks, and they are there if it becomes a prefill instance
again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from .batching import ContinuousBatch
from .config import SimConfig
from .disaggregated import _Run
from .loop import Progress, make_caches
from .report import HotSample, Report
from .roles import RolePolicy
from .trace import Request

__all__ = ["_AdaptiveRun"]

#: the drained instance changes role (a = instance); the base loop's kinds are 0..2
_SWITCH = 16


class _AdaptiveRun(_Run):
    def __init__(self, cfg: SimConfig, trace: Sequence[Request], progress: Progress | None) -> None:
        super().__init__(cfg, trace, progress)
        n = cfg.prefill + cfg.decode
        self.doff = 0
        self.caches = make_caches(cfg, n, trace)
        self.init_lines(n)
        self.batches = [ContinuousBatch(self.dm) for _ in range(n)]
        self.pending = [[] for _ in range(n)]
        self.waiting = [deque() for _ in range(n)]
        self.kv_used = [0] * n
        self.role = ["prefill"] * cfg.prefill + ["decode"] * cfg.decode
        self.policy: RolePolicy = cfg.role_policy if cfg.role_policy is not None else RolePolicy()
        #: the switch under way: (instance, new role, switch event pushed)
        self.drain: tuple[int, str, bool] | None = None
        self.next_check = 0.0
        self.last_switch_end = float("-inf")
        #: (time, instance, new role) of every finished switch
        self.role_events: list[tuple[float, int, str]] = []

    # --- the policy ---

    def before_arrival(self, t: float) -> None:
        super().before_arrival(t)
        if t >= self.next_check:
            self.next_check = t + self.policy.check_every_s
            self.consider(t)

    def consider(self, t: float) -> None:
        if self.drain is not None:
            return
        snap = self.conductor.snapshot(t)
        cfg = self.cfg
        sw = self.policy.decide(snap, cfg.ttft_slo_s, cfg.tbt_slo_s, False, t, self.last_switch_end)
        if sw is None:
            return
        self.conductor.drain_instance(sw.instance)
        self.drain = (sw.instance, sw.to_role, False)
        self.check_drained(t)

    def idle(self, k: int) -> bool:
        """Nothing of ``k``'s current role is left in the simulated instance."""
        if self.role[k] == "prefill":
            return self.prefill_idle(k)
        return self.batches[k].n == 0 and not self.waiting[k] and not self.pending[k]

    def check_drained(self, t: float) -> None:
        assert self.drain is not None
        k, role, pushed = self.drain
        if pushed or not self.conductor.is_drained(k):
            return
        # the conductor's view and the simulated instance agree (a test would catch a drift)
        assert self.idle(k), f"instance {k} drained in the conductor but busy in the simulator"
        self.drain = (k, role, True)
        self.push(t + self.policy.switch_s, _SWITCH, k)

    def switch(self, k: int, t: float) -> None:
        assert self.drain is not None and self.drain[0] == k
        role = self.drain[1]
        cfg = self.cfg
        self.conductor.switch_role(k, role, max_batch=cfg.decode_max_batch, kv_capacity_tokens=cfg.decode_kv_capacity_tokens)
        self.role[k] = role
        self.drain = None
        self.last_switch_end = t
        self.role_events.append((t, k, role))

    def handle(self, t: float, kind: int, a: int, b: int, c: int) -> None:
        if kind == _SWITCH:
            self.switch(a, t)
            return
        super().handle(t, kind, a, b, c)
        if self.drain is not None and not self.drain[2]:
            self.check_drained(t)

    def report(self, samples: list[HotSample], wall: float) -> Report:
        rep = super().report(samples, wall)
        rep.role_switches = len(self.role_events)
        rep.role_events = list(self.role_events)
        return rep
