"""Ports for servers a test or bench starts a moment later (standard library only, so the
real Mooncake's probe can import it from the peer's own environment).

A port the kernel picks (``bind(0)``) comes from its ephemeral range, the range it also
hands to outgoing connections and to servers that bind port 0 themselves: between our
check and the server's bind, one of those can take it (a CI run lost a vLLM replay endpoint
that way). So these pick free ports below that range, and never the same one twice in a
process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port", "free_port_pair"]

_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (outgoing connections, binds to port 0)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_pick(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1", *, span: int = 1) -> int:
    """A port P such that P .. P + span - 1 are free on ``host`` now (``span=2``: a server
    that also binds the next port, like ``--kv-events tcp://HOST:P``, which replays on P + 1).
    Where the kernel's range covers (nearly) every port, the kernel's own pick is used."""
    lo, _ = _ephemeral_range()
    first = 20000 if lo > 21000 else 1024
    if lo - first < 1000:
        for _ in range(50):
            port = _kernel_pick(host)
            if port + span <= 65536 and all(_bindable(host, port + k) for k in range(1, span)):
                return port
        raise RuntimeError(f"no {span} consecutive free ports on {host}")
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(first, lo - span + 1)
        taken = range(port, port + span)
        if any(p in _handed_out for p in taken) or not all(_bindable(host, p) for p in taken):
            continue
        _handed_out.update(taken)
        return port
    raise RuntimeError(f"no {span} consecutive free ports in {first}..{lo} on {host} after 1000 tries")


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port P with P and P + 1 free (see ``free_port``)."""
    return free_port(host, span=2)
