"""Adaptive prefill/decode roles in a running cluster (issue 16): ``Cluster.switch_role``
moves one instance between the prefill and the decode pool without failing a request.

The sequence, each step waiting for the one before:

1. **Drain** (``Conductor.drain_instance``): no new decision names the instance; what
   it holds (requests admitted before) goes on through the usual path.
2. **Drained** (``Conductor.is_drained``): the conductor counts nothing on it any more
   (a prefill instance's requests are past their first token, a decode instance's have
   finished or ended).
3. **Switch at the instance** (``SwitchRole`` -> ``RoleSwitched``): the instance takes
   the new role once it also holds nothing itself (a cancelled request's state may
   outlive the conductor's count until its ack): a new role object over the same engine,
   store and transport; its arena registered again with the new role's rights for peers
   (a prefill arena is read-only to peers, a decode arena writable), the old
   registration kept until no peer's fetch may read it. Peer links need nothing: every
   pair of instances has one from the start (members.py), used by whichever roles they
   hold. Late messages about requests of the old role still reach the old role object
   (an overtaken ``Prefill``, a ``Cancel`` the cluster waits to see acked).
4. **Switch at the conductor** (``Conductor.switch_role``): the instance joins the other
   pool, no longer draining. A prefill instance that becomes a decode instance leaves
   the block index (``BlockIndex.remove_instance``: a decode instance's store is not
   reported, so its entries would go stale); its blocks stay in its store.

If the drain does not end within ``timeout_s`` the instance is put back in service in
its old role (``undrain_instance``) and ``MooncakeError`` says so; nothing was switched.

The instance keeps its id and name (``prefill-0`` stays the name of instance 0: it is
its transfer engine's name, which peers know it by). ``Cluster.prefill_ids`` /
``decode_ids`` follow the switch. Not supported: ``kv_grants=True`` (a decode arena is
restricted and each prefill has its own transfer token, set up at spawn), and calling it
One switch at a time per cluster (``Cluster.switch_role`` holds its lock);
``calibrate`` and ``instance_stats`` may run beside it: every call's answer carries the
query id it answers (replies.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import InvalidArgument, MooncakeError
from .members import Members
from .protocol import Failed, Message, RoleSwitched, SwitchRole

__all__ = ["RoleSwitch", "switch_role"]

ROLES = ("prefill", "decode")
_POLL_S = 0.005  # how often the drain is checked (a conductor call: cheap)


@dataclass(frozen=True)
class RoleSwitch:
    """What ``Cluster.switch_role`` did: the instance, its old and new role, how long the
    drain took and the whole switch."""

    instance: int
    name: str
    old_role: str
    new_role: str
    drain_s: float
    total_s: float


Ask = Callable[[int, Callable[[int], Message], float], "Message | None"]


def check_role(role: str, timeout_s: Any) -> None:
    if role not in ROLES:
        raise InvalidArgument(f"role must be 'prefill' or 'decode', got {role!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise InvalidArgument(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


def switch_role(cond: Any, members: Members, ask: Ask, inst: int, role: str, *,
                timeout_s: float = 120.0) -> RoleSwitch:
    """Drains ``inst``, switches it to ``role`` and puts it back in service (see the
    module docstring), on conductor ``cond`` and in the ``members`` table (whose pools
    follow the switch); ``ask(inst, make, timeout_s)`` sends the instance ``make(qid)``
    and waits for its answer. Returns a ``RoleSwitch``; switching to the role it has is
    a no-op."""
    check_role(role, timeout_s)
    t0 = time.monotonic()
    timeout_s = float(timeout_s)
    m = members.get(inst)
    if m is None or not m.live:
        live = {i: x.spec.name for i, x in members.live().items()}
        raise InvalidArgument(f"instance {inst} is not a live instance of this cluster (live: {live})")
    old = m.role
    if old == role:
        return RoleSwitch(inst, m.spec.name, old, role, 0.0, 0.0)
    if not any(i != inst and members[i].alive for i in members.ids(old)):
        raise InvalidArgument(f"instance {inst} is the last live {old} instance; the cluster needs one of each "
                              f"(switch another instance to {old} first)")
    cond.drain_instance(inst)
    deadline = t0 + timeout_s
    try:
        while not cond.is_drained(inst):
            if time.monotonic() > deadline:
                raise MooncakeError(f"instance {m.spec.name} still held {cond.held_requests(inst)} requests after "
                                    f"{timeout_s:g}s of draining; it was put back in service as a {old} instance "
                                    f"(retry with a larger timeout_s, or under less load)")
            if not m.alive:
                raise MooncakeError(f"instance {m.spec.name} went down while draining; nothing was switched")
            time.sleep(_POLL_S)
    except BaseException:
        try:
            cond.undrain_instance(inst)
        except MooncakeError:  # removed meanwhile (it died)
            pass
        raise
    t_drained = time.monotonic()
    reply = ask(inst, lambda qid: SwitchRole(role, qid=qid), max(deadline - time.monotonic(), 5.0))
    if not isinstance(reply, RoleSwitched) or reply.role != role:
        # the instance may still switch later: take it out of service rather than guess
        what = reply.error if isinstance(reply, Failed) else ("no answer" if reply is None else repr(reply))
        raise MooncakeError(f"instance {m.spec.name} did not switch to {role} ({what}); it stays drained")
    # the index first: a decode instance's store is not reported, its entries would go stale
    if role == "decode":
        cond.index.remove_instance(inst)
    if role == "decode":
        # the capacities the instance reported at Ready (its engine's batch and KV tokens),
        # as a decode instance started in that role is registered; the Rust defaults
        # (a batch of 256) would let admission overfill it
        info = m.info
        cap = {}
        if info is not None and info.max_num_seqs > 0:
            cap["max_batch"] = info.max_num_seqs
        if info is not None and info.kv_tokens > 0:
            cap["kv_capacity_tokens"] = info.kv_tokens
        cond.switch_role(inst, role, **cap)
    else:
        cond.switch_role(inst, role)
    # the pools of the members table (calibrate and a rebuilt conductor read them)
    members.switched(inst, role)
    t1 = time.monotonic()
    return RoleSwitch(inst, m.spec.name, old, role, t_drained - t0, t1 - t0)

