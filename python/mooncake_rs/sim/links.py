"""Links as shared resources: concurrent transfers share capacities max-min fairly.

A *link* has a capacity (bytes/s): one direction of an instance's NIC, or its link to
the SSD tier. A *flow* moves a number of bytes across a fixed set of links (a path). At
any moment the rates of the active flows are the max-min fair allocation (progressive
filling): every flow's rate is limited by some saturated link on which no flow gets
more than it does. Rates change only when a flow starts or ends, so between those
moments every flow moves at a constant rate and the next completion is known exactly:
the simulator's event loop asks :meth:`Links.next_completion`, jumps there, and calls
:meth:`Links.advance` / :meth:`Links.pop_done`.

This module knows nothing of requests: a flow carries an opaque ``tag`` the caller
reads back when it completes. It is unit-tested on its own (conservation of bytes,
capacities respected, the max-min property) in tests/test_sim_links.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import InvalidArgument

__all__ = ["Flow", "Links"]

#: a flow is done when less than this share of its bytes is left: the completion time
#: is computed from the rate, and float rounding leaves crumbs
_REL_EPS = 1e-9


class Flow:
    """One transfer: ``size`` bytes across ``links``; ``rate`` is its current share."""

    __slots__ = ("id", "links", "size", "left", "rate", "tag", "start", "sent")

    def __init__(self, fid: int, links: tuple[int, ...], size: float, tag: object, start: float) -> None:
        self.id = fid
        self.links = links
        self.size = size
        self.left = size
        self.rate = 0.0
        self.tag = tag
        self.start = start
        #: bytes moved so far (sum of rate x time): equals ``size`` at completion
        self.sent = 0.0


class Links:
    """Links of fixed capacities shared max-min fairly by the flows crossing them."""

    def __init__(self, capacities: Sequence[float]) -> None:
        for c in capacities:
            if not (isinstance(c, (int, float)) and c > 0 and not math.isnan(c)):
                raise InvalidArgument(f"a link capacity must be a positive number of bytes/s, got {c!r}")
        self.cap = [float(c) for c in capacities]
        self.flows: dict[int, Flow] = {}
        #: flows on each link
        self.on: list[set[int]] = [set() for _ in self.cap]
        #: bytes each link has carried (for conservation checks)
        self.carried = [0.0] * len(self.cap)
        self.t = 0.0
        self._next_id = 0
        self._dirty = False

    # --- changes ---

    def add(self, t: float, links: Sequence[int], size: float, tag: object = None) -> Flow:
        """Starts a flow of ``size`` > 0 bytes across ``links`` (distinct link indices)
        at time ``t`` (not before the last change)."""
        path = tuple(links)
        if not path:
            raise InvalidArgument("a flow needs at least one link")
        if len(set(path)) != len(path):
            raise InvalidArgument(f"a flow crosses each link once, got {path}")
        for k in path:
            if not 0 <= k < len(self.cap):
                raise InvalidArgument(f"link {k} out of range 0..{len(self.cap) - 1}")
        if not (size > 0 and math.isfinite(size)):
            raise InvalidArgument(f"a flow's size must be a positive finite number of bytes, got {size!r}")
        self.advance(t)
        f = Flow(self._next_id, path, float(size), tag, t)
        self._next_id += 1
        self.flows[f.id] = f
        for k in path:
            self.on[k].add(f.id)
        self._dirty = True
        return f

    def advance(self, t: float) -> None:
        """Moves every active flow forward to time ``t`` at its current rate."""
        dt = t - self.t
        if dt < 0:
            if dt < -1e-9 * max(1.0, abs(t)):
                raise InvalidArgument(f"time went backwards: {t} < {self.t}")
            dt = 0.0
        if dt > 0 and self.flows:
            self.rates()
            carried = self.carried
            for f in self.flows.values():
                moved = f.rate * dt
                if moved > f.left:
                    moved = f.left
                f.left -= moved
                f.sent += moved
                for k in f.links:
                    carried[k] += moved
        if t > self.t:
            self.t = t

    def pop_done(self, t: float) -> list[Flow]:
        """Advances to ``t`` and removes the flows that have completed by then."""
        self.advance(t)
        done = []
        for f in self.flows.values():
            if f.left <= f.size * _REL_EPS or (f.rate > 0 and f.left / f.rate <= 1e-12 * max(1.0, t)):
                done.append(f)
        for f in done:
            # the crumbs left by rounding count as sent: a flow delivers all its bytes
            for k in f.links:
                self.carried[k] += f.left
                self.on[k].discard(f.id)
            f.sent += f.left
            f.left = 0.0
            del self.flows[f.id]
        if done:
            self._dirty = True
        return done

    # --- rates ---

    def rates(self) -> None:
        """Recomputes the max-min fair rates if a flow started or ended since the last time."""
        if not self._dirty:
            return
        self._dirty = False
        flows = self.flows
        if not flows:
            return
        on = self.on
        cap = self.cap
        left_cap: dict[int, float] = {}
        n: dict[int, int] = {}
        for f in flows.values():
            for k in f.links:
                if k in n:
                    n[k] += 1
                else:
                    n[k] = 1
                    left_cap[k] = cap[k]
        frozen: set[int] = set()
        while n:
            # the link whose equal share of what is left is the smallest is the next bottleneck
            best = -1
            share = math.inf
            for k, m in n.items():
                s = left_cap[k] / m
                if s < share:
                    share, best = s, k
            if share < 0:
                share = 0.0
            for fid in on[best]:
                if fid in frozen:
                    continue
                frozen.add(fid)
                f = flows[fid]
                f.rate = share
                for k in f.links:
                    left_cap[k] -= share
                    m = n[k] - 1
                    if m:
                        n[k] = m
                    else:
                        del n[k]

    def next_completion(self) -> float | None:
        """When the next active flow completes at the current rates (None: no flow)."""
        if not self.flows:
            return None
        self.rates()
        best = math.inf
        for f in self.flows.values():
            if f.rate > 0:
                x = f.left / f.rate
                if x < best:
                    best = x
        return self.t + best if best < math.inf else None

    def used(self, k: int) -> float:
        """Bytes/s link ``k`` carries now."""
        self.rates()
        return sum(self.flows[fid].rate for fid in self.on[k])

    def free(self, k: int) -> float:
        """Bytes/s left on link ``k`` at the current rates (never below 0)."""
        return max(0.0, self.cap[k] - self.used(k))
