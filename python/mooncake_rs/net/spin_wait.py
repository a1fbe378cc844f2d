"""A bounded busy-wait for the next bytes on a socket, before the blocking read.

Why: a small control call is one round trip of two ~200-byte frames. When the two ends
run on different CPUs, each side sleeps in ``recv`` while the other works, and waking a
sleeping thread on another CPU costs far more than the work itself on a virtual machine
(an idle vCPU halts; its wake-up goes through the hypervisor): a bare Python echo made
~14 k round trips a second across two vCPUs against ~140 k on one (BENCHMARKS.md, k24k).
A reader that polls the socket for a few tens of microseconds before it sleeps is still
running when the answer lands, so nobody has to be woken. Each poll is followed by
``sched_yield``: where both ends share one CPU, the other end runs instead of waiting
for the spinner's time slice to end.

The wait is bounded (``spin_s``): an idle connection costs at most that much CPU after
its last message, then sleeps in the blocking read as before; 0 turns it off.
"""

from __future__ import annotations

import os
import select
import time
from typing import Any

__all__ = ["DEFAULT_SPIN_US", "MAX_SPIN_US", "SpinWait", "spin_us_checked"]

#: how long a pool reader polls before it sleeps, by default (microseconds)
DEFAULT_SPIN_US = 100
#: the most a caller may ask for: longer would burn a core for nothing on a quiet link
MAX_SPIN_US = 10_000


def spin_us_checked(value: object, what: str) -> int:
    """``value`` as a spin in microseconds (0 to MAX_SPIN_US); InvalidArgument otherwise."""
    from ..errors import InvalidArgument

    if isinstance(value, str):
        value = int(value) if value.strip().isdigit() else value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SPIN_US:
        raise InvalidArgument(f"{what} is microseconds to poll for an answer before sleeping, 0 to {MAX_SPIN_US} "
                              f"(0: off), got {value!r}")
    return value


class SpinWait:
    """Polls ``sock`` (anything with ``fileno()``) until it is readable or ``spin_s`` passed."""

    __slots__ = ("spin_s", "_poll")

    def __init__(self, sock: Any, spin_s: float) -> None:
        self.spin_s = spin_s
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)

    def wait(self) -> bool:
        """True when the socket became readable (bytes, end of stream or an error: the
        blocking read that follows returns at once), False when the spin ran out."""
        poll = self._poll.poll
        if poll(0):
            return True
        end = time.perf_counter() + self.spin_s
        while True:
            os.sched_yield()
            if poll(0):
                return True
            if time.perf_counter() >= end:
                return False
