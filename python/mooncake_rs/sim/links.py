"""Links as shared resources: concurrent transfers share capacities max-min fairly.

A *link* has a capacity (bytes/s): one direction of an instance's NIC, or its link to
the SSD tier. A *flow* moves a number of bytes across a fixed set of links (a path). At
any moment the rates of the active flows are the max-min fair allocation (progressive
filling): every flow's rate is limited by some saturated link on which no flow gets
more than it does. Rates change only when a flow starts or ends, so between those
moments every flow moves at a constant rate and the next completion is known exactly:
the simulator's event loop asks :meth:`Links.next_completion`, jumps there, and calls
:meth:`Links.advance` / :meth:`Links.pop_done`.

Cost: a change re-solves only the flows connected to it through shared links (a
storage link with its own reads and writes is a component on its own), and a flow's
bytes are settled only when its rate changes, so an event costs the size of the
component it touches, not of the whole network; completions come off a heap.

This module knows nothing of requests: a flow carries an opaque ``tag`` the caller
reads back when it completes. It is unit-tested on its own (conservation of bytes,
capacities respected, the max-min property) in tests/test_sim_links.py.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from ..errors import InvalidArgument

__all__ = ["Flow", "Links"]

#: a flow is done when less than this share of its bytes is left: the completion time
#: is computed from the rate, and float rounding leaves crumbs
_REL_EPS = 1e-9


class Flow:
    """One transfer: ``size`` bytes across ``links``; ``rate`` is its current share."""

    __slots__ = ("id", "links", "size", "left", "rate", "tag", "start", "sent", "t0", "stamp")

    def __init__(self, fid: int, links: tuple[int, ...], size: float, tag: object, start: float) -> None:
        self.id = fid
        self.links = links
        self.size = size
        #: bytes left as of ``t0`` (the last time its rate changed)
        self.left = size
        self.rate = 0.0
        self.tag = tag
        self.start = start
        #: bytes moved as of ``t0`` (sum of rate x time): equals ``size`` at completion
        self.sent = 0.0
        self.t0 = start
        #: bumped at every rate change: older heap entries of this flow are stale
        self.stamp = 0


class Links:
    """Links of fixed capacities shared max-min fairly by the flows crossing them."""

    def __init__(self, capacities: Sequence[float]) -> None:
        for c in capacities:
            if isinstance(c, bool) or not (isinstance(c, (int, float)) and c > 0 and not math.isnan(c)):
                raise InvalidArgument(f"a link capacity must be a positive number of bytes/s, got {c!r}")
        self.cap = [float(c) for c in capacities]
        self.flows: dict[int, Flow] = {}
        #: flows on each link
        self.on: list[set[int]] = [set() for _ in self.cap]
        #: bytes each link has carried, as of the last settlement of its flows
        self.carried = [0.0] * len(self.cap)
        self.t = 0.0
        self._next_id = 0
        #: links whose flows changed since the rates were last solved
        self._dirty: set[int] = set()
        #: (completion time, stamp, flow id)
        self._heap: list[tuple[float, int, int]] = []

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
        return self.add_unchecked(t, path, float(size), tag)

    def add_unchecked(self, t: float, path: tuple[int, ...], size: float, tag: object = None) -> Flow:
        """:meth:`add` for a caller that guarantees valid arguments (the simulator's hot path)."""
        self.advance(t)
        f = Flow(self._next_id, path, size, tag, self.t)
        self._next_id += 1
        self.flows[f.id] = f
        for k in path:
            self.on[k].add(f.id)
        self._dirty.update(path)
        return f

    def extend(self, t: float, f: Flow, size: float) -> None:
        """Adds ``size`` bytes to the active flow ``f`` at time ``t`` (a queue of writes
        nobody waits on, kept as one flow). Rates do not depend on sizes, so nothing is
        re-solved: only ``f``'s completion moves."""
        if f.id not in self.flows:
            raise InvalidArgument(f"flow {f.id} is not active")
        if not (size > 0 and math.isfinite(size)):
            raise InvalidArgument(f"a flow's size must be a positive finite number of bytes, got {size!r}")
        self.advance(t)
        self._settle(f)
        f.left += size
        f.size += size
        if f.rate > 0 and f.stamp:
            f.stamp += 1
            heapq.heappush(self._heap, (self.t + f.left / f.rate, f.stamp, f.id))

    def remove(self, t: float, f: Flow) -> None:
        """Stops the active flow ``f`` at time ``t`` (a transfer given up): what it moved
        so far stays carried, the rest is never sent, the others' rates are re-solved."""
        if f.id not in self.flows:
            raise InvalidArgument(f"flow {f.id} is not active")
        self.advance(t)
        self._settle(f)
        for k in f.links:
            self.on[k].discard(f.id)
        del self.flows[f.id]
        f.rate = 0.0
        self._dirty.update(f.links)

    def left_now(self, f: Flow) -> float:
        """Bytes ``f`` still has to move at the current time (at its current rate)."""
        self.rates()
        return max(0.0, f.left - f.rate * (self.t - f.t0))

    def queued(self, k: int) -> float:
        """Bytes the active flows on link ``k`` still have to move (what an instance's
        transfer engine would report as queued or in flight on that link)."""
        left_now = self.left_now
        flows = self.flows
        return sum(left_now(flows[fid]) for fid in self.on[k])

    def advance(self, t: float) -> None:
        """Moves the clock to ``t`` (flows move at their rates; bytes are settled lazily)."""
        if t < self.t:
            if t < self.t - 1e-9 * max(1.0, abs(t)):
                raise InvalidArgument(f"time went backwards: {t} < {self.t}")
            return
        self.t = t

    def _settle(self, f: Flow) -> None:
        dt = self.t - f.t0
        if dt > 0 and f.rate > 0:
            moved = f.rate * dt
            if moved > f.left:
                moved = f.left
            f.left -= moved
            f.sent += moved
            carried = self.carried
            for k in f.links:
                carried[k] += moved
        f.t0 = self.t

    def pop_done(self, t: float) -> list[Flow]:
        """Advances to ``t`` and removes the flows that have completed by then."""
        self.advance(t)
        self.rates()
        heap, flows = self._heap, self.flows
        limit = self.t + 1e-12 * max(1.0, abs(self.t))
        done = []
        while heap and heap[0][0] <= limit:
            _, stamp, fid = heapq.heappop(heap)
            f = flows.get(fid)
            if f is None or f.stamp != stamp:
                continue
            self._settle(f)
            # the crumbs left by rounding count as sent: a flow delivers all its bytes
            for k in f.links:
                self.carried[k] += f.left
                self.on[k].discard(fid)
            f.sent += f.left
            f.left = 0.0
            f.rate = 0.0
            del flows[fid]
            self._dirty.update(f.links)
            done.append(f)
        return done

    # --- rates ---

    def rates(self) -> None:
        """Re-solves the max-min fair rates of the flows connected to a change."""
        if not self._dirty:
            return
        flows, on, cap = self.flows, self.on, self.cap
        # the components touched: links and flows reachable from a changed link
        comp_links: set[int] = set()
        comp_flows: set[int] = set()
        stack = [k for k in self._dirty if on[k]]
        self._dirty = set()
        while stack:
            k = stack.pop()
            if k in comp_links:
                continue
            comp_links.add(k)
            for fid in on[k]:
                if fid not in comp_flows:
                    comp_flows.add(fid)
                    for j in flows[fid].links:
                        if j not in comp_links:
                            stack.append(j)
        if not comp_flows:
            return
        new: dict[int, float] = {}
        if len(comp_links) == 1:
            (k,) = comp_links
            share = cap[k] / len(comp_flows)
            for fid in comp_flows:
                new[fid] = share
        else:
            left_cap = {k: cap[k] for k in comp_links}
            n = {k: len(on[k]) for k in comp_links}
            while n:
                # the link whose equal share of what is left is smallest is the next bottleneck
                best = -1
                share = math.inf
                for k, m in n.items():
                    x = left_cap[k] / m
                    if x < share:
                        share, best = x, k
                if share < 0:
                    share = 0.0
                for fid in on[best]:
                    if fid in new:
                        continue
                    new[fid] = share
                    for k in flows[fid].links:
                        left_cap[k] -= share
                        m = n[k] - 1
                        if m:
                            n[k] = m
                        else:
                            del n[k]
        heap, t = self._heap, self.t
        settle = self._settle
        for fid, r in new.items():
            f = flows[fid]
            if r == f.rate and f.stamp:
                continue  # unchanged: its bytes need no settling, its heap entry holds
            settle(f)  # what it moved at its old rate
            f.rate = r
            f.stamp += 1
            if r > 0:
                heapq.heappush(heap, (t + f.left / r, f.stamp, fid))

    def next_completion(self) -> float | None:
        """When the next active flow completes at the current rates (None: no flow)."""
        self.rates()
        heap, flows = self._heap, self.flows
        while heap:
            tc, stamp, fid = heap[0]
            f = flows.get(fid)
            if f is not None and f.stamp == stamp:
                return tc
            heapq.heappop(heap)
        return None

    def used(self, k: int) -> float:
        """Bytes/s link ``k`` carries now."""
        self.rates()
        flows = self.flows
        return sum(flows[fid].rate for fid in self.on[k])

    def free(self, k: int) -> float:
        """Bytes/s left on link ``k`` at the current rates (never below 0)."""
        return max(0.0, self.cap[k] - self.used(k))
