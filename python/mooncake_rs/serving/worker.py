"""Entry point of a worker process (``processes=True``): one instance per process.

Spawned by the cluster as ``python -m mooncake_rs.serving.worker --fd N`` with one end
of a socketpair as fd N. The first message is ``{"op": "init", "spec": InstanceSpec}``;
then the instance loop runs until ``stop`` or until the control socket closes (the
cluster died), so a worker never outlives its cluster. The arena lives in /dev/shm and
is unlinked on the way out (the cluster also removes it if this process is killed).

A heartbeat thread sends ``{"op": "beat"}`` every ``spec.heartbeat_s`` seconds. It runs
apart from the instance loop on purpose: a long engine step is not a hang, but a process
that is stopped (SIGSTOP), starved or wedged with the GIL held sends no beats, and the
cluster's watchdog then kills it and fails its requests (see cluster.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mooncake_rs.serving.worker")
    ap.add_argument("--fd", type=int, required=True)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cluster decides when we stop
    # the engine thread holds the GIL between torch ops; a short switch interval lets the
    # transfer waiter and the control reader run promptly in between
    sys.setswitchinterval(float(os.environ.get("MOONCAKE_WORKER_SWITCH_S", "0.0005")))
    sock = socket.socket(fileno=args.fd)
    from .control import SocketChannel, recv_frame

    init = recv_frame(sock)
    if init is None or init.get("op") != "init":
        return 1
    spec = init["spec"]
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("MOONCAKE_WORKER_THREADS", "1"))))
    from .instance import Instance

    ch = SocketChannel(sock, spec.id)
    stop = threading.Event()
    if spec.heartbeat_s > 0:
        threading.Thread(target=_beat, args=(ch, spec.heartbeat_s, stop), name="mooncake-beat", daemon=True).start()
    try:
        inst = Instance(spec, ch, auth_token=init.get("auth_token"))
    except Exception as e:  # tell the cluster why, then exit
        ch.send({"op": "init_failed", "error": f"{type(e).__name__}: {e}"})
        return 1
    inst.run()
    stop.set()
    ch.close()
    return 0


def _beat(ch: object, every_s: float, stop: threading.Event) -> None:
    while not stop.wait(every_s):
        ch.send({"op": "beat"})  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
