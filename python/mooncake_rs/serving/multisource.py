"""Multi-source prefix fetch (DualPath's multi-path loading, issue 16): one run of
prefix blocks pulled from several holders of the same blocks (replicas) at once, each
holder sending a contiguous share of the run through the transfer engine.

**The split.** Each holder gets a share of the blocks in proportion to its *free
bandwidth*: the bandwidth a new flow would get on its link out if the link is shared
fairly among the flows already on it, ``bandwidth / (flows + 1)`` (the simulator's
multipath rule for a full link, docs/sim.md). ``flows`` counts what the cluster knows is
in flight on that holder's link: the fetches it serves and the KV it streams to a decode
instance (a request it is prefilling). With equal links and no load that is an even
split; a holder serving one other flow gets half the share of an idle one. Blocks are
apportioned by largest remainder (so the counts add up to the run), ties to the earlier
holder; a holder may get none.

**The copy.** ``MultiFetch`` reserves a store slot for every block it does not hold yet
and starts one read per share, each under its own transport tag, so the reads of all
holders are in flight together and each ends (or fails) on its own. Every holder pinned
the whole run, so when a share fails (its holder died, its region went away) and
another holder's share succeeded, the failed share is read again from that holder
(``fallback``); whole blocks are re-read, so nothing of the failed read survives. The
blocks are committed only when every share is in: all of the run or none of it (a run
that cannot be completed is aborted, its slots freed, and the caller computes the
prefix instead). A block never becomes visible half-written.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._core import WritableBlock
from ..errors import InvalidArgument, MooncakeError, TransferTimeout
from .arena import StoreSlots
from .transport import Span

__all__ = ["FetchResult", "FetchSource", "Holder", "MultiFetch", "share_ranges", "split_blocks"]


@dataclass(frozen=True)
class Holder:
    """One holder of the blocks, as the split sees it: its link out (bytes/s; None: not
    known, every such holder counts the same) and the flows already on that link."""

    id: int
    bandwidth: float | None = None
    flows: int = 0

    @property
    def free_bandwidth(self) -> float:
        bw = 1.0 if self.bandwidth is None else float(self.bandwidth)
        return bw / (max(self.flows, 0) + 1)


def split_blocks(n: int, holders: Sequence[Holder]) -> list[int]:
    """How many of ``n`` blocks each holder sends (in ``holders`` order; they add up to
    ``n``), in proportion to ``free_bandwidth``."""
    if n < 0:
        raise InvalidArgument(f"a fetch of {n} blocks: the count must be >= 0")
    if not holders:
        raise InvalidArgument("a fetch needs at least one holder")
    free = [h.free_bandwidth for h in holders]
    if any(not (f >= 0 and math.isfinite(f)) for f in free):
        raise InvalidArgument(f"holder bandwidths must be finite and >= 0, got {[h.bandwidth for h in holders]}")
    total = sum(free)
    if total <= 0:  # nobody has anything free: split evenly rather than refuse
        free, total = [1.0] * len(holders), float(len(holders))
    exact = [n * f / total for f in free]
    counts = [int(x) for x in exact]
    # largest remainder; ties to the earlier holder (sorted is stable)
    order = sorted(range(len(holders)), key=lambda i: -(exact[i] - counts[i]))
    for i in order[:n - sum(counts)]:
        counts[i] += 1
    return counts


def share_ranges(counts: Sequence[int]) -> list[range]:
    """The contiguous block ranges of the counts, in order."""
    out, at = [], 0
    for c in counts:
        out.append(range(at, at + c))
        at += c
    return out


@dataclass(frozen=True)
class FetchSource:
    """A holder's copy of the run: its arena endpoint (``Transport`` form: name,
    address, region) and the arena offset of each block of the run (it pinned them)."""

    holder: int
    endpoint: dict[str, Any]
    offsets: Sequence[int]


@dataclass
class FetchResult:
    """What a fetch brought: ``blocks`` (leased, the run's leading blocks: all of it
    unless ``error``), how many were copied (``fetched``; the rest were held already),
    bytes moved, blocks read again from another holder after a share failed
    (``refetched``), and the first error (None: the whole run is in)."""

    blocks: list[Any]
    fetched: int
    bytes: int
    refetched: int = 0
    error: str | None = None
    per_holder: dict[int, int] = field(default_factory=dict)  # holder -> blocks it sent


@dataclass
class _Share:
    source: FetchSource
    blocks: list[int]  # indices into the run of the blocks this share copies
    tag: int = 0
    error: str | None = None
    ended: bool = False


class MultiFetch:
    """Pulls one run of blocks (``keys``) from several holders into ``store`` (a
    ``StoreSlots``) through ``transport``. ``counts``: blocks per source (in order, adding
    up to the run; default: ``split_blocks`` with equal holders). Drive it with ``start``,
    then ``poll`` until it says done (or ``wait``), then ``finish``; ``abort`` drops it at
    any point. ``run`` does all of it, blocking."""

    def __init__(self, transport: Any, store: StoreSlots, keys: Sequence[int], sources: Sequence[FetchSource],
                 counts: Sequence[int] | None = None, *, fallback: bool = True) -> None:
        if not sources:
            raise InvalidArgument("a fetch needs at least one source")
        n = len(keys)
        for s in sources:
            if len(s.offsets) < n:
                raise InvalidArgument(f"holder {s.holder} has {len(s.offsets)} offsets for a run of {n} blocks")
        counts = split_blocks(n, [Holder(s.holder) for s in sources]) if counts is None else list(counts)
        if len(counts) != len(sources) or sum(counts) != n or min(counts) < 0:
            raise InvalidArgument(f"the split {counts} does not cover a run of {n} blocks from {len(sources)} holders")
        self.transport, self.store = transport, store
        self.keys = list(keys)
        self.sources = list(sources)
        self.counts = counts
        self.fallback = fallback
        self._slots: list[Any] = []  # per block of the run: a held Block or a WritableBlock
        self._shares: list[_Share] = []
        self._bytes = 0
        self._refetched = 0
        self._started = False
        self._closed = False

    # ---- driving it
    def start(self) -> None:
        """Reserves slots and starts every share's read (returns at once). A block that
        cannot be reserved (the store is full) ends the run there: the blocks before it
        are fetched, the rest is left to compute."""
        if self._started:
            raise InvalidArgument("this fetch was started already")
        self._started = True
        self._slots = self.store.hold_or_reserve(self.keys)
        n = len(self._slots)
        for src, rng in zip(self.sources, share_ranges(self.counts)):
            todo = [i for i in rng if i < n and isinstance(self._slots[i], WritableBlock)]
            if todo:
                self._shares.append(_Share(src, todo))
        for sh in self._shares:
            self._read(sh, sh.source)

    def _read(self, sh: _Share, src: FetchSource) -> None:
        sh.tag, sh.ended, sh.error = self.transport.new_tag(), False, None
        bb = self.store.block_bytes
        spans = [Span(self._slots[i].offset, int(src.offsets[i]), bb) for i in sh.blocks]
        try:
            self.transport.read(sh.tag, src.endpoint, spans)
        except (MooncakeError, OSError) as e:  # could not even submit (an unknown peer)
            sh.ended, sh.error = True, f"{type(e).__name__}: {e}"

    def poll(self) -> bool:
        """Never blocks: whether every share has ended for good (a failed share read
        again from a holder whose share succeeded counts as not ended yet)."""
        t = self.transport
        for sh in self._shares:
            if not sh.ended and not t.pending(sh.tag):
                sh.ended = True
                sh.error = t.error(sh.tag)
                self._bytes += t.take_bytes(sh.tag)
        if not all(sh.ended for sh in self._shares):
            return False
        failed = [sh for sh in self._shares if sh.error is not None]
        good = [sh.source for sh in self._shares if sh.error is None]
        if failed and good and self.fallback:
            for sh in failed:
                # the holder with the most free share of the work: simply the first survivor
                src = good[0]
                self._refetched += len(sh.blocks)
                sh.source = src
                self._read(sh, src)
            self.fallback = False  # once: a second failure ends the run
            return self.poll()
        return True

    def wait(self, timeout_s: float) -> bool:
        """Blocks until done or ``timeout_s`` (the transport's wait releases the GIL)."""
        end = time.monotonic() + timeout_s
        while not self.poll():
            left = end - time.monotonic()
            if left <= 0:
                return False
            self.transport.wait(min(left, 0.05))
        return True

    def finish(self) -> FetchResult:
        """Once ``poll`` said done: commits the run (every share in) and hands back its
        leased blocks, or aborts every reserved slot (a share failed) and hands back none
        of them: the caller computes the prefix."""
        if not self._started or not self.poll():
            raise InvalidArgument("finish() before the fetch has ended (poll() until it is True)")
        self._closed = True
        err = next((f"holder {sh.source.holder}: {sh.error}" for sh in self._shares if sh.error is not None), None)
        blocks: list[Any] = []
        fetched = 0
        for s in self._slots:
            if not isinstance(s, WritableBlock):  # held here already
                if err is None:
                    blocks.append(s)
                else:
                    s.release()
                continue
            if err is not None:
                s.abort()
                continue
            b = self.store.commit(s, lease=True)
            if b is None:  # lost the slot meanwhile: the rest of the run does not count
                err = f"block {s.key:#x} could not be committed"
                continue
            blocks.append(b)
            fetched += 1
        if err is not None:
            for b in blocks:
                b.release()
            blocks, fetched = [], 0
        per: dict[int, int] = {}
        for sh in self._shares:
            per[sh.source.holder] = per.get(sh.source.holder, 0) + len(sh.blocks)
        self._slots = []
        return FetchResult(blocks, fetched, self._bytes, self._refetched, err, per)

    def abort(self) -> None:
        """Drops the fetch (a cancel): waits for the reads still in flight (they write
        into our slots), then frees every reserved slot and lease."""
        if self._closed:
            return
        self._closed = True
        t = self.transport
        for sh in self._shares:
            while not sh.ended and t.pending(sh.tag):
                t.wait(0.01)
            t.error(sh.tag)
            self._bytes += t.take_bytes(sh.tag)
        for s in self._slots:
            if isinstance(s, WritableBlock):
                s.abort()
            else:
                s.release()
        self._slots = []

    @property
    def bytes(self) -> int:
        return self._bytes

    def run(self, timeout_s: float = 60.0) -> FetchResult:
        """start, wait, finish: the blocking form (tests, benchmarks)."""
        self.start()
        if not self.wait(timeout_s):
            self.abort()
            raise TransferTimeout(f"a fetch of {len(self.keys)} blocks did not end within {timeout_s}s")
        res = self.finish()
        return res
