"""``ConductorService``: the conductor and router of a deployment across hosts, over the
workers etcd knows (what ``mooncake-rs serve --etcd`` runs while it leads).

Like the embedded ``Cluster`` it holds a routed core (serving/routed.py) and exposes its
request API (``RoutedApi``: ``submit`` / ``generate`` / ``metrics_text``); only
membership differs. ``Membership`` (membership.py) reports
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
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import MooncakeError, ServiceUnavailable
from ..serving.config import HEARTBEAT_ACROSS_HOSTS_S, ServingConfig
from ..serving.control import SocketChannel
from ..serving.limits import Limits
from ..serving.members import Member, Members
from ..serving.protocol import FROM_REMOTE, PROTOCOL_VERSION, Attach, InitFailed, InstanceSpec, Ready
from ..serving.routed import RoutedApi, RoutedCluster, default_prefill_model, new_conductor
from ..client.handle import RequestHandle
from ..client.records import WorkerRecord
from ..net import auth_socket
from ..net.etcd import EtcdClient
from .membership import Membership

__all__ = ["ConductorService"]

log = logging.getLogger("mooncake_rs.deploy")


_LEASE_GONE = "its etcd lease expired or was revoked (shut down, crashed or cut off)"


class ConductorService(RoutedApi):
    """Routes requests over the workers registered under ``prefix`` in etcd.

    ``token``: the cluster token (control links are authenticated with it).
    ``heartbeat_timeout_s``: a worker silent this long is dropped (its link closed).
    ``attach_timeout_s``: how long a joining worker may take to answer ``Attach``.
    ``leave_grace_s``: a worker whose lease went while its link still beats (etcd was
    away) has this long to register again before it is dropped.
    The rest as ``Cluster``: ``policy``, ``ttft_slo_s``, ``tbt_slo_s``, ``rejection``,
    ``prefix_reuse``, ``multipath`` (a prefix fetch reads from every prefill worker that
    holds it, split by their load), ``seed``; or all of them at once as ``config`` (a
    ``ServingConfig``: ``serve --etcd`` makes it with ``ServingConfig.from_args``; its
    instance fields are the workers' own business and not read here).

    It is the membership source of the routed core it holds (routed.MembershipSource):
    workers join through etcd and ``Attach``, and leave with their link or lease."""

    def __init__(self, client: EtcdClient, prefix: str, token: str, *, policy: str = "mooncake",
                 ttft_slo_s: float = 30.0, tbt_slo_s: float = 1.0, rejection: str = "none",
                 prefix_reuse: bool = True, heartbeat_timeout_s: float = HEARTBEAT_ACROSS_HOSTS_S,
                 attach_timeout_s: float = 30.0, check_s: float = 0.5, seed: int = 0, leave_grace_s: float = 10.0,
                 multipath: bool = False, config: ServingConfig | None = None) -> None:
        if config is None:
            config = ServingConfig(policy=policy, ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s, rejection=rejection,
                                   prefix_reuse=prefix_reuse, heartbeat_timeout_s=heartbeat_timeout_s, seed=seed,
                                   multipath=multipath)
        if config.heartbeat_timeout_s is None:
            raise MooncakeError("the conductor service needs a heartbeat timeout (a cut cable leaves a worker's "
                                "socket silent, not closed)")
        self.prefix = prefix
        self._token = token
        self._attach_timeout_s = attach_timeout_s
        self._heartbeat_timeout_s = config.heartbeat_timeout_s
        self._leave_grace_s = leave_grace_s
        self._lock = threading.Lock()  # joins and leaves (membership and attach threads)
        self._by_name: dict[str, int] = {}
        self._next_id = itertools.count(0)
        # block size, hasher and conductor: from the first worker that is ready (its block
        # size and bytes); the vocabulary, context and capacities: from the workers' Ready
        self._core = RoutedCluster(config, Members(), self, block_size=None, limits=Limits(None, 1))
        self._core.start_watchdog(config.heartbeat_timeout_s)
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
        m = self._core.members[inst]
        if m.alive and time.monotonic() - m.ch.last_seen < self._heartbeat_timeout_s / 2:
            # Its link is alive and beating: a lease that lapsed while etcd was away (the
            # worker registers again by itself) is no reason to fail its requests. Drop it
            # only if it has not come back within the grace period; a dead or cut-off
            # worker is caught by its link or the watchdog meanwhile.
            t = threading.Timer(self._leave_grace_s, self._leave_if_gone, args=(inst, name))
            t.daemon = True
            t.start()
            return
        self._core.report_down(inst, _LEASE_GONE)

    def _leave_if_gone(self, inst: int, name: str) -> None:
        if not self._core.closed and name not in self.membership.members():
            self._core.report_down(inst, _LEASE_GONE + f", and it did not register again within {self._leave_grace_s:g}s")

    def _attach(self, record: WorkerRecord) -> None:
        if self._core.closed:
            return
        fp = record.fingerprint
        with self._lock:
            old = self._by_name.get(record.name)
            if old is not None and self._core.members[old].alive:
                known = self._core.members[old].record
                if known is not None and known.same_worker(record):
                    return  # the same worker, seen again after a resync (or registered again)
                self._core.report_down(old, "replaced by a new registration of its name")
            twin = next((m for m in self._core.members.values() if m.alive and m.spec.name != record.name
                         and m.record is not None and m.record.control == record.control), None)
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
                if time.monotonic() > deadline or self._core.closed or record.name not in self.membership.members():
                    log.error("conductor: cannot reach worker %s at %s: %s", record.name, record.control, e)
                    return
                time.sleep(0.2)
            except MooncakeError as e:  # Unauthorized: another cluster's token
                log.error("conductor: worker %s at %s refused: %s", record.name, record.control, e)
                return
        spec = InstanceSpec(inst, record.role, record.name, fp.model, fp.block_size, 0)
        with self._lock:
            if self._core.closed:
                sock.close()
                return
            self._core.router.lifecycle.names[inst] = record.name
            m = Member(spec, SocketChannel(sock, inst, self._core.router.events, FROM_REMOTE,
                                           name=f"conductor<-{record.name}"))
            m.record, m.remote = record, True
            self._core.members.add(m)
            self._by_name[record.name] = inst
        m.ch.to_instance(Attach(PROTOCOL_VERSION, inst, record.name))
        if not m.ready.wait(max(0.1, deadline - time.monotonic())):
            self._core.report_down(inst, f"did not answer Attach within {self._attach_timeout_s:g}s")
            return
        if m.error is None:
            self._reattempts.pop(record.name, None)
            log.info("conductor: %s %s joined as instance %d (control %s, KV %s)", record.role, record.name, inst,
                     record.control, record.transfer)

    # ---- the membership source (routed.MembershipSource; the router thread)
    def on_ready(self, inst: int, msg: Ready | InitFailed) -> None:
        """A worker answered ``Attach``. The conductor routes to it from here on (built now
        if this is the first worker)."""
        err = self._core.members.ready(inst, msg, "the conductor", admit=self._admit)
        if err is not None:
            log.error("conductor: worker %s refused to attach: %s", self._core.members[inst].spec.name, err)
            self._core.report_down(inst, err)

    def _admit(self, m: Member, msg: Ready) -> str | None:
        core = self._core
        if core.conductor is None:
            core.set_block_size(m.spec.block_size)
            # the first worker's store size stands for every instance's staging room
            core.conductor = new_conductor(self.config.conductor_args(m.spec.block_size, m.spec.dram_bytes),
                                           msg.block_bytes,
                                           default_prefill_model(), [], [])
        elif m.spec.block_size != core.block_size:
            return f"block size {m.spec.block_size}, the cluster's is {core.block_size}"
        if m.role == "prefill":
            core.conductor.add_prefill(m.spec.id)
        else:
            # the worker's own batch limit (an older worker that does not say: the default)
            batch = {"max_batch": msg.max_num_seqs} if msg.max_num_seqs > 0 else {}
            core.conductor.add_decode(m.spec.id, kv_capacity_tokens=max(1, msg.kv_tokens), **batch)
        core.limits.learn([*core.members.ready_infos(), msg])
        return None

    def on_down(self, inst: int, reason: str) -> str | None:
        """``inst`` is out (the conductor dropped it already)."""
        m = self._core.members.down(inst, reason)
        if m is None:
            return None
        m.ch.close()
        with self._lock:
            if self._by_name.get(m.spec.name) == inst:
                del self._by_name[m.spec.name]
        self._core.limits.learn(self._core.members.ready_infos())
        what = m.down_reason or reason
        if not self._core.closed:
            log.warning("conductor: worker %s left (%s); failing its requests", m.spec.name, what)
            if m.info is not None and m.error is None:
                self._reattach_later(m.record)
        return f"worker {m.spec.name} left the cluster ({what})"

    def on_peer_lost(self, inst: int, peer: int, reason: str) -> None:
        pass  # workers have no peer links of their own (Relay)

    def exited(self) -> list[int]:
        return []  # not our processes: a worker that exits closes its link

    def _reattach_later(self, record: WorkerRecord) -> None:
        """A worker that was serving lost its link while its record is still live: it may
        have been displaced (another conductor, or anything holding the token, attached it),
        or it crashed and its lease has not lapsed yet. Attach it again after a backoff
        (0.5 s doubling to 8 s); ``_attach`` gives up once its record leaves etcd."""
        k = self._reattempts.get(record.name, 0)
        self._reattempts[record.name] = k + 1
        delay = min(0.5 * 2 ** k, 8.0)

        def again() -> None:
            if self._core.closed:
                return
            live = self.membership.members().get(record.name)
            with self._lock:
                taken = (i := self._by_name.get(record.name)) is not None and self._core.members[i].alive
            if live is not None and live.same_worker(record) and not taken:
                log.warning("conductor: attaching worker %s again (its record is live)", record.name)
                self._attach(live)

        t = threading.Timer(delay, again)
        t.daemon = True
        t.start()

    def submit_forwarded(self, prompt: list[int], params: Any, timeout_s: float | None,
                         handle_type: Callable[[int, list[int], Any], RequestHandle]) -> RequestHandle:
        """``submit`` of a remote client's request (service_clients.py): its handle is
        ``handle_type(rid, prompt, on_cancel)``, which forwards the tokens to the client."""
        return self._core.submit(prompt, params, timeout_s, handle_type)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops routing: fails what is in flight, closes the workers' links (the workers
        keep running and wait for the next conductor)."""
        if self._core.closed:
            return
        self._core.closed = True
        self.membership.close()
        self._core.stop_routing(ServiceUnavailable("the conductor service stopped"), timeout_s)
        for m in list(self._core.members.values()):
            m.alive = False
            m.ch.close()
