"""The cluster's instances as members: how they are started (threads in this process,
or worker processes) with their control links and peer links, and what is known of
each (ready, alive, its capacities, why it went down). ``Cluster`` owns the members;
the router sees them only through the cluster's port.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from .._core import remove_shm_segments_of
from .control import Lost, QueueChannel, QueuePeer, SocketChannel
from .protocol import FROM_INSTANCE, PROTOCOL_VERSION, Codec, Init, InstanceSpec, Ready

__all__ = ["Member", "spawn_all", "mark_down", "remove_segments_of"]

log = logging.getLogger("mooncake_rs.serving")


def remove_segments_of(pid: int) -> None:
    """Unlinks the shared-memory segments a (gone) worker process created: its transfer
    engine's regions and store arena, ``/dev/shm/mooncake_rs.<pid>.<n>``."""
    remove_shm_segments_of(pid)


class Member:
    def __init__(self, spec: InstanceSpec, channel: Any, proc: subprocess.Popen[bytes] | None = None,
                 thread: threading.Thread | None = None) -> None:
        self.spec, self.ch, self.proc, self.thread = spec, channel, proc, thread
        self.ready = threading.Event()
        self.alive = True
        self.error: str | None = None
        self.info: Ready | None = None  # the instance's Ready message (capacities, block bytes)
        self.down_reason: str | None = None  # set by the watchdog before it kills a hung worker
        self.peers: list[Any] = []  # in-process: the instance's links to its peers (their counts)
        self.remote = False  # a worker of another host (deploy/): neither our thread nor our child
        self.record: Any = None  # deploy/: its etcd record

    def cluster_counts(self) -> collections.Counter[str]:
        """Messages the cluster sent this instance."""
        c = getattr(self.ch, "cluster_counts", None) or self.ch.counts
        return c.snapshot()



def spawn_all(specs: list[InstanceSpec], processes: bool, events: Any, registry: Any,
              transfer_token: str, instance_tokens: dict[int, str] | None = None, *,
              members: dict[int, Member] | None = None) -> dict[int, Member]:
    """Starts every instance with its control link to the cluster (into ``events``) and
    a peer link to every other instance (decode hands requests to prefill directly; links
    between instances of one role carry nothing until one of them switches roles). ``instance_tokens`` (worker processes, ``kv_grants``): instance id -> its
    own transfer token; each worker gets its own and every other one's by engine name.

    ``members``: the dict to fill (the cluster's own). Each member is in it before its
    instance can say anything: an in-process instance may send ``Ready`` before this
    function returns, and the router looks the sender up in this dict when it does."""
    # every pair of instances, not only prefill x decode: an instance can change its role
    # (Cluster.switch_role, roles.py) and then talks to the instances of its new other
    # role on links that exist already (a worker's links are fds it inherits at spawn)
    ids = [s.id for s in specs]
    pairs = [(a, b) for i, a in enumerate(ids) for b in ids[i + 1:]]
    members = {} if members is None else members
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
