"""The cluster's router thread: a small pump between the instances and the request
lifecycle (lifecycle.py).

It reads one event queue (what ``Cluster.submit`` / ``cancel`` post, and every message
an instance's link delivers, tagged with the instance id), feeds request events to
``RequestLifecycle.on`` and carries out the commands that come back: a message to an
instance, a conductor call, tokens / the output / the error for the request's handle.
The rest it routes itself: ``Ready`` / ``InitFailed`` and replies (stats, timings) go
to the cluster, store events to the conductor's index, a closed link (``Lost``) makes
the instance dead (the conductor drops it; the lifecycle fails what depended on it).
Every 0.25 s it also polls the worker processes for an exit the socket missed,
gives the lifecycle the time (deadlines) and hands the instances' link counters (their
heartbeats) to the conductor.

It knows the cluster only through ``ClusterPort``, a handful of methods, and it is the
one thread that touches the lifecycle, the request records and the conductor's
progress calls; ``Cluster.calibrate`` swaps the conductor through it (``SwapConductor``),
so no call ever sees half a swap.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import MooncakeError
from .control import CLUSTER, Counts, Lost
from ..client.handle import RequestHandle
from .lifecycle import (CancelRequest, Command, Conduct, Deliver, Fail, Finish, InstanceDown, Plan,
                        RequestLifecycle, Send, Tick)
from ..base.metrics import RequestMetrics
from .metrics import ClusterMetrics, tbt_of
from .replication import Replicator
from .protocol import (Cancelled, Exported, Failed, Fetched, InitFailed, Message, PeerLost, Ready, Relay,
                       RoleSwitched, Started,
                       StatsReply, Step, StoreEvents, Timings, Tokens)

__all__ = ["Router", "ClusterPort", "RequestRecord", "New", "SwapConductor", "Shutdown", "ReplicateNow"]

log = logging.getLogger("mooncake_rs.serving")

_WATCH_S = 0.25  # how often worker processes are polled and deadlines checked


@dataclass
class RequestRecord:
    """What the cluster keeps of one request while it runs (owned by the router thread
    once submitted): the lifecycle's plan, the caller's handle, tokens and metrics."""

    plan: Plan
    handle: RequestHandle
    t_submit: float
    tokens: list[int] = field(default_factory=list)
    t_last: float = 0.0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


@dataclass(frozen=True)
class New:
    """``Cluster.submit``: a request the conductor admitted."""

    record: RequestRecord


@dataclass(frozen=True)
class SwapConductor:
    """``Cluster.calibrate``: use ``conductor`` from now on; ``done`` is set once it is."""

    conductor: Any
    done: threading.Event


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class ReplicateNow:
    """``Cluster.replicate_hot_prefixes``: one replication round now; the number of
    copies it started goes into ``result``, then ``done`` is set."""

    done: threading.Event
    result: list[int]


class ClusterPort(Protocol):
    """What the router needs of its cluster."""

    conductor: Any
    prefix_reuse: bool
    metrics: ClusterMetrics

    @property
    def block_size(self) -> int:
        """The instances' block size in tokens."""

    def send(self, inst: int, msg: Message) -> None:
        """To a live instance (dropped for a dead one)."""

    def instance_ready(self, inst: int, msg: Ready | InitFailed) -> None: ...

    def instance_down(self, inst: int, reason: str) -> str | None:
        """Marks ``inst`` dead (reaps a worker, removes its segments); says what happened
        ("instance decode-0 died (signal 9)"), or None if it was already down."""

    def peer_lost(self, inst: int, peer: int, reason: str) -> None:
        """``inst`` lost its link to ``peer``: fence the peer (its death then takes the
        usual path)."""

    def exited(self) -> list[int]:
        """Live instances whose worker process has exited."""

    def reply(self, inst: int, msg: Message) -> None:
        """A reply to a call of the cluster's own (stats, timings, a failed measurement)."""

    def output(self, record: RequestRecord, reason: str) -> Any:
        """The ``RequestOutput`` of a finished request."""

    def link_reports(self) -> list[tuple[int, float, float, float]]:
        """``(instance, when, bytes out, bytes in)`` of the instances' link readings (their
        heartbeats) not handed out yet; ``when`` on the conductor's clock."""
        ...

    def now(self) -> float:
        """The conductor's clock."""

    #: seconds between hot-prefix replication rounds (None: only on ``ReplicateNow``)
    replicate_every_s: float | None
    #: bytes of KV a round may copy, and may have in flight
    replica_max_bytes: float


class Router:
    def __init__(self, port: ClusterPort, names: dict[int, str]) -> None:
        self.port = port
        # SimpleQueue: the cheapest put/get there is (every message passes through it)
        self.events: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self.lifecycle = RequestLifecycle(names)
        self.counts = Counts()  # what the cluster's callers post (New: one hop per request)
        self._records: dict[int, RequestRecord] = {}
        # requests submitted / ended for their callers: in flight = the difference. Each
        # count has one writer side (the callers under the lock; the router thread alone)
        self._submitted_lock = threading.Lock()
        self._submitted = 0
        self._ended_n = 0
        self.replicator = Replicator(port.send, self._block_bytes, port.replica_max_bytes)
        self._next_round = 0.0

    # ---- any thread
    def submit(self, record: RequestRecord) -> None:
        ev = New(record)
        self.counts.add(ev)
        with self._submitted_lock:
            self._submitted += 1
        self.events.put((CLUSTER, ev))

    def post(self, ev: Any) -> None:
        self.events.put((CLUSTER, ev))

    def in_flight(self) -> int:
        """Requests submitted and not yet ended for their callers."""
        ended = self._ended_n  # first: it never passes the submitted count read after it
        return self._submitted - ended

    # ---- the router thread
    def run(self) -> None:
        last_watch = time.monotonic()
        while True:
            try:
                src, ev = self.events.get(timeout=_WATCH_S)
            except queue.Empty:
                src, ev = CLUSTER, None
            if isinstance(ev, Shutdown):
                return
            if ev is not None:
                try:
                    self.handle(src, ev)
                except Exception:  # keep routing; the request at fault is failed
                    log.exception("router: %s from %s", type(ev).__name__, src)
                    rid = getattr(ev, "rid", None)
                    if isinstance(rid, int):
                        self._run(self.lifecycle.on(CancelRequest(
                            rid, MooncakeError(f"internal error handling {type(ev).__name__}"), "failed")))
            now = time.monotonic()
            if now - last_watch > _WATCH_S:
                last_watch = now
                for inst in self.port.exited():
                    self._down(inst, "exited")
                self._run(self.lifecycle.on(Tick(now)))
                self._report_links()
                every = self.port.replicate_every_s
                if every is not None and now >= self._next_round:
                    self._next_round = now + every
                    self._replicate()

    def _block_bytes(self) -> float:
        cfg = self.port.conductor.config
        return cfg.block_size * cfg.transfer_model.bytes_per_token

    def _replicate(self) -> int:
        """One round of hot-prefix replication (replication.py); how many copies started."""
        try:
            return self.replicator.round(self.port.conductor, self.port.now())
        except MooncakeError:
            log.exception("router: replication round")
            return 0

    def _report_links(self) -> None:
        """The instances' link counters (heartbeats) into the conductor's link loads: each
        replaces the conductor's own count of that instance's links up to its time; an
        older one than the last applied is ignored there (docs/conductor.md)."""
        cond = self.port.conductor
        if cond is None:
            return
        for inst, at, out_b, in_b in self.port.link_reports():
            if inst in self.lifecycle.down:
                continue
            try:
                cond.report_link_load(inst, at, out_b, in_b, 0.0)
            except MooncakeError:  # no longer the conductor's (removed, or a swapped conductor)
                pass

    def handle(self, src: int, ev: Any) -> None:
        # the per-request messages by isinstance first (a match's class patterns with
        # keywords cost ~4x), most frequent first; the rest below
        if isinstance(ev, Tokens):
            self._on_tokens(src, ev)
        elif isinstance(ev, Step):
            for t in ev.tokens:
                self._on_tokens(src, t)
        elif isinstance(ev, New):
            r = ev.record
            self._records[r.plan.rid] = r
            self._run(self.lifecycle.submit(r.plan))
        elif isinstance(ev, StoreEvents):
            cond = self.port.conductor  # None until the instances have reported (nothing is stored then)
            if self.port.prefix_reuse and cond is not None and src not in self.lifecycle.down:
                try:
                    cond.apply_store_events(src, ev.events)
                except MooncakeError as e:  # malformed bytes: the instance is at fault
                    log.error("instance %s sent store events the conductor refused: %s", src, e)
                    self._down(src, f"malformed store events: {e}")
        else:
            self._handle_rare(src, ev)

    def _handle_rare(self, src: int, ev: Any) -> None:
        match ev:
            case CancelRequest():
                self._run(self.lifecycle.on(ev))
            case Failed(rid=None):
                self.port.reply(src, ev)
            case Exported() | Fetched() | Failed() if self.replicator.owns(ev.rid):
                self.replicator.on_message(src, ev)
            case Exported() | Fetched() | Failed() | Cancelled() | Started():
                self._run(self.lifecycle.arrived(src, ev))
            case ReplicateNow(done=done, result=result):
                result.append(self._replicate())
                done.set()
            case Ready() | InitFailed():
                self.port.instance_ready(src, ev)
            case StatsReply() | Timings() | RoleSwitched():
                self.port.reply(src, ev)
            case Lost(reason=reason):
                self._down(src, reason)
            case PeerLost(peer=peer, reason=reason):
                self.port.peer_lost(src, peer, reason)
            case Relay(peer=to, msg=inner):  # workers across hosts talk to peers through us
                self.port.send(to, Relay(src, inner))
            case SwapConductor(conductor=fresh, done=done):
                for inst in self.lifecycle.down:
                    try:
                        fresh.remove_instance(inst)
                    except Exception:  # noqa: BLE001 - already gone
                        pass
                self.port.conductor = fresh
                done.set()
            case _:
                log.warning("router: unexpected %r from %s", ev, src)

    def _on_tokens(self, src: int, msg: Tokens) -> None:
        if self.lifecycle.more_tokens(src, msg):  # a decoding request's next tokens: no commands
            self._deliver(msg.rid, msg.tokens, None)
        else:
            if msg.report is not None and msg.report.busy_s is not None:
                self._served(msg.rid, msg.report.busy_s)
            self._run(self.lifecycle.tokens(src, msg))

    def _served(self, rid: int, busy_s: float) -> None:
        """The first token's report says what the prefill instance spent on the request:
        the admission's calibration learns the real service cost from it (before the
        first token ends the request's prefill stage in the conductor)."""
        try:
            self.port.conductor.on_prefill_served(rid, busy_s)
        except Exception:  # noqa: BLE001 - advisory, like every progress call (a dropped request)
            log.debug("conductor on_prefill_served(%d) failed", rid, exc_info=True)

    def fail_all(self, error: BaseException) -> None:
        """After the thread ended (``Cluster.close``): fail what is still in flight."""
        records, self._records = list(self._records.values()), {}
        while True:
            try:
                _, ev = self.events.get_nowait()
            except queue.Empty:
                break
            if isinstance(ev, New):
                records.append(ev.record)
        self._ended_n = self._submitted
        for r in records:
            r.handle._fail(error)

    def _down(self, inst: int, reason: str) -> None:
        if inst in self.lifecycle.down:
            return
        self.replicator.instance_down(inst)
        try:  # first, so no new decision names it once the cluster shows it gone
            self.port.conductor.remove_instance(inst)
        except Exception:  # noqa: BLE001 - already gone
            pass
        what = self.port.instance_down(inst, reason)
        if what is not None:
            self._run(self.lifecycle.on(InstanceDown(inst, what)))

    # ---- commands
    def _run(self, cmds: list[Command]) -> None:
        # isinstance tests, not a match: a class pattern with keywords costs ~4x as much,
        # and this runs for every command of every message
        for c in cmds:
            if isinstance(c, Deliver):  # the most frequent: first
                self._deliver(c.rid, c.tokens, c.report)
            elif isinstance(c, Send):
                self.port.send(c.to, c.msg)
            elif isinstance(c, Conduct):
                self._conduct(c.call, c.rid, c.n)
            elif isinstance(c, Finish):
                self._finish(c.rid, c.reason)
            elif isinstance(c, Fail):
                self._fail(c.rid, c.error, c.outcome)
            else:
                raise TypeError(f"not a lifecycle command: {c!r}")

    def _end(self, rid: int) -> RequestRecord | None:
        """The record of a request that ends for its caller now (None: ended already)."""
        r = self._records.pop(rid, None)
        if r is not None:
            self._ended_n += 1
        return r

    def _finish(self, rid: int, reason: str) -> None:
        r = self._end(rid)
        if r is None:
            return
        m = r.metrics
        m.output_tokens = len(r.tokens)
        m.tbt_s = tbt_of(m.token_intervals)
        self.port.metrics.add(m)
        r.handle._finish(self.port.output(r, reason))

    def _fail(self, rid: int, error: BaseException, outcome: str) -> None:
        r = self._end(rid)
        if r is not None:
            self.port.metrics.ended(outcome)
            r.handle._fail(error)

    def _deliver(self, rid: int, tokens: list[int], report: Any) -> None:
        r = self._records.get(rid)
        if r is None:
            return
        m, now = r.metrics, time.monotonic()
        if report is not None:
            bs = self.port.block_size
            m.reused_tokens = report.reused_blocks * bs
            m.fetched_tokens = report.fetched_blocks * bs
            m.computed_tokens = len(r.plan.prompt) - m.reused_tokens
            m.transferred_bytes += report.bytes
            m.kv_ready_s = report.t_ready - report.t_start
            m.fetch_sources, m.fetch_s = report.sources, report.fetch_s
        for t in tokens:
            if r.tokens:
                m.token_intervals.append(now - r.t_last)
            else:
                m.ttft_s = now - r.t_submit
            r.t_last = now
            r.tokens.append(t)
            r.handle._token(t)

    def _conduct(self, call: str, rid: int, n: int) -> None:
        cond = self.port.conductor
        try:
            if call == "prefill_started":
                cond.on_prefill_started(rid, self.port.now())
            elif call == "decode_started":
                cond.on_decode_started(rid, self.port.now())
            elif call == "decode_finished":
                cond.on_decode_finished(rid, n, self.port.now())
            elif call == "cancel":
                cond.cancel(rid)
            else:
                raise ValueError(f"unknown conductor call {call!r}")
        except Exception:  # noqa: BLE001 - progress is advisory (a dropped instance, a recalibration)
            log.debug("conductor %s(%d) failed", call, rid, exc_info=True)
