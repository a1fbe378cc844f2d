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
its last message, then sleeps in the blocking read as before; 0 turns it off. It backs
off where polling does not pay (after a poll that gave up, the next 1, 3, 7 ... 1023
waits skip it).

The poll, its policy and the read after it are native (``SpinWait``, from
rust/core/src/spin_read.rs): ``wait(fd)`` polls, ``recv(fd, n)`` polls and reads, both
with the GIL released. In Python a turn of the poll cost ~2 us (three system calls and
the interpreter between them), so an answer was seen up to that late; natively a turn
is a yield and one non-blocking ``recv`` that both looks for the bytes and takes them.
"""

from __future__ import annotations

import os

from .._core import SpinWait
from ..errors import InvalidArgument

__all__ = ["DEFAULT_SPIN_US", "MAX_SPIN_US", "SpinWait", "spin_us_checked", "spin_us_from_env"]

#: how long a pool reader polls before it sleeps, by default (microseconds)
DEFAULT_SPIN_US = 100
#: the most a caller may ask for: longer would burn a core for nothing on a quiet link
MAX_SPIN_US = 10_000


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
