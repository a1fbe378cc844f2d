"""The cluster's instances as members: how they are started (threads in this process,
or worker processes) with their control links and peer links, and what is known of
each (ready, alive, its role, its capacities, why it went down).

``Members`` is the table of one routed cluster (routed.py): add, ready, down, the roles'
pools and the instances' memory use as of their heartbeats. ``SpawnedInstances`` is the
membership source of an embedded ``Cluster`` (instances it started itself); the
conductor service's is deploy/service.py's (workers found in etcd).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .._core import remove_shm_segments_of
from .control import ControlLink, Lost, QueueChannel, QueuePeer, SocketChannel
from .protocol import FROM_INSTANCE, PROTOCOL_VERSION, Codec, Init, InitFailed, InstanceSpec, Ready

__all__ = ["Member", "Members", "SpawnedInstances", "spawn_all", "mark_down", "remove_segments_of"]

log = logging.getLogger("mooncake_rs.serving")


def remove_segments_of(pid: int) -> None:
    """Unlinks the shared-memory segments a (gone) worker process created: its transfer
    engine's regions and store arena, ``/dev/shm/mooncake_rs.<pid>.<n>``."""
    remove_shm_segments_of(pid)


class Member:
    def __init__(self, spec: InstanceSpec, channel: ControlLink, proc: subprocess.Popen[bytes] | None = None,
                 thread: threading.Thread | None = None) -> None:
        self.spec, self.ch, self.proc, self.thread = spec, channel, proc, thread
        self.role = spec.role  # the pool it serves now (a role switch changes it, roles.py)
        self.ready = threading.Event()
        self.alive = True
        self.error: str | None = None
        self.info: Ready | None = None  # the instance's Ready message (capacities, block bytes)
        self.down_reason: str | None = None  # set by the watchdog before it kills a hung worker
        self.peers: list[Any] = []  # in-process: the instance's links to its peers (their counts)
        self.remote = False  # a worker of another host (deploy/): neither our thread nor our child
        self.record: Any = None  # deploy/: its etcd record
        self.link_taken = -1.0  # link_t of the last link reading handed to the conductor

    @property
    def live(self) -> bool:
        """Alive and ready: the conductor routes to it."""
        return self.alive and self.info is not None

    def cluster_counts(self) -> collections.Counter[str]:
        """Messages the cluster sent this instance."""
        return self.ch.cluster_counts.snapshot()


class Members:
    """The instances of one routed cluster, by id. Written by the thread that adds an
    instance and by the router thread (ready, down); read from any thread."""

    def __init__(self) -> None:
        self._by_id: dict[int, Member] = {}
        self._lock = threading.Lock()

    # ---- the table
    def add(self, m: Member) -> None:
        with self._lock:
            self._by_id[m.spec.id] = m

    def __setitem__(self, inst: int, m: Member) -> None:
        if inst != m.spec.id:
            raise ValueError(f"member {m.spec.name} has id {m.spec.id}, not {inst}")
        self.add(m)

    def get(self, inst: int) -> Member | None:
        return self._by_id.get(inst)

    def __getitem__(self, inst: int) -> Member:
        return self._by_id[inst]

    def __contains__(self, inst: object) -> bool:
        return inst in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._by_id))

    def values(self) -> list[Member]:
        return list(self._by_id.values())

    def items(self) -> list[tuple[int, Member]]:
        return list(self._by_id.items())

    def live(self) -> dict[int, Member]:
        """Alive and ready instances, by id."""
        return {i: m for i, m in self.items() if m.live}

    def ready_infos(self) -> list[Ready]:
        """The ``Ready`` of every live instance (its capacities; Limits learns them)."""
        return [m.info for m in self.values() if m.live and m.info is not None]

    # ---- ready and down (the router thread)
    def ready(self, inst: int, msg: Ready | InitFailed, speaker: str = "the cluster",
              admit: Callable[[Member, Ready], str | None] | None = None) -> str | None:
        """Instance ``inst`` answered: records its ``Ready`` (or why it did not start) and
        wakes whoever waits for it. ``admit(member, ready)``, before it counts as live:
        takes it into service (the conductor), or says why not. Returns the error, None
        when it is ready."""
        m = self._by_id[inst]
        if not m.alive:  # declared down first (it did not answer in time): a late answer admits nothing
            return m.error or "the instance is down"
        if isinstance(msg, InitFailed):
            err: str | None = msg.error
        elif msg.version != PROTOCOL_VERSION:
            err = f"protocol version {msg.version}, {speaker} speaks {PROTOCOL_VERSION}"
        else:
            err = None if admit is None else admit(m, msg)
        if err is None:
            assert isinstance(msg, Ready)
            m.info = msg
        else:
            m.error = err
        m.ready.set()
        return err

    def down(self, inst: int, reason: str) -> Member | None:
        """Marks a live member dead; the member, or None if it was not alive."""
        m = self._by_id.get(inst)
        if m is None or not m.alive:
            return None
        m.alive = False
        if not m.ready.is_set():
            m.error = m.error or reason or "the instance went away during start-up"
            m.ready.set()
        return m

    # ---- the roles' pools
    def ids(self, role: str) -> list[int]:
        """Every instance of ``role`` (down ones too: the ids a conductor is built over)."""
        return sorted(i for i, m in self.items() if m.role == role)

    def switched(self, inst: int, role: str) -> None:
        """``inst`` serves ``role`` from now on (roles.py, once the instance said so)."""
        self._by_id[inst].role = role

    # ---- memory use, as of the heartbeats
    def usage(self) -> dict[int, dict[str, float]]:
        """Per live instance, its memory use as of its latest heartbeat (see
        ``RoutedCluster.kv_usage``); an instance that has not beaten yet is left out."""
        out: dict[int, dict[str, float]] = {}
        now = time.monotonic()
        for i, m in self.items():
            b = m.ch.last_beat
            if not m.alive or b is None or b.kv_pages < 0:
                continue
            out[i] = {"kv_used_blocks": float(b.kv_pages - b.kv_free_pages), "kv_free_blocks": float(b.kv_free_pages),
                      "store_used_blocks": float(b.store_blocks), "store_slots": float(b.store_slots),
                      "store_used_bytes": float(b.store_bytes), "engine_running": float(b.running),
                      "engine_waiting": float(b.waiting), "heartbeat_age_seconds": now - m.ch.last_seen}
        return out


    # ---- link counters, as of the heartbeats
    def link_reports(self) -> list[tuple[int, float, float, float]]:
        """``(instance, when, bytes out, bytes in)``: each live instance's latest link
        reading (its transfer engine's bytes queued or in flight, ``Beat``) not handed
        out yet, once per reading; ``when`` is ``time.monotonic()`` on this host when it
        was taken (the beat's arrival less its age). Called by the router thread."""
        out = []
        for i, m in self.items():
            b = m.ch.last_beat
            if not m.live or b is None or b.link_t < 0 or b.link_t == m.link_taken:
                continue
            m.link_taken = b.link_t
            out.append((i, m.ch.last_beat_at, max(0.0, b.link_out_bytes), max(0.0, b.link_in_bytes)))
        return out


class SpawnedInstances:
    """The membership source of an embedded cluster (routed.MembershipSource): instances
    it started itself, in threads or child processes (``spawn_all``)."""

    def __init__(self, members: Members, closing: Callable[[], bool]) -> None:
        self.members = members
        self._closing = closing

    def on_ready(self, inst: int, msg: Ready | InitFailed) -> None:
        self.members.ready(inst, msg)

    def on_down(self, inst: int, reason: str) -> str | None:
        m = self.members.get(inst)
        if m is None or not m.alive:
            return None
        return mark_down(m, reason, quiet=self._closing())

    def on_peer_lost(self, inst: int, peer: int, reason: str) -> None:
        m = self.members.get(peer)
        if self._closing() or m is None or not m.alive or m.proc is None or m.proc.poll() is not None:
            return  # closing, or the peer is dead already (its own link says so)
        log.warning("serving: %s lost its link to %s (%s); killing %s", self.members[inst].spec.name, m.spec.name,
                    reason, m.spec.name)
        m.proc.kill()  # its control link then closes: the usual death path

    def exited(self) -> list[int]:
        return [i for i, m in self.members.items() if m.alive and m.proc is not None and m.proc.poll() is not None]



def spawn_all(specs: list[InstanceSpec], processes: bool, events: Any, registry: Any,
              transfer_token: str, instance_tokens: dict[int, str] | None = None, *,
              members: Members | dict[int, Member] | None = None) -> Members | dict[int, Member]:
    """Starts every instance with its control link to the cluster (into ``events``) and
    a peer link to every other instance (decode hands requests to prefill directly; links
    between instances of one role carry nothing until one of them switches roles). ``instance_tokens`` (worker processes, ``kv_grants``): instance id -> its
    own transfer token; each worker gets its own and every other one's by engine name.

    ``members``: the table to fill (the cluster's own). Each member is in it before its
    instance can say anything: an in-process instance may send ``Ready`` before this
    function returns, and the router looks the sender up in this dict when it does."""
    # every pair of instances, not only prefill x decode: an instance can change its role
    # (Cluster.switch_role, roles.py) and then talks to the instances of its new other
    # role on links that exist already (a worker's links are fds it inherits at spawn)
    ids = [s.id for s in specs]
    pairs = [(a, b) for i, a in enumerate(ids) for b in ids[i + 1:]]
    members = Members() if members is None else members
    if not processes:
        chans = {s.id: QueueChannel(s.id, events) for s in specs}
        peers: dict[int, dict[int, Any]] = {s.id: {} for s in specs}
        for p, d in pairs:
            peers[p][d] = QueuePeer(p, chans[d].inbox)
            peers[d][p] = QueuePeer(d, chans[p].inbox)
        for spec in specs:
            m = Member(spec, chans[spec.id])
            m.peers = list(peers[spec.id].values())
            members[spec.id] = m
        for spec in specs:
            m = members[spec.id]
            m.thread = threading.Thread(target=_run_instance, args=(spec, m.ch, peers[spec.id], registry, events),
                                        name=f"mooncake-{spec.name}", daemon=True)
            m.thread.start()
        return members
    ends: dict[int, dict[int, socket.socket]] = {s.id: {} for s in specs}
    for p, d in pairs:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ends[p][d], ends[d][p] = a, b
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    codec = Codec()
    try:
        for spec in specs:
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            mine = ends[spec.id]
            fds = (child.fileno(), *[s.fileno() for s in mine.values()])
            proc = subprocess.Popen([sys.executable, "-m", "mooncake_rs.serving.worker", "--fd",
                                     str(child.fileno())], pass_fds=fds, env=env, stdin=subprocess.DEVNULL)
            child.close()
            # The token travels on the private socketpair, never on a command line or in
            # the environment, where other local users could read it.
            toks = instance_tokens or {}
            parent.sendall(codec.encode(Init(PROTOCOL_VERSION, spec, transfer_token,
                                             {peer: s.fileno() for peer, s in mine.items()},
                                             token=toks.get(spec.id, ""),
                                             peer_tokens={o.name: toks[o.id] for o in specs
                                                          if o.id != spec.id and o.id in toks})))
            for s in mine.values():  # the worker has its ends now
                s.close()
            mine.clear()
            members[spec.id] = Member(
                spec, SocketChannel(parent, spec.id, events, FROM_INSTANCE, name=f"cluster<-{spec.name}"), proc=proc)
    finally:
        for mine in ends.values():
            for s in mine.values():
                s.close()
    return members


def _run_instance(spec: InstanceSpec, ch: QueueChannel, peers: dict[int, Any], registry: Any, events: Any) -> None:
    from .instance import Instance

    try:
        Instance(spec, ch, registry, peers=peers).run()
    except BaseException as e:  # noqa: BLE001 - reported to the router
        log.exception("instance %s crashed", spec.name)
        events.put((spec.id, Lost(f"{type(e).__name__}: {e}")))


def mark_down(m: Member, reason: str, *, quiet: bool = False) -> str:
    """Marks a live member dead (the router thread): fences and reaps a worker, removes
    its segments, and says what happened to it ("instance decode-0 died (signal 9)")."""
    m.alive = False
    if not m.ready.is_set():
        m.error = reason or "the worker exited during start-up"
        m.ready.set()
    code = m.proc.poll() if m.proc is not None else None
    if m.proc is not None and code is None and m.down_reason is None:
        # The link closed first: a dying process closes its sockets before it can be
        # reaped, so give it a moment to be seen as what it is.
        try:
            code = m.proc.wait(0.5)
        except subprocess.TimeoutExpired:
            # Its link closed (a bad frame, a socket error) but the process runs: kill
            # it, the fence for the slots it could still write into.
            m.down_reason = f"lost its control link ({reason}) and was killed"
            m.proc.kill()
    why = f"exit code {code}" if code is not None and code >= 0 else (
        f"signal {-code}" if code is not None else (reason or "lost"))
    if m.down_reason is not None:  # the watchdog killed it (see liveness.py), or the line above
        what = m.down_reason
        try:
            if m.proc is not None:
                m.proc.wait(5)  # SIGKILLed: reap it so its segments go now
        except Exception:  # noqa: BLE001 - swept at close() then
            pass
    else:
        what = f"died ({why})"
    if m.proc is None:
        # an in-process thread (wedged, see liveness.py, or crashed): should it wake, its
        # next read is Stop and nothing it sends reaches the cluster
        m.ch.fence()
    if not quiet:
        log.warning("serving: instance %s %s; failing its requests", m.spec.name, what)
    if m.proc is not None and m.proc.poll() is not None:
        remove_segments_of(m.proc.pid)
    return f"instance {m.spec.name} {what}"
