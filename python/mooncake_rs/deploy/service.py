"""``ConductorService``: the conductor and router of a deployment across hosts, over the
workers etcd knows (what ``mooncake-rs serve --etcd`` runs while it leads).

It is a ``RoutedCluster`` like the embedded ``Cluster`` (same ``submit`` / ``generate``
/ ``metrics_text``); only membership differs. ``Membership`` (membership.py) reports
workers as they join and leave; for each one that joins the service opens an
authenticated control link to its ``control`` address and sends ``Attach`` with an id
of its own (ids are never reused within a service, so a worker that comes back is a
new instance to the conductor and the lifecycle). The worker answers ``Ready`` (its
arena, capacities, the model's limits) and re-announces its store's contents; only
then does the conductor route to it. Peer messages (decode -> prefill hand-off, KV
ready) travel through the service as ``Relay`` (router.py forwards them). KV itself
goes worker to worker through the transfer engines (TCP across hosts).

A worker leaves when its control link closes (crash, kill, shutdown), when it stops
beating (the watchdog, liveness.py: a cut cable leaves the socket silent, not closed),
or when its lease goes (``on_leave``) and its link is silent too, or it does not
register again within ``leave_grace_s`` (a lease can lapse during an etcd outage while
the worker is fine: it registers again by itself). Either way the router's usual death
path runs: out of the conductor and its index, requests that depended on it failed with
``TransferFailed`` naming it. While etcd is unavailable, membership keeps its last view,
so routing goes on: the conductor's own links are what say a worker is alive; etcd is
how workers are found.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Any

from .._core import PrefillCostModel, PrefixHasher
from ..errors import MooncakeError, ServiceUnavailable
from ..serving.control import Lost, SocketChannel
from ..serving.liveness import watch
from ..serving.limits import Limits
from ..serving.members import Member
from ..serving.protocol import (FROM_REMOTE, PROTOCOL_VERSION, Attach, InitFailed, InstanceSpec, Message, Ready, Stats,
                                StatsReply)
from ..serving.routed import RoutedCluster, new_conductor, request_output
from ..serving.router import RequestRecord, Router, Shutdown
from . import auth_socket
from .etcd import EtcdClient
from .membership import Membership
from .records import WorkerRecord

__all__ = ["ConductorService"]

log = logging.getLogger("mooncake_rs.deploy")


_LEASE_GONE = "its etcd lease expired or was revoked (shut down, crashed or cut off)"


class _ServicePort:
    """The service as the router sees it (router.ClusterPort)."""

    def __init__(self, service: "ConductorService") -> None:
        self._s = service
        self.metrics = service.metrics
        self.prefix_reuse = service.prefix_reuse

    @property
    def block_size(self) -> int:
        return self._s.block_size or 1

    @block_size.setter
    def block_size(self, value: int) -> None:  # (ClusterPort declares it settable; the service owns it)
        self._s.block_size = value

    @property
    def conductor(self) -> Any:
        return self._s.conductor

    @conductor.setter
    def conductor(self, value: Any) -> None:
        self._s.conductor = value

    def send(self, inst: int, msg: Message) -> None:
        m = self._s._members.get(inst)
        if m is not None and m.alive:
            m.ch.send(msg)

    def instance_ready(self, inst: int, msg: Ready | InitFailed) -> None:
        self._s._on_ready(inst, msg)

    def instance_down(self, inst: int, reason: str) -> str | None:
        return self._s._on_down(inst, reason)

    def peer_lost(self, inst: int, peer: int, reason: str) -> None:
        pass  # workers have no peer links of their own (Relay)

    def exited(self) -> list[int]:
        return []

    def reply(self, inst: int, msg: Message) -> None:
        self._s._replies.put((inst, msg))

    def output(self, record: RequestRecord, reason: str) -> Any:
        return request_output(record, reason)

    def now(self) -> float:
        return self._s._now()


class ConductorService(RoutedCluster):
    """Routes requests over the workers registered under ``prefix`` in etcd.

    ``token``: the cluster token (control links are authenticated with it).
    ``heartbeat_timeout_s``: a worker silent this long is dropped (its link closed).
    ``attach_timeout_s``: how long a joining worker may take to answer ``Attach``.
    ``leave_grace_s``: a worker whose lease went while its link still beats (etcd was
    away) has this long to register again before it is dropped.
    The rest as ``Cluster``: ``policy``, ``ttft_slo_s``, ``tbt_slo_s``, ``rejection``,
    ``prefix_reuse``, ``multipath`` (a prefix fetch reads from every prefill worker that
    holds it, split by their load)."""

    def __init__(self, client: EtcdClient, prefix: str, token: str, *, policy: str = "mooncake",
                 ttft_slo_s: float = 30.0, tbt_slo_s: float = 1.0, rejection: str = "none",
                 prefix_reuse: bool = True, heartbeat_timeout_s: float = 5.0, attach_timeout_s: float = 30.0,
                 check_s: float = 0.5, seed: int = 0, leave_grace_s: float = 10.0, multipath: bool = False) -> None:
        self._init_routing()
        self.prefix_reuse = bool(prefix_reuse)
        self.multipath = bool(multipath)
        self.prefix = prefix
        self._token = token
        self._attach_timeout_s = attach_timeout_s
        self._heartbeat_timeout_s = float(heartbeat_timeout_s)
        self._leave_grace_s = leave_grace_s
        self._cfg_args: dict[str, Any] = dict(ttft_slo_s=float(ttft_slo_s), tbt_slo_s=float(tbt_slo_s),
                                              policy=policy, rejection=rejection, seed=seed)
        self._lock = threading.Lock()  # joins and leaves (membership and attach threads)
        self._members: dict[int, Member] = {}
        self._by_name: dict[str, int] = {}
        self._next_id = itertools.count(0)
        self._replies: queue.Queue[tuple[int, Message]] = queue.Queue()
        self.block_size: int | None = None
        self.conductor: Any = None  # built when the first worker is ready (its block size and bytes)
        self._hasher: Any = None
        self._limits = Limits(None, 1)  # the vocabulary, context and capacities: from the workers' Ready
        self._router = Router(_ServicePort(self), {})
        self._router_thread = threading.Thread(target=self._router.run, name="mooncake-router", daemon=True)
        self._router_thread.start()
        self._stop_watch = threading.Event()
        threading.Thread(target=watch, args=(lambda: list(self._members.values()), self._stop_watch,
                                             float(heartbeat_timeout_s), self._report_silent),
                         name="mooncake-watchdog", daemon=True).start()
        self._reattempts: dict[str, int] = {}  # name -> re-attaches since it was last ready
        self.membership = Membership(client, prefix, on_join=self._on_join, on_leave=self._on_leave, check_s=check_s,
                                     token=token)

    # ---- membership (the membership thread) and attaching (a thread per joining worker)
    def _on_join(self, record: WorkerRecord) -> None:
        threading.Thread(target=self._attach, args=(record,), name=f"mooncake-attach-{record.name}",
                         daemon=True).start()

    def _on_leave(self, name: str) -> None:
        inst = self._by_name.get(name)
        if inst is None:
            return
        m = self._members[inst]
        if m.alive and time.monotonic() - m.ch.last_seen < self._heartbeat_timeout_s / 2:
            # Its link is alive and beating: a lease that lapsed while etcd was away (the
            # worker registers again by itself) is no reason to fail its requests. Drop it
            # only if it has not come back within the grace period; a dead or cut-off
            # worker is caught by its link or the watchdog meanwhile.
            t = threading.Timer(self._leave_grace_s, self._leave_if_gone, args=(inst, name))
            t.daemon = True
            t.start()
            return
        self._router.events.put((inst, Lost(_LEASE_GONE)))

    def _leave_if_gone(self, inst: int, name: str) -> None:
        if not self._closed and name not in self.membership.members():
            self._router.events.put((inst, Lost(_LEASE_GONE + f", and it did not register again within "
                                                              f"{self._leave_grace_s:g}s")))

    def _attach(self, record: WorkerRecord) -> None:
        if self._closed:
            return
        fp = record.fingerprint
        with self._lock:
            old = self._by_name.get(record.name)
            if old is not None and self._members[old].alive:
                known = getattr(self._members[old], "record", None)
                if known is not None and known.same_worker(record):
                    return  # the same worker, seen again after a resync (or registered again)
                self._router.events.put((old, Lost("replaced by a new registration of its name")))
            twin = next((m for m in self._members.values() if m.alive and m.spec.name != record.name
                         and getattr(getattr(m, "record", None), "control", None) == record.control), None)
            if twin is not None:  # one worker, one attach: a second record cannot take it over
                log.error("conductor: worker record %s names the control address %s of live worker %s; ignored",
                          record.name, record.control, twin.spec.name)
                return
            inst = next(self._next_id)
        deadline = time.monotonic() + self._attach_timeout_s
        while True:
            try:
                sock = auth_socket.connect(record.control, self._token, timeout_s=5.0)
                break
            except ServiceUnavailable as e:
                if time.monotonic() > deadline or self._closed or record.name not in self.membership.members():
                    log.error("conductor: cannot reach worker %s at %s: %s", record.name, record.control, e)
                    return
                time.sleep(0.2)
            except MooncakeError as e:  # Unauthorized: another cluster's token
                log.error("conductor: worker %s at %s refused: %s", record.name, record.control, e)
                return
        spec = InstanceSpec(inst, record.role, record.name, fp.model, fp.block_size, 0)
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._router.lifecycle.names[inst] = record.name
            m = Member(spec, SocketChannel(sock, inst, self._router.events, FROM_REMOTE,
                                           name=f"conductor<-{record.name}"))
            m.record, m.remote = record, True
            self._members[inst] = m
            self._by_name[record.name] = inst
        m.ch.send(Attach(PROTOCOL_VERSION, inst, record.name))
        if not m.ready.wait(max(0.1, deadline - time.monotonic())):
            self._router.events.put((inst, Lost(f"did not answer Attach within {self._attach_timeout_s:g}s")))
            return
        if m.error is None:
            self._reattempts.pop(record.name, None)
            log.info("conductor: %s %s joined as instance %d (control %s, KV %s)", record.role, record.name, inst,
                     record.control, record.transfer)

    def _on_ready(self, inst: int, msg: Ready | InitFailed) -> None:
        """The router thread: a worker answered ``Attach``. The conductor routes to it
        from here on (built now if this is the first worker)."""
        m = self._members[inst]
        if isinstance(msg, InitFailed) or msg.version != PROTOCOL_VERSION:
            m.error = msg.error if isinstance(msg, InitFailed) else \
                f"protocol version {msg.version}, the conductor speaks {PROTOCOL_VERSION}"
            log.error("conductor: worker %s refused to attach: %s", m.spec.name, m.error)
            m.ready.set()
            self._router.events.put((inst, Lost(m.error)))
            return
        m.info = msg
        if self.conductor is None:
            self.block_size = m.spec.block_size
            self._hasher = PrefixHasher(self.block_size, seed=0)
            self.conductor = new_conductor(dict(self._cfg_args, block_size=self.block_size), msg.block_bytes,
                                           PrefillCostModel(c0=0.002, c_new=2e-5, c_new2=0.0, c_cross=0.0), [], [])
        elif m.spec.block_size != self.block_size:
            m.error = f"block size {m.spec.block_size}, the cluster's is {self.block_size}"
            m.ready.set()
            self._router.events.put((inst, Lost(m.error)))
            return
        if m.spec.role == "prefill":
            self.conductor.add_prefill(inst)
        else:
            # the worker's own batch limit (an older worker that does not say: the default)
            batch = {"max_batch": msg.max_num_seqs} if msg.max_num_seqs > 0 else {}
            self.conductor.add_decode(inst, kv_capacity_tokens=max(1, msg.kv_tokens), **batch)
        self._limits.block_size = self.block_size
        self._limits.learn(self._ready_infos())
        m.ready.set()

    def _on_down(self, inst: int, reason: str) -> str | None:
        """The router thread: ``inst`` is out (the conductor dropped it already)."""
        m = self._members.get(inst)
        if m is None or not m.alive:
            return None
        m.alive = False
        if not m.ready.is_set():
            m.error = m.error or reason
            m.ready.set()
        m.ch.close()
        with self._lock:
            if self._by_name.get(m.spec.name) == inst:
                del self._by_name[m.spec.name]
        self._limits.learn(self._ready_infos())
        what = m.down_reason or reason
        if not self._closed:
            log.warning("conductor: worker %s left (%s); failing its requests", m.spec.name, what)
            if m.info is not None and m.error is None:
                self._reattach_later(m.record)
        return f"worker {m.spec.name} left the cluster ({what})"

    def _reattach_later(self, record: WorkerRecord) -> None:
        """A worker that was serving lost its link while its record is still live: it may
        have been displaced (another conductor, or anything holding the token, attached it),
        or it crashed and its lease has not lapsed yet. Attach it again after a backoff
        (0.5 s doubling to 8 s); ``_attach`` gives up once its record leaves etcd."""
        k = self._reattempts.get(record.name, 0)
        self._reattempts[record.name] = k + 1
        delay = min(0.5 * 2 ** k, 8.0)

        def again() -> None:
            if self._closed:
                return
            live = self.membership.members().get(record.name)
            with self._lock:
                taken = (i := self._by_name.get(record.name)) is not None and self._members[i].alive
            if live is not None and live.same_worker(record) and not taken:
                log.warning("conductor: attaching worker %s again (its record is live)", record.name)
                self._attach(live)

        t = threading.Timer(delay, again)
        t.daemon = True
        t.start()

    def _ready_infos(self) -> list[Ready]:
        return [m.info for m in list(self._members.values()) if m.alive and m.info is not None]

    def _report_silent(self, inst: int, reason: str) -> None:
        """The watchdog: a worker stopped beating (a cut cable leaves its socket open)."""
        self._router.events.put((inst, Lost(reason)))

    # ---- the public API beside RoutedCluster's
    def _submit(self, prompt: Any, params: Any, timeout_s: float | None, handle_type: Any) -> Any:
        if self.conductor is None:
            raise ServiceUnavailable("no worker has joined the cluster yet; start `mooncake-rs worker` processes")
        return super()._submit(prompt, params, timeout_s, handle_type)

    def instances(self) -> dict[int, str]:
        """Live, ready workers: id -> name."""
        return {i: m.spec.name for i, m in list(self._members.items()) if m.alive and m.info is not None}

    def instance_stats(self, timeout_s: float = 30.0) -> dict[int, dict[str, float]]:
        """Per live worker: what its transfer engine moved and the rest of
        ``Cluster.instance_stats``. Call it idle."""
        out = {}
        for i, m in list(self._members.items()):
            if not (m.alive and m.info is not None):
                continue
            m.ch.send(Stats())
            try:
                src, reply = self._replies.get(timeout=timeout_s)
            except queue.Empty:
                raise MooncakeError(f"worker {m.spec.name} did not report its stats") from None
            if isinstance(reply, StatsReply):
                out[src] = reply.stats
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops routing: fails what is in flight, closes the workers' links (the workers
        keep running and wait for the next conductor)."""
        if self._closed:
            return
        self._closed = True
        self._stop_watch.set()
        self.membership.close()
        self._router.post(Shutdown())
        self._router_thread.join(timeout_s)
        self._router.fail_all(ServiceUnavailable("the conductor service stopped"))
        for m in list(self._members.values()):
            m.alive = False
            m.ch.close()
