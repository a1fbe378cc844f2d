"""The cluster's watchdog: instances that stop answering are declared down.

Each worker sends a heartbeat on its control socket every ``heartbeat_timeout_s / 4``
seconds from a thread of its own (worker.py), so a long engine step is not mistaken for
a hang; a process that is stopped (SIGSTOP), starved or wedged with the GIL held sends
nothing. The socket's reader stamps ``last_seen`` on every frame (control.py). A ready
worker silent for longer than the timeout is killed: that is the fence, since a worker
that came back later could still write into slots the cluster has handed to other
requests. Its socket then closes and the router's usual death path (a ``Lost`` link)
drops it from the conductor and fails its requests with ``TransferFailed``, naming why.

An in-process instance (``processes=False``, a thread of the cluster's process) beats
from its own loop (``Instance._beat`` -> ``QueueChannel.beat``), so a loop that is
blocked (a deadlock, a call that never returns, an endless loop) stops beating. A thread
cannot be killed: the watchdog posts a ``Lost`` for it to the router instead, which
takes the same death path (out of the conductor, its requests failed, nothing more sent
to it) and asks the thread to stop should it ever wake (``Stop`` in its inbox). The
timeout must exceed the longest single loop iteration (one engine step, one
calibration), since in-process the beat cannot come from another thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

__all__ = ["watch"]

log = logging.getLogger("mooncake_rs.serving")


def watch(members: Callable[[], list[Any]], stop: threading.Event, limit_s: float,
          down: Callable[[int, str], None] | None = None) -> None:
    """Runs until ``stop`` is set (the cluster closes). ``members``: the cluster's
    instances (each with ``proc``, ``thread``, ``ch.last_seen``, ``alive``, ``ready``,
    ``error``, ``down_reason``, ``spec``). ``down(instance id, reason)``: tells the router
    an in-process instance is down (a thread cannot be killed, so no link closes)."""
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
            if (not m.alive or not m.ready.is_set() or m.error is not None or m.down_reason is not None
                    or (m.proc is not None and m.proc.poll() is not None)):
                continue
            silent = now - m.ch.last_seen
            if silent <= limit_s:
                continue
            if m.proc is None:  # an in-process instance (its loop stopped turning), or a remote worker
                if down is None:
                    continue
                if m.remote:  # a cut cable or a hung host: silence, no closed socket
                    m.down_reason = (f"stopped responding (no heartbeat for {silent:.1f}s, "
                                     f"heartbeat_timeout_s={limit_s:g}); its link was closed")
                else:
                    m.down_reason = (f"stopped responding (its loop sent no heartbeat for {silent:.1f}s, "
                                     f"heartbeat_timeout_s={limit_s:g}); it runs in this process and cannot be "
                                     "killed, so it was marked down")
                log.warning("serving: instance %s %s", m.spec.name, m.down_reason)
                down(m.spec.id, m.down_reason)
                continue
            m.down_reason = (f"stopped responding (no heartbeat for {silent:.1f}s, heartbeat_timeout_s={limit_s:g}) "
                             "and was killed")
            log.info("serving: instance %s (pid %d) %s", m.spec.name, m.proc.pid, m.down_reason)
            m.proc.kill()  # a stopped process dies too; the socket's EOF tells the router
