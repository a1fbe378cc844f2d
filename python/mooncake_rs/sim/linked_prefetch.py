"""Prefetch at decision time on the link model: the part of the linked cluster's run
(:mod:`.linked`) that starts a request's peer load at its admission and picks it up at
its dequeue.

A prefetched load uses the same links and flows as a load at dequeue (the holder's NIC
out and the prefill's NIC in; a peer's SSD blocks through the prefill's own storage
link); while the request is queued, the end of its loads starts nothing. At dequeue,
the prefetch is used when it extends the instance's own prefix (``lo <= local <
end``): what is left of it is waited for (set aside: the instance computes other
requests meanwhile), its own SSD blocks load when it takes the instance, and the
late-fetch check comes ``fetch_abandon_s`` later. Otherwise (a gap before the
staged blocks, or its own prefix grew past them) the prefetch's flows are removed,
their unsent bytes uncounted, and the fetch runs at dequeue as without prefetch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .links import Flow
from .tiers import prefix_runs, split_runs

__all__ = ["PrefetchLoads", "path_of"]


class PrefetchLoads:
    """Mixed into the linked run (which provides the links, caches, counters and the
    load, compute and abandon steps used here)."""

    net: Any
    caches: Any
    ssd: Any
    keys: Any
    s: Any
    cfg: Any
    counters: dict[str, int]
    bytes: dict[str, int]
    block_bytes: float
    outstanding: list[int]
    abandon_s: list[float]
    peer_loads: dict[int, tuple[int, int, list[Flow]]]
    hits: Any
    _net_touched: bool
    #: admitted with a prefetch and not dequeued yet (its loads' end starts nothing)
    in_queue: list[bool]
    #: per request with a prefetch under way: (first fetched block, end block, its flows)
    prefetch_flows: dict[int, tuple[int, int, list[Flow]]]

    if TYPE_CHECKING:  # provided by the linked run

        def load_ssd(self, t: float, i: int, p: int, d: int, nbytes: float, kind: int = 0) -> int: ...
        def load_peer(self, t: float, i: int, p: int, src: int, rng: Sequence[int], nbytes: float) -> int: ...
        def join(self, p: int, i: int, t: float) -> None: ...
        def set_aside(self, p: int, i: int) -> None: ...
        def abandon_due(self, i: int, t: float) -> None: ...
        def store(self, p: int, keys: Sequence[int], t: float) -> None: ...

    def start_prefetch(self, i: int, d: Any, t: float) -> None:
        """Request ``i``'s peer load starts at its admission ``t`` (``d`` its decision),
        for the part of the planned range its holder has now."""
        src, p = d.fetch_from, d.prefill
        lo = d.reused_blocks - d.fetch_blocks
        keys = self.keys[i]
        sruns = prefix_runs(self.caches[src], self.ssd[src], keys[: d.reused_blocks])
        held = sum(n for n, _ in sruns)
        if held <= lo:
            return  # nothing there yet: fetched at dequeue
        peer_dram, peer_ssd = split_runs(sruns, lo, held)
        bb = self.block_bytes
        before = set(self.net.flows)
        n = 0
        if peer_ssd:
            n += self.load_ssd(t, i, p, d.decode, peer_ssd * bb)
        if peer_dram:
            n += self.load_peer(t, i, p, src, keys[lo:held], peer_dram * bb)
        self.prefetch_flows[i] = (lo, held, [f for fid, f in self.net.flows.items() if fid not in before])
        self.outstanding[i] = n
        self.in_queue[i] = True
        self.counters["prefetches"] += 1

    def prefetch_loaded(self, i: int, t: float) -> None:
        """Request ``i``'s prefetch has arrived while it is queued: its blocks are stored
        in its instance's DRAM and reported: the index learns the replica now (not at
        admission), and peers may fetch it from there."""
        entry = self.prefetch_flows.get(i)
        d = self.s.prefill[i]
        if entry is not None and d is not None:
            lo, held, _ = entry
            self.store(d, self.keys[i][lo:held], t)

    def take_prefetch(self, i: int, t: float, local: int) -> tuple[int, list[Flow]] | None:
        """At dequeue: request ``i``'s prefetch, as (its end block, its flows still
        running), when it extends the ``local`` prefix; otherwise its flows are removed
        and None returned (the fetch then runs at dequeue)."""
        self.in_queue[i] = False
        entry = self.prefetch_flows.pop(i, None)
        if entry is None:
            return None
        lo, held, flows = entry
        net = self.net
        live = [f for f in flows if f.id in net.flows]
        if lo <= local < held:
            return held, live
        if not live and local >= held:
            return None  # arrived before its dequeue: its blocks are local (prefetch_loaded)
        self.counters["prefetch_unused"] += 1
        if live:
            net.advance(t)
            for f in live:
                self.bytes[path_of(f)] -= int(net.left_now(f))  # never sent
                net.remove(t, f)
            self._net_touched = True
        self.outstanding[i] = 0
        return None

    def resume_prefetched(self, p: int, i: int, t: float, local: int, local_dram: int, pre: tuple[int, list[Flow]]) -> None:
        """Dequeued with a usable prefetch: the prefetch's flows still running are waited
        for, set aside (and checked for abandonment ``fetch_abandon_s`` later); then it
        takes the instance (its own SSD prefix loads then) and computes."""
        held, live = pre
        s = self.s
        self.counters["fetches"] += 1
        if held < s.planned[i]:
            self.counters["fetch_fallbacks"] += 1
        s.reused[i] = held
        s.fetched[i] = held - local
        s.start[i] = t
        self.hits.update(self.keys[i][:held])
        bb = self.block_bytes
        self.bytes["dram_local"] += int(local_dram * bb)
        n = len(live)
        self.outstanding[i] = n
        if n == 0:
            self.join(p, i, t)
            return
        self.set_aside(p, i)
        peer = [f for f in live if path_of(f) == "dram_peer"]
        if peer and self.cfg.abandon_late_fetches and math.isfinite(self.abandon_s[i]):
            # the bound counts from the dequeue (the wait the fetch adds from then on); a
            # check at the dequeue itself would read the rate of a flow that may have just
            # started, on links it has not yet shared out
            self.peer_loads[i] = (p, local, peer)
            self.abandon_due(i, t + self.abandon_s[i])


def path_of(f: Flow) -> str:
    """Which of ``PATHS`` a load flow takes (from its first link: a peer's NIC out, or a
    storage link, alone or relayed through the decode instance)."""
    if f.links[0] % 3 != 2:
        return "dram_peer"
    return "ssd_direct" if len(f.links) == 1 else "ssd_relay"
