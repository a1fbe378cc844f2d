"""The cluster's watchdog: worker processes that stop answering are declared down.

Each worker sends a heartbeat on its control socket every ``heartbeat_timeout_s / 4``
seconds from a thread of its own (worker.py), so a long engine step is not mistaken for
a hang; a process that is stopped (SIGSTOP), starved or wedged with the GIL held sends
nothing. The socket's reader stamps ``last_seen`` on every frame (control.py). A ready
worker silent for longer than the timeout is killed: that is the fence, since a worker
that came back later could still write into slots the cluster has handed to other
requests. Its socket then closes and the router's usual death path (a ``Lost`` link)
drops it from the conductor and fails its requests with ``TransferFailed``, naming why.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

__all__ = ["watch"]

log = logging.getLogger("mooncake_rs.serving")


def watch(members: Callable[[], list[Any]], stop: threading.Event, limit_s: float) -> None:
    """Runs until ``stop`` is set (the cluster closes). ``members``: the cluster's
    instances (each with ``proc``, ``ch.last_seen``, ``alive``, ``ready``, ``error``,
    ``down_reason``, ``spec.name``)."""
    period = min(0.25, limit_s / 4)
    last = quiet_until = time.monotonic()
    while not stop.wait(period):
        now = time.monotonic()
        if now - last > limit_s / 2:
            # This process itself was not running (stopped, suspended, starved): the
            # workers' beats are still queued in the sockets. Let the readers catch up
            # for a beat period before judging anyone.
            quiet_until = now + limit_s / 4 + period
        last = now
        if now < quiet_until:
            continue
        for m in members():
            if (not m.alive or m.proc is None or not m.ready.is_set() or m.error is not None
                    or m.down_reason is not None or m.proc.poll() is not None):
                continue
            silent = now - m.ch.last_seen
            if silent <= limit_s:
                continue
            m.down_reason = (f"stopped responding (no heartbeat for {silent:.1f}s, heartbeat_timeout_s={limit_s:g}) "
                             "and was killed")
            log.info("serving: instance %s (pid %d) %s", m.spec.name, m.proc.pid, m.down_reason)
            m.proc.kill()  # a stopped process dies too; the socket's EOF tells the router
