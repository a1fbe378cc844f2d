"""``RoutedCluster``: the request side of a deployment that routes with a conductor and
the router thread, whatever runs its instances.

The embedded ``Cluster`` (instances in this process or in child processes) and the
``serve`` process's ``ConductorService`` (workers on other hosts, found in etcd) each
hold one (composition, not a subclass): they differ in how instances start, join and
leave, not in how a request is admitted and followed. Each builds its core with its
``ServingConfig`` (config.py), its ``Members`` table (members.py) and its
``MembershipSource``: what happens when an instance says ``Ready``, goes down, loses a
peer, or exits (``SpawnedInstances`` for the embedded cluster; the service itself
across hosts). The core owns the router thread and its one port, the conductor (built
once the instances have reported, with the cost models below), admission, the
instances' stats and the calls' replies. ``RoutedApi`` is the request API both expose
over the core they hold (``submit``, ``generate``, ``metrics_text``, ...).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Protocol, Self

from .._core import (Conductor, ConductorConfig, DecodeCostModel, PrefillCostModel, PrefixHasher,
                     TransferCostModel)
from ..errors import InvalidArgument, MooncakeError, Overloaded, ServiceUnavailable
from .config import ServingConfig
from ..client.generate import GenerateMixin
from ..client.handle import RequestHandle, request_entry
from .control import Lost
from .lifecycle import CancelRequest, Plan
from .limits import Limits
from .liveness import watch
from .members import Members
from .metrics import ClusterMetrics
from .protocol import InitFailed, Message, Ready, Stats, StatsReply
from .replies import Replies
from .router import ReplicateNow, RequestRecord, Router, Shutdown, SwapConductor

__all__ = ["RoutedCluster", "RoutedApi", "MembershipSource", "new_conductor", "default_prefill_model", "request_output",
           "MAX_FETCH_SOURCES"]

#: the most holders one prefix fetch reads from at once (the decision's holder included):
#: past a few, each share is too small to gain more than the extra Export round trips cost
MAX_FETCH_SOURCES = 4


def request_output(record: RequestRecord, reason: str) -> Any:
    """The ``RequestOutput`` of a finished request (``ClusterPort.output``). The record is
    dropped once finished: its token list is handed over, not copied."""
    from ..base.outputs import RequestOutput

    m = record.metrics
    return RequestOutput(str(record.plan.rid), record.plan.prompt, record.tokens, reason, [], m.reused_tokens, 0, m)


def default_prefill_model() -> PrefillCostModel:
    """The prefill cost model before any calibration (``Cluster.calibrate`` fits the
    host's; with rejection on, the conductor refines it online)."""
    return PrefillCostModel(c0=0.002, c_new=2e-5, c_new2=0.0, c_cross=0.0)


class MembershipSource(Protocol):
    """How a routed cluster's instances come and go; called on the router thread."""

    def on_ready(self, inst: int, msg: Ready | InitFailed) -> None:
        """``inst`` answered its start (``Init`` / ``Attach``)."""

    def on_down(self, inst: int, reason: str) -> str | None:
        """``inst`` is out (the conductor dropped it already): mark it dead, reap what is
        left of it; say what happened ("instance decode-0 died (signal 9)"), or None if
        it was down already."""

    def on_peer_lost(self, inst: int, peer: int, reason: str) -> None:
        """``inst`` lost its link to ``peer``: fence the peer."""

    def exited(self) -> list[int]:
        """Live instances whose process has exited (a socket may miss it)."""


class _Port:
    """The routed cluster as its router sees it (router.ClusterPort)."""

    def __init__(self, core: "RoutedCluster", source: MembershipSource) -> None:
        self._c, self._source = core, source
        self.prefix_reuse = core.prefix_reuse
        self.metrics = core.metrics
        self.instance_ready = source.on_ready
        self.instance_down = source.on_down
        self.peer_lost = source.on_peer_lost
        self.exited = source.exited
        self.reply = core._replies.deliver
        self.replicate_every_s = core.config.replicate_every_s
        self.replica_max_bytes = core.config.replica_max_bytes

    @property
    def block_size(self) -> int:
        return self._c.block_size or 1

    @property
    def conductor(self) -> Any:
        return self._c.conductor

    @conductor.setter
    def conductor(self, value: Any) -> None:  # SwapConductor, on the router thread
        self._c.conductor = value

    def link_reports(self) -> list[tuple[int, float, float, float]]:
        """The instances' link readings not handed out yet (``Members.link_reports``),
        dated on the conductor's clock."""
        since = time.monotonic() - self._c.now()  # the conductor's time 0 on this host's clock
        return [(i, at - since, o, n) for i, at, o, n in self._c.members.link_reports()]

    def send(self, inst: int, msg: Message) -> None:
        m = self._c.members.get(inst)
        if m is not None and m.alive:
            m.ch.to_instance(msg)

    def output(self, record: RequestRecord, reason: str) -> Any:
        return request_output(record, reason)

    def now(self) -> float:
        return self._c.now()


def new_conductor(cfg_args: dict[str, Any], block_bytes: int, prefill_model: Any, prefill_ids: Sequence[int],
                  decode_ids: Sequence[int], index: Any = None, decode_capacity: tuple[int, int] | None = None,
                  link_bandwidth: float | None = None) -> Conductor:
    """A conductor over these instances. ``cfg_args``: ``ConductorConfig``'s keywords
    (block size, SLOs, policy, rejection, seed); the transfer cost of a token follows
    the instances' block bytes. ``decode_capacity``: (largest batch, KV tokens) of a
    decode instance, what admission fills them to (None: the conductor's defaults, until
    the instances said). With rejection on, the admission's estimates are calibrated
    online on what this cluster measures (conductor.md, admission). ``link_bandwidth``
    (the instances' emulated links, bytes/s): the network the conductor prices fetches
    on, and every instance's NIC capacity in its link loads (issue 25; docs/conductor.md)."""
    per_token = block_bytes / cfg_args["block_size"]
    cfg = ConductorConfig(
        **cfg_args, prefill_model=prefill_model,
        transfer_model=TransferCostModel(bytes_per_token=per_token,
                                         network_bandwidth=2e9 if link_bandwidth is None else link_bandwidth,
                                         latency_s=1e-4),
        decode_model=DecodeCostModel(base_s=0.004, per_seq_s=2e-4, per_token_s=1e-7),
        default_output_len=32)
    c = Conductor(cfg, index)
    c.set_online_calibration(cfg_args.get("rejection", "none") != "none")
    for i in prefill_ids:
        c.add_prefill(i)
    for i in decode_ids:
        if decode_capacity is None:
            c.add_decode(i)
        else:
            c.add_decode(i, max_batch=max(1, decode_capacity[0]), kv_capacity_tokens=max(1, decode_capacity[1]))
    if link_bandwidth is not None:
        for i in (*prefill_ids, *decode_ids):
            c.set_link_bandwidth(i, link_bandwidth, float("inf"))
    return c


class RoutedCluster:
    """The routed core of one deployment (see the module docs); its shell (``Cluster``,
    ``ConductorService``) holds it as ``_core`` and sets ``closed`` when it closes."""

    def __init__(self, config: ServingConfig, members: Members, source: MembershipSource, *,
                 block_size: int | None, limits: Limits, names: dict[int, str] | None = None) -> None:
        """``block_size``: the instances' (None: learnt from the first to report).
        ``names``: instance id -> name, of the instances known from the start."""
        self.config = config
        self.prefix_reuse = config.prefix_reuse
        #: fetch a reused prefix from every prefill instance that holds it, at once
        #: (multisource.py); off: from the one holder the conductor's decision names
        self.multipath = config.multipath
        self.block_size = block_size
        self.hasher: PrefixHasher | None = None if block_size is None else PrefixHasher(block_size, seed=0)
        #: built once the instances have reported (their block bytes and capacities)
        self.conductor: Conductor | None = None
        self.members = members
        self.limits = limits
        self._ids = itertools.count(1)
        self._t0 = time.monotonic()
        self.metrics = ClusterMetrics()
        #: set by the shell when it closes: no request is admitted from then on
        self.closed = False
        self._replies = Replies()  # answers to Stats / Measure / SwitchRole, by query id
        self.switch_lock = threading.Lock()  # one role switch at a time (the pools' counts)
        self._stop_watch = threading.Event()
        self.router = Router(_Port(self, source), dict(names or {}))
        self._router_thread = threading.Thread(target=self.router.run, name="mooncake-router", daemon=True)
        self._router_thread.start()

    def set_block_size(self, block_size: int) -> None:
        """The instances' block size, learnt from the first to report (the conductor
        service's workers): the hasher and the limits follow it."""
        self.block_size = block_size
        self.hasher = PrefixHasher(block_size, seed=0)
        self.limits.block_size = block_size

    def start_watchdog(self, limit_s: float) -> None:
        """Declares an instance silent for ``limit_s`` down (liveness.py)."""
        threading.Thread(target=watch, args=(self.members.values, self._stop_watch, limit_s, self.report_down),
                         name="mooncake-watchdog", daemon=True).start()

    def stop_watchdog(self) -> None:
        self._stop_watch.set()

    def report_down(self, inst: int, reason: str) -> None:
        """An instance is out (silent, or its membership says so): the router takes it
        as a closed link, its usual death path."""
        self.router.events.put((inst, Lost(reason)))

    def swap_conductor(self, fresh: Conductor, timeout_s: float = 30.0) -> None:
        """Replaces the conductor on the router thread (never under a call of its)."""
        done = threading.Event()
        self.router.post(SwapConductor(fresh, done))
        if not done.wait(timeout_s):
            raise MooncakeError("the router did not take the new conductor")

    def stop_routing(self, error: BaseException, timeout_s: float) -> None:
        """Ends the router thread and fails what is still in flight with ``error``."""
        self._stop_watch.set()
        self.router.post(Shutdown())
        self._router_thread.join(timeout_s)
        if not self._router_thread.is_alive():
            self.router.fail_all(error)

    def now(self) -> float:
        """Seconds since the core started (the conductor's clock)."""
        return time.monotonic() - self._t0

    def instances(self) -> dict[int, str]:
        return {i: m.spec.name for i, m in self.members.live().items()}

    def instance_roles(self) -> dict[int, str]:
        return {i: m.role for i, m in self.members.live().items()}

    def ask(self, inst: int, make: Callable[[int], Message], timeout_s: float) -> Message | None:
        """Sends ``make(qid)`` to live instance ``inst`` and waits for its answer (None:
        none within ``timeout_s``, or ``inst`` is not live)."""
        m = self.members.get(inst)
        if m is None or not m.alive:
            return None
        got = self._replies.ask(m.ch.to_instance, make, timeout_s)
        return None if got is None else got[1]

    def instance_stats(self, timeout_s: float) -> dict[int, dict[str, float]]:
        out = {}
        for i, m in self.members.live().items():
            reply = self.ask(i, lambda qid: Stats(qid=qid), timeout_s)
            if not isinstance(reply, StatsReply):
                raise MooncakeError(f"instance {m.spec.name} did not report its stats")
            out[i] = reply.stats
        return out

    def submit(self, prompt: Sequence[int], params: Any, timeout_s: float | None,
               handle_type: Callable[[int, list[int], Any], RequestHandle] = RequestHandle) -> Any:
        """Admits one request (``RoutedApi.submit``); its handle is made by
        ``handle_type(rid, prompt, on_cancel)`` (the conductor service forwards a remote
        client's tokens through its own)."""
        if self.closed:
            raise InvalidArgument("the cluster is closed")
        cond, hasher = self.conductor, self.hasher
        if cond is None or hasher is None:
            raise ServiceUnavailable("no worker has joined the cluster yet; start `mooncake-rs worker` processes")
        toks, params, wait = request_entry(prompt, params, timeout_s)
        self.limits.check(toks, params)
        keys = hasher.hash_blocks(toks)  # BlockHashes: no Python int per block
        rid = next(self._ids)
        self.metrics.count("requests")
        try:
            d = cond.schedule(rid, keys if self.prefix_reuse else [], len(toks), self.now(),
                              expected_output_len=params.max_tokens)
        except Overloaded:
            self.metrics.count("rejected")
            raise
        t_submit = time.monotonic()
        local = d.reused_blocks - d.fetch_blocks
        fetch = d.fetch_blocks > 0 and d.fetch_from is not None
        also = self._other_holders(cond, keys[:d.reused_blocks], d) if fetch and self.multipath else ()
        plan = Plan(rid, toks, params, bytes(keys), d.prefill, d.decode, local=local,
                    fetch_from=d.fetch_from if fetch else None,
                    fetch_keys=bytes(keys[local:d.reused_blocks]) if fetch else b"",
                    deadline=None if wait is None else t_submit + wait, timeout_s=0.0 if wait is None else wait,
                    fetch_also=also, prefetch=d.prefetch)
        rec = RequestRecord(plan, handle_type(rid, toks, self._cancel), t_submit)
        rec.metrics.prefill_instance, rec.metrics.decode_instance = d.prefill, d.decode
        rec.handle.prefill_instance, rec.handle.decode_instance = d.prefill, d.decode
        rec.metrics.prompt_tokens = len(toks)
        self.router.submit(rec)
        return rec.handle

    def _other_holders(self, cond: Conductor, prefix: Any, d: Any) -> tuple[int, ...]:
        """Live prefill instances besides the decision's holder that the index says hold
        all of ``prefix`` (the request's reused blocks, from the first): the other sources
        of a multi-source fetch. A holder the index is wrong about answers ``Exported``
        with fewer blocks and is left out of the fetch then (lifecycle.py)."""
        want = len(prefix)
        held = cond.index.match_prefix(prefix)
        out = []
        for i, n in sorted(held.items()):
            if n < want or i in (d.prefill, d.decode, d.fetch_from):
                continue
            m = self.members.get(i)
            if m is None or not m.alive or m.role != "prefill":
                continue
            out.append(i)
            if len(out) + 1 >= MAX_FETCH_SOURCES:
                break
        return tuple(out)

    def _cancel(self, rid: int, error: BaseException, outcome: str = "cancelled") -> None:
        """RequestHandle.cancel: the router ends the request everywhere (lifecycle.py);
        ``outcome`` is the metrics counter it lands in."""
        self.router.post(CancelRequest(rid, error, outcome))

    def metrics_text(self) -> str:
        if self.conductor is None:
            return self.metrics.prometheus({"instances_alive": 0.0})
        snap = self.conductor.snapshot(self.now())
        gauges: dict[str, float] = {"instances_alive": float(len(self.instances()))}
        for p in snap.prefill:
            gauges[f'prefill_queue_seconds{{instance="{p.id}"}}'] = p.queue_s
        for d in snap.decode:
            gauges[f'decode_batch{{instance="{d.id}"}}'] = float(d.batch)
        gauges["requests_in_flight"] = float(snap.requests)
        gauges["prefix_hit_rate"] = self.metrics.prefix_hit_rate
        for i, u in self.kv_usage().items():
            for name, v in u.items():
                gauges[f'{name}{{instance="{i}"}}'] = v
        return self.metrics.prometheus(gauges)

    def kv_usage(self) -> dict[int, dict[str, float]]:
        return self.members.usage()

    def replicate_hot_prefixes(self, timeout_s: float) -> int:
        ev = ReplicateNow(threading.Event(), [])
        self.router.post(ev)
        if not ev.done.wait(timeout_s):
            raise ServiceUnavailable(f"the router did not run the replication round within {timeout_s}s")
        return ev.result[0]


class RoutedApi(GenerateMixin):
    """The request API of a deployment over the routed core it holds (``_core``): what
    the embedded ``Cluster`` and the conductor service expose the same way, each
    delegating here to its own core (neither is a subclass of it)."""

    _core: RoutedCluster

    @property
    def config(self) -> ServingConfig:
        return self._core.config

    @property
    def conductor(self) -> Conductor | None:
        """The conductor (None until the instances have reported; replaced by a
        calibration)."""
        return self._core.conductor

    @property
    def metrics(self) -> ClusterMetrics:
        return self._core.metrics

    @property
    def block_size(self) -> int | None:
        return self._core.block_size

    @property
    def prefix_reuse(self) -> bool:
        return self._core.prefix_reuse

    @property
    def multipath(self) -> bool:
        """Fetch a reused prefix from every prefill instance that holds it, at once
        (multisource.py); off: from the one holder the conductor's decision names."""
        return self._core.multipath

    def instances(self) -> dict[int, str]:
        """Live instances: id -> name."""
        return self._core.instances()

    def instance_roles(self) -> dict[int, str]:
        """Live instances: id -> ``"prefill"`` or ``"decode"``."""
        return self._core.instance_roles()

    def submit(self, prompt: Sequence[int], params: Any = None, *, timeout_s: float | None = None) -> RequestHandle:
        """Admits one request and returns its handle; raises ``Overloaded`` when rejected
        and ``InvalidArgument`` for a prompt no instance could serve. ``timeout_s``: a
        deadline from now; past it the request is cancelled on every instance and fails
        with ``TransferTimeout`` (None: no deadline)."""
        return self._core.submit(prompt, params, timeout_s)

    def instance_stats(self, timeout_s: float = 30.0) -> dict[int, dict[str, float]]:
        """Per live instance: bytes its transfer engine moved (``copied_bytes``), seconds its
        transfers were in flight (``copy_busy_s``), blocks held, evictions. Call it idle."""
        return self._core.instance_stats(timeout_s)

    def metrics_text(self) -> str:
        """Prometheus text exposition of the cluster's totals and instance gauges."""
        return self._core.metrics_text()

    def kv_usage(self) -> dict[int, dict[str, float]]:
        """Per live instance, its memory use as of its latest heartbeat (no round trip:
        cheap enough for every ``/metrics`` scrape): ``kv_used_blocks`` / ``kv_free_blocks``
        (its engine's KV cache pages, a block of tokens each), ``store_used_blocks`` /
        ``store_slots`` / ``store_used_bytes`` (its store's DRAM tier), ``engine_running`` /
        ``engine_waiting`` (its engine scheduler's sequences) and ``heartbeat_age_seconds``.
        An instance that has not beaten yet (or with ``heartbeat_timeout_s=None`` in
        worker processes, which then send no beats) is left out."""
        return self._core.kv_usage()

    def replicate_hot_prefixes(self, timeout_s: float = 10.0) -> int:
        """One round of hot-prefix replication now (what ``replicate_every_s`` runs on its
        own): the conductor's replica hints that fit in ``replica_max_bytes`` with the
        copies in flight are started (serving/replication.py). Returns how many; the
        copies finish in the background (the target's store events then show them in
        the conductor's index)."""
        return self._core.replicate_hot_prefixes(timeout_s)

    def close(self) -> None:  # pragma: no cover - each membership stops its instances its own way
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
