"""One serving instance: an Engine, a Store (``StoreSlots``) and a TransferEngine
(``Transport``), driven by a loop that reads control messages, steps the engine and
reports back.

The same class runs inside the cluster's process (a thread per instance,
``processes=False``) and inside a worker process (``processes=True``, see worker.py).
Its inbox holds messages from the cluster (source ``CLUSTER``) and from its peers
(the other role's instances, source = their id): a decode instance hands requests to
prefill instances (``Prefill``) and hears back from them (``KvReady``) directly. Store
events (stored/evicted blocks) go to the cluster, which feeds the conductor's index. The
role-specific behaviour is in prefill.py and decode.py; what is common (pinning blocks
for a peer's prefix fetch, stats, calibration) is here.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import msgspec

from .._core import BlockHashes
from .arena import StoreSlots
from .control import CLUSTER, Detached, InstanceChannel, Lost
from .decode import DecodeRole
from .kv_events import KVEventsOut
from .prefill import PrefillRole
from .role import Role, RoleContext
from .replication import ReplicaCopies
from .protocol import (PROTOCOL_VERSION, Attach, Beat, Cancel, Endpoint, Export, Exported, Failed, InitFailed,
                       InstanceSpec, KvReady, Measure, Message, PeerLost, Prefill, Ready, RoleSwitched, Stats,
                       Replicate, StatsReply, Stop, StoreEvents, SwitchRole, Timings, Unpin)
from .transport import Transport

__all__ = ["InstanceSpec", "Instance", "model_of"]

log = logging.getLogger("mooncake_rs.serving")


def model_of(spec_model: Any) -> Any:
    """An ``InstanceSpec.model`` as the engine takes it: a preset name or model directory
    as is, a ModelConfig's fields (a dict on the wire) as a ModelConfig."""
    if isinstance(spec_model, str):
        return spec_model
    from ..engine import ModelConfig

    d = dict(spec_model)
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    return ModelConfig(**d)


class Instance:
    def __init__(self, spec: InstanceSpec, channel: Any, registry: Any = None, auth_token: str | None = None,
                 peers: dict[int, Any] | None = None, peer_tokens: dict[str, str] | None = None,
                 remote: bool = False) -> None:
        from ..engine import Engine

        self.spec = spec
        self.ch: InstanceChannel = channel  # to the cluster; ``recv`` reads the inbox (cluster and peers)
        # shared with the roles, not copied: a remote worker's table (deploy/worker_link.py)
        # reaches any peer through its conductor
        self.peers: Any = peers if peers is not None else {}
        self.engine = Engine(model_of(spec.model), block_size=spec.block_size, seed=spec.seed, **spec.engine_kwargs)
        self.layout = self.engine.layout
        self.store = StoreSlots(self.layout.block_nbytes, spec.dram_bytes, shared_memory=registry is None,
                                ssd_path=spec.ssd_path, ssd_bytes=spec.ssd_bytes, scope=spec.id)
        self.transport = Transport(spec.name, self.store.store, registry, spec.link_bandwidth,
                                   auth_token=auth_token, peers_write=spec.role == "decode",
                                   restricted=spec.kv_grants and spec.role == "decode", peer_tokens=peer_tokens,
                                   listen=spec.transfer_listen, transports=spec.transports)
        ep: dict[str, Any] = self.transport.endpoint
        self.endpoint = Endpoint(str(ep["name"]), str(ep["address"]), int(ep["region"]))
        self._pins: dict[int, list[Any]] = {}
        # hot-prefix copies into this instance's store (the cluster's Replicate, replication.py)
        self.replicas = ReplicaCopies(self.transport, self.store, self.ch.send)
        self.remote = remote  # a worker of a deployment across hosts: Ready comes on Attach
        self.kv_events: KVEventsOut | None = None
        if spec.kv_events is not None and spec.role == "prefill":
            # KV events out: this instance's store events, for indexers outside the cluster
            st = self.store.store.stats()
            self.kv_events = KVEventsOut(spec.kv_events, spec.kv_events_replay, spec.block_size,
                                         capacity=KVEventsOut.capacity_for(st.slots_dram + st.slots_ssd))
        self.role: Role = self._make_role()
        # a role switch (SwitchRole, Cluster.switch_role): the role asked for, until this
        # instance holds nothing and takes it; the role it had before (late messages of
        # requests it dropped still reach it, see handle); arenas registered for an
        # earlier role, unregistered once no pin of a peer's fetch may read them
        self._switch_to: str | None = None
        self._switch_qid = 0  # the SwitchRole's query id, which RoleSwitched answers
        self._former: Role | None = None
        self._retired: list[Any] = []
        self.stopped = False
        # the latest memory use, refreshed by the loop every beat period: what a worker's
        # beat thread sends (it never reads the engine itself), and in-process the beat
        self.usage = Beat()
        self._beat_every = spec.heartbeat_s if spec.heartbeat_s > 0 else 1.0
        self._beat_next = 0.0

    def _make_role(self) -> Role:
        ctx = RoleContext(self.spec, self.engine, self.store, self.transport, self.endpoint, self.ch.send, self.peers,
                          self.flush_store_events, self.kv_events)
        return PrefillRole(ctx) if self.spec.role == "prefill" else DecodeRole(ctx)

    # ---- the loop
    def run(self) -> None:
        self._beat()  # stamped before Ready: building the engine took a while, that was no hang
        if not self.remote:  # a remote worker says Ready when a conductor attaches
            self.ch.send(self.ready())
        try:
            while not self.stopped:
                if self.engine.has_unfinished():
                    timeout: float | None = 0
                elif self.role.busy():
                    timeout = 0.001
                else:
                    timeout = 0.05
                item = self.ch.recv(timeout)
                while item is not None and not self.stopped:
                    self.handle(*item)
                    item = self.ch.recv(0)
                try:
                    self._turn()
                except Exception as e:  # noqa: BLE001 - an instance dies only with its process
                    self._recover(e)
                self._beat()
        finally:
            self.transport.close()
            if self.kv_events is not None:
                self.kv_events.close()

    def _turn(self) -> None:
        """One turn of the loop after the inbox: the engine step and the roles' work."""
        self.role.send_pending()  # e.g. first tokens: before the engine step, not after it
        if self.engine.has_unfinished():
            self.role.on_outputs(self.engine.step())
            self.role.send_pending()
        self.role.poll()
        self.replicas.poll()
        self.flush_store_events()
        if self._switch_to is not None or self._retired:
            self._switch_role()

    def _recover(self, e: Exception) -> None:
        """Something raised outside any one request's error handling (the engine and the
        roles fail a request they can name on their own): every request this instance
        holds fails with the error, its state is dropped, and the loop goes on serving."""
        log.exception("instance %s: the loop raised; failing the %d requests it holds", self.spec.name,
                      self.role.tracked())
        why = f"{type(e).__name__}: {e}"
        rids = self.role.rids()
        for rid in rids:
            self.ch.send(Failed(rid, f"instance {self.spec.name} failed while serving it: {why}"))
        try:
            self.release_all()
            for seq in self.engine.unfinished_ids():  # sequences no role tracks any more
                self.engine.abort(seq)
                self.engine.release(seq)
        except Exception:  # noqa: BLE001 - logged; the next turn starts from what is left
            log.exception("instance %s: dropping the failed requests raised too", self.spec.name)

    def ready(self) -> Ready:
        cache, cfg = self.engine.cache, self.engine.config
        return Ready(PROTOCOL_VERSION, self.endpoint, os.getpid(), self.layout.block_nbytes, self.store.store.slots,
                     cache.num_pages * cache.page_size, vocab_size=cfg.vocab_size,
                     max_positions=cfg.max_position_embeddings, max_num_seqs=self.engine.max_num_seqs)

    def attach(self, msg: Attach) -> None:
        """A conductor service took this worker (deploy/): serve as ``msg.id`` from now
        on, after dropping what an earlier conductor left, and tell it all the store holds."""
        if msg.name != self.spec.name:
            # A conductor that took another worker's record for this one (a copy in etcd
            # under another name, pointing here through a relay): refusing keeps the
            # conductor that attached this worker under its own name.
            self.ch.refuse_pending(InitFailed(f"this worker is {self.spec.name!r}, not {msg.name!r}"))
            return
        self.release_all()  # what it says of those still goes to the old conductor, if any
        self.ch.adopt()
        if msg.version != PROTOCOL_VERSION:
            self.ch.send(InitFailed(f"protocol version {msg.version} from the conductor, this worker speaks "
                                    f"{PROTOCOL_VERSION}"))
            return
        self.spec = msgspec.structs.replace(self.spec, id=msg.id)
        self.role.ctx.spec = self.spec
        self.ch.send(self.ready())
        if self.spec.role == "prefill":
            self._announce_held()

    def _announce_held(self) -> None:
        """Everything the store holds, as stored events, to a conductor whose index was
        not fed this store's events from the start (one that just attached, or a pool
        this instance just joined); the events drained after it follow as usual."""
        held = self.store.store.held_events()
        if len(held):
            self.ch.send(StoreEvents(held.to_bytes()))

    def release_all(self) -> None:
        """Drops every request this instance holds state for (its conductor is gone, or
        a new one attached): engine sequences, slots, leases and pins."""
        for rid in self.role.rids():
            self.role.handle(CLUSTER, Cancel(rid))
        for blocks in self._pins.values():
            for blk in blocks:
                blk.release()
        self._pins.clear()
        self.replicas.drop_all()

    def handle(self, src: int, msg: Message | Lost | Detached) -> None:
        try:
            match msg:
                case Stop():
                    self.stopped = True
                case Lost(reason=reason):
                    if src == CLUSTER:  # the cluster is gone: never outlive it
                        self.stopped = True
                    else:  # the cluster fences that peer (a request may wait on this link)
                        log.info("instance %s: peer %d lost (%s)", self.spec.name, src, reason)
                        self.ch.send(PeerLost(src, reason))
                case Detached(reason=reason):  # a remote worker's conductor went away: wait for the next
                    log.warning("instance %s: the conductor's link closed (%s); dropping %d requests",
                                self.spec.name, reason, self.role.tracked())
                    self.release_all()
                case Attach():
                    self.attach(msg)
                case Export():
                    self._export(msg)
                case Replicate():
                    self.replicas.start(msg)
                case Unpin(rid=rid):
                    for blk in self._pins.pop(rid, []):
                        blk.release()
                case Stats(qid=qid):
                    self.ch.send(StatsReply(self.stats(), qid=qid))
                case SwitchRole(role=role, qid=qid):
                    self._switch_to, self._switch_qid = role, qid
                    self._switch_role()
                case Measure(points=points, repeats=repeats, qid=qid):
                    # one point at a time (each warms up on its own anyway), beating in between:
                    # a long calibration in-process is no wedged loop (liveness.py)
                    timings = []
                    for point in points:
                        timings += self.engine.measure_prefill([point], repeats=repeats)
                        self._beat()
                    self.ch.send(Timings([(t.new_tokens, t.cached_tokens, t.seconds) for t in timings], qid=qid))
                case Prefill() | KvReady() | Cancel() if self._former is not None:
                    self._after_switch(src, msg)
                case _:
                    self.role.handle(src, msg)
        except Exception as e:  # a bad request fails that request, not the instance
            log.exception("instance %s: %s failed", self.spec.name, type(msg).__name__)
            of = getattr(msg, "rid", None)
            # a call of the cluster's own (stats, calibration, a switch) is answered under its query id
            qid = msg.qid if isinstance(msg, (Stats, Measure, SwitchRole)) else 0
            self.ch.send(Failed(of if isinstance(of, int) else None, f"{type(e).__name__}: {e}", qid=qid))

    def _switch_role(self) -> None:
        """Takes the role ``SwitchRole`` asked for once this instance holds nothing (no
        request state, no sequence in the engine, no copy in flight): a new role object
        over the same engine, store and transport, the arena registered again with the
        new role's rights for peers, then ``RoleSwitched``. Also unregisters the arenas
        of earlier roles once no peer's fetch may still read them (nothing pinned)."""
        if self._retired and not self._pins:
            for region in self._retired:
                self.transport.retire(region)
            self._retired = []
        to = self._switch_to
        if to is None or self.role.tracked() or self.engine.has_unfinished():
            return
        self._switch_to = None
        if to != self.spec.role:
            self.flush_store_events()  # the index hears of this role's last blocks first
            spec = self.spec
            self.spec = msgspec.structs.replace(spec, role=to)
            self._retired.append(self.transport.reregister(
                self.store.store, peers_write=to == "decode", restricted=spec.kv_grants and to == "decode"))
            ep: dict[str, Any] = self.transport.endpoint
            self.endpoint = Endpoint(str(ep["name"]), str(ep["address"]), int(ep["region"]))
            self._former, self.role = self.role, self._make_role()
            log.info("instance %s: now a %s instance", spec.name, to)
        self.ch.send(RoleSwitched(self.spec.role, self.endpoint, qid=self._switch_qid))
        if to == "prefill":  # what it kept as a decode instance is reusable now
            self._announce_held()

    def _after_switch(self, src: int, msg: Message) -> None:
        """A peer or cancel message once the role changed. The drain ended every request
        of the old role, but messages about them can still come on other links: a
        ``Prefill`` whose cancel overtook it, a ``KvReady`` racing a cancel, a ``Cancel``
        whose ack the cluster waits for. The role that knows the request takes it (the
        former one remembers what it dropped); a cancel goes to both, so an old prefill
        request is still acked."""
        former = self._former
        assert former is not None
        if isinstance(msg, Cancel):
            known = self.role.holds(msg.rid)
            self.role.handle(src, msg)
            if not known and former.ctx.spec.role != self.spec.role:
                former.handle(src, msg)
        elif isinstance(msg, Prefill) and self.spec.role == "decode":
            former.handle(src, msg)
        elif isinstance(msg, KvReady) and self.spec.role == "prefill":
            former.handle(src, msg)
        else:
            self.role.handle(src, msg)

    def _beat(self) -> None:
        """Once a beat period: refresh ``usage``; in-process, beat through the channel.
        The loop itself beats there, so a loop that stops turning (a wedged thread) stops
        beating and the cluster's watchdog notices (liveness.py)."""
        now = time.monotonic()
        if now < self._beat_next:
            return
        self._beat_next = now + self._beat_every
        st = self.store.store.stats()
        sched = self.engine.scheduler
        out_b, in_b = self.transport.link_queued()
        self.usage = Beat(self.engine.cache.num_pages, self.engine.num_free_pages, st.blocks_dram, st.slots_dram,
                          st.bytes_dram, len(sched.running), len(sched.waiting), out_b, in_b, now)
        self.ch.beat(self.usage)  # in-process: stamped; a worker's beat thread sends ``usage`` itself

    def stats(self) -> dict[str, float]:
        t = self.transport
        out: dict[str, float] = {"copied_bytes": t.total_bytes, "copy_busy_s": t.busy_s, "blocks": len(self.store),
                                 "evictions": self.store.evictions,
                                 # what a finished or cancelled request must not leave behind
                                 "requests": self.role.tracked(), "pinned_requests": len(self._pins),
                                 "free_pages": self.engine.num_free_pages, "pages": self.engine.cache.num_pages,
                                 # live transfer grants on the arena (kv_grants: none once idle)
                                 "grants": len(t.te.grants(t.region)) if t.region.restricted else 0,
                                 # bytes same-host peers wrote into the arena on the staged path
                                 "staged_bytes": t.te.stats().bytes_staged}
        # messages this instance sent, by op (the hop count, docs/serving.md)
        for link in [self.ch, *self.peers.values()]:
            for op, n in link.counts.snapshot().items():
                out[f"sent.{op}"] = out.get(f"sent.{op}", 0.0) + n
        return out

    def _export(self, msg: Export) -> None:
        """Pins the longest held prefix of ``keys`` and names its slots' offsets."""
        blocks = self.store.lookup_prefix(BlockHashes(msg.keys))  # promoted: in DRAM, at an offset
        offsets: list[int] = []
        for i, b in enumerate(blocks):
            if b.offset is None:  # not addressable by a peer: the prefix ends here
                for rest in blocks[i:]:
                    rest.release()
                blocks = blocks[:i]
                break
            offsets.append(b.offset)
        self._pins.setdefault(msg.rid, []).extend(blocks)
        self.ch.send(Exported(msg.rid, self.endpoint, offsets))

    def flush_store_events(self) -> None:
        events = self.store.drain_events()
        if events and self.spec.role == "prefill":
            self.ch.send(StoreEvents(events))
            if self.kv_events is not None:
                self.kv_events.on_store_events(events)

    @staticmethod
    def now() -> float:
        return time.monotonic()
