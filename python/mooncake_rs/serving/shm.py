"""A process's /dev/shm hygiene: its own segments go at exit, dead processes' at start.

Shared mappings are named ``/dev/shm/mooncake_rs.<pid>.<n>`` (rust/core/src/mem.rs) and
unlinked when dropped; a process that ends without dropping them (SIGKILL, a SIGTERM
at the default action, objects that daemon threads keep alive past the interpreter's
exit) leaves them behind. Two nets catch those:

- :func:`clean_at_exit`: at interpreter exit, unlink every segment this pid created
  (a peer that mapped one keeps its mapping; only the name goes);
- :func:`sweep_dead`: when a cluster, a worker or a conductor service starts, unlink the
  segments of pids that no longer exist. ``MOONCAKE_SHM_SWEEP=0`` turns it off (for
  hosts where processes of another pid namespace share /dev/shm: their pids look dead
  from here).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading

from .._core import remove_shm_segments_of, sweep_stale_shm_segments

__all__ = ["clean_at_exit", "sweep_dead", "stop_on_sigterm"]

log = logging.getLogger("mooncake_rs.serving")

_registered: set[int] = set()
_lock = threading.Lock()


def _remove_own(pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the hook
        remove_shm_segments_of(pid)


def clean_at_exit() -> None:
    """Registers (once per process) the unlinking of this pid's segments at exit."""
    pid = os.getpid()
    with _lock:
        if pid in _registered:
            return
        _registered.add(pid)
    atexit.register(_remove_own, pid)


def sweep_dead() -> int:
    """Unlinks the segments of processes that are gone; returns how many."""
    if os.environ.get("MOONCAKE_SHM_SWEEP", "1") == "0":
        return 0
    n = int(sweep_stale_shm_segments())
    if n:
        log.info("removed %d shared-memory segments of processes that are gone", n)
    return n


def stop_on_sigterm(stop: "object") -> None:
    """For our own entry points (never a library call): SIGTERM calls ``stop()`` so the
    process ends through its normal path (segments dropped, atexit hooks run) instead of
    dying at the signal's default action."""
    signal.signal(signal.SIGTERM, lambda *_: stop())  # type: ignore[operator]
