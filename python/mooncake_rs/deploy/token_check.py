"""A worker proves its cluster token before it registers.

A worker whose token is not the cluster's would register in etcd (etcd is no secret)
and then be refused by every conductor that attaches, forever, while its operator reads
"registered". So before registering, the worker makes the handshake a client makes with
the leading ``serve`` (``auth_socket.connect``: the mutual challenge-response; the token
itself is never sent) and stops with :class:`Unauthorized` if it is refused.

Where no ``serve`` leads yet there is nothing to check against: the worker registers,
and the conductor's handshake refuses it later (logged on both sides).
"""

from __future__ import annotations

from ..errors import ServiceUnavailable, Unauthorized
from ..net.auth_socket import connect
from ..net.etcd import EtcdClient
from ..client.records import decode_leader, leader_key

__all__ = ["check_token_with_leader"]


def check_token_with_leader(etcd: EtcdClient, prefix: str, token: str, token_file: str | None,
                            timeout_s: float = 5.0) -> str | None:
    """The leader's address the token was proven against, or None when no ``serve``
    leads (or the leader does not answer). Raises :class:`Unauthorized` when the leader
    refuses the token."""
    key = leader_key(prefix)
    kv = etcd.get(key)
    if kv is None:
        return None
    # The address only, unverified: a signature that does not verify under our token says
    # nothing yet (a wrong token, or a forged record); the handshake below decides.
    address = decode_leader(kv.value, None, key, kv.lease)
    try:
        connect(address, token, timeout_s).close()
    except Unauthorized:
        where = token_file or "$MOONCAKE_AUTH_TOKEN"
        raise Unauthorized(f"the leading serve of {prefix} ({address}) refused this worker's cluster token "
                           f"(from {where}): every host needs the same token file") from None
    except ServiceUnavailable:
        return None  # the leader is going away: the next one checks us when it attaches
    return address
