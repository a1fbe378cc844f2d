"""A bounded busy-wait for the next bytes on a socket, before the blocking read.

Why: a small control call is one round trip of two ~200-byte frames. When the two ends
run on different CPUs, each side sleeps in ``recv`` while the other works, and waking a
sleeping thread on another CPU costs far more than the work itself on a virtual machine
(an idle vCPU halts; its wake-up goes through the hypervisor): a bare Python echo made
~14 k round trips a second across two vCPUs against ~140 k on one (BENCHMARKS.md, k24k).
A reader that polls the socket for a few tens of microseconds before it sleeps is still
running when the answer lands, so nobody has to be woken. Each poll is followed by
``sched_yield``: where both ends share one CPU, the other end runs instead of waiting
for the spinner's time slice to end; and a yield that did let another thread run (the
kernel's count of this thread's involuntary switches moved) ends the poll, since there
the blocking read costs nothing extra and polling would only take turns with the thread
that has the work.

The wait is bounded (``spin_s``): an idle connection costs at most that much CPU after
its last message, then sleeps in the blocking read as before; 0 turns it off.
"""

from __future__ import annotations

import os
import resource
import select
import time
from typing import Any

from ..errors import InvalidArgument

__all__ = ["DEFAULT_SPIN_US", "MAX_SPIN_US", "SpinWait", "spin_us_checked", "spin_us_from_env"]

#: how long a pool reader polls before it sleeps, by default (microseconds)
DEFAULT_SPIN_US = 100
#: the most a caller may ask for: longer would burn a core for nothing on a quiet link
MAX_SPIN_US = 10_000
RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # (Linux: this thread's counts)


def spin_us_from_env() -> int:
    """``MOONCAKE_RS_SPIN_US`` (a client's calls and a store node's connections), else the default."""
    raw = os.environ.get("MOONCAKE_RS_SPIN_US", "").strip()
    return spin_us_checked(raw, "MOONCAKE_RS_SPIN_US") if raw else DEFAULT_SPIN_US


def spin_us_checked(value: object, what: str) -> int:
    """``value`` as a spin in microseconds (0 to MAX_SPIN_US); InvalidArgument otherwise."""
    if isinstance(value, str):
        value = int(value) if value.strip().isdigit() else value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SPIN_US:
        raise InvalidArgument(f"{what} is microseconds to poll for an answer before sleeping, 0 to {MAX_SPIN_US} "
                              f"(0: off), got {value!r}")
    return value


class SpinWait:
    """Polls ``sock`` (anything with ``fileno()``) until it is readable or ``spin_s`` passed.

    It backs off where polling does not pay: after a poll that gave up (nothing came in
    time) or whose yield let another thread run (its answer may have come meanwhile), the
    next ``wait`` calls return at once without a poll (the caller sleeps in its read, as
    without a spin): 1, 3, 7 ... up to ``MAX_SKIP`` of them; one poll that sees its answer
    ends the back-off. So an idle connection, two ends sharing a CPU, or a CPU busy with
    other work soon stop polling; two ends on CPUs of their own keep it."""

    __slots__ = ("spin_s", "_poll", "_skip", "_penalty")

    #: the most waits skipped after polls that gave up
    MAX_SKIP = 1023

    def __init__(self, sock: Any, spin_s: float) -> None:
        self.spin_s = spin_s
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        self._skip = 0  # waits left to return at once
        self._penalty = 0  # how many the next poll that gives up makes it skip

    def wait(self) -> bool:
        """True when the socket became readable (bytes, end of stream or an error: the
        blocking read that follows returns at once), False when the poll gave up or was
        skipped (the read that follows sleeps until bytes come)."""
        if self._skip:  # (no poll at all: the blocking read returns at once if bytes are there)
            self._skip -= 1
            return False
        poll = self._poll.poll
        if poll(0):
            return True
        end = time.perf_counter() + self.spin_s
        switches = _switches()
        while True:
            os.sched_yield()
            ready = bool(poll(0))
            now = _switches()
            # (a yield that let another thread run counts against polling even when the
            # answer came meanwhile: that thread had this CPU, the poll won nothing)
            if now != switches:
                self._penalty = min(2 * self._penalty + 1, self.MAX_SKIP)
                self._skip = self._penalty
                return ready
            if ready:
                self._penalty = 0
                return True
            if time.perf_counter() >= end:
                self._penalty = min(2 * self._penalty + 1, self.MAX_SKIP)
                self._skip = self._penalty
                return False


def _switches() -> int:
    """How often this thread was switched out while runnable (a yield that let another
    thread run, or a preemption): the kernel's own count, no clock involved."""
    return resource.getrusage(RUSAGE_THREAD).ru_nivcsw
