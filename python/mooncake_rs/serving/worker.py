"""Entry point of a worker process (``processes=True``): one instance per process.

Spawned by the cluster as ``python -m mooncake_rs.serving.worker --fd N`` with one end
of a socketpair as fd N (the control link). The first frame on it is ``Init``: the
``InstanceSpec``, the cluster's transfer token and the inherited descriptors that are
peer links (one socketpair per prefill/decode pair, made by the cluster). The protocol
version is checked there (a mismatch is reported as ``InitFailed``). Then the instance
loop runs until ``Stop`` or until the control link closes (the cluster died, or it
sent a frame that does not decode), so a worker never outlives its cluster. The arena
lives in /dev/shm and is unlinked on the way out (the cluster also removes it if this
process is killed).

A heartbeat thread sends ``Beat`` every ``spec.heartbeat_s`` seconds. It runs apart
from the instance loop on purpose: a long engine step is not a hang, but a process that
is stopped (SIGSTOP), starved or wedged with the GIL held sends no beats, and the
cluster's watchdog then kills it and fails its requests (see liveness.py). Each beat
carries the instance's KV and store use as its loop last saw it (``Instance.usage``):
the cluster's KV gauges, without a round trip.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import sys
import threading
import time
from typing import Any

import msgspec

from ..net.framing import read_message
from .control import CLUSTER, SocketChannel
from .protocol import (PEER, PROTOCOL_VERSION, TO_INSTANCE, Beat, Codec, Init, InitFailed, ProtocolError)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mooncake_rs.serving.worker")
    ap.add_argument("--fd", type=int, required=True)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cluster decides when we stop
    from .shm import clean_at_exit, stop_on_sigterm, sweep_dead

    clean_at_exit()  # this worker's arena and regions, however the loop ends
    sweep_dead()
    # the engine thread holds the GIL between torch ops; a short switch interval lets the
    # transfer waiter and the control readers run promptly in between
    sys.setswitchinterval(float(os.environ.get("MOONCAKE_WORKER_SWITCH_S", "0.0005")))
    sock = socket.socket(fileno=args.fd)
    try:
        init = read_message(sock, Codec())
    except ProtocolError as e:
        print(f"mooncake_rs worker: bad init frame: {e}", file=sys.stderr)
        return 1
    if not isinstance(init, Init):
        return 1
    inbox: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
    ch = SocketChannel(sock, CLUSTER, inbox, TO_INSTANCE, name=f"{init.spec.name}<-cluster")
    if init.version != PROTOCOL_VERSION:
        ch.send(InitFailed(f"protocol version {init.version} from the cluster, this worker speaks "
                           f"{PROTOCOL_VERSION}"))
        return 1
    spec = init.spec
    peers = {pid: SocketChannel(socket.socket(fileno=fd), pid, inbox, PEER, name=f"{spec.name}<-{pid}")
             for pid, fd in init.peers.items()}
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("MOONCAKE_WORKER_THREADS", "1"))))
    from .instance import Instance

    stop = threading.Event()
    built: list[Instance] = []  # the beat thread sends the instance's latest usage once there is one
    if spec.heartbeat_s > 0:
        threading.Thread(target=beat_loop, args=(ch, spec.heartbeat_s, stop, built), name="mooncake-beat",
                         daemon=True).start()
    try:
        # kv_grants: the instance's own token, so the cluster's cannot pass for it
        inst = Instance(spec, ch, auth_token=init.token or init.auth_token, peers=peers,
                        peer_tokens=dict(init.peer_tokens) or None)
    except Exception as e:  # tell the cluster why, then exit
        ch.send(InitFailed(f"{type(e).__name__}: {e}"))
        return 1
    built.append(inst)
    from .control import CLUSTER as _CLUSTER
    from .protocol import Stop

    # SIGTERM: stop the loop like the cluster's Stop (the default action would leave the
    # arena in /dev/shm until the cluster notices)
    stop_on_sigterm(lambda: inbox.put((_CLUSTER, Stop())))
    inst.run()
    stop.set()
    for link in peers.values():
        link.close()
    ch.close()
    return 0


def beat_loop(ch: Any, every_s: float, stop: threading.Event, built: list[Any]) -> None:
    """Sends a ``Beat`` on ``ch`` every ``every_s`` until ``stop``: the instance's latest
    usage once ``built`` holds it. From a thread of its own, so a long engine step is no
    missed beat (liveness.py); also a remote worker's (deploy/worker.py)."""
    # ``usage`` is an immutable Beat the instance loop replaces: reading it here is safe
    while not stop.wait(every_s):
        u = built[0].usage if built else Beat()
        if u.link_t >= 0:  # how old its link reading is now (the cluster dates it on its clock)
            u = msgspec.structs.replace(u, link_age_s=max(0.0, time.monotonic() - u.link_t))
        ch.send(u)


if __name__ == "__main__":
    sys.exit(main())
