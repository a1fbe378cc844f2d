"""Every request's life at the cluster, as a pure state machine: ``on(event) -> commands``.

No threads, sockets or clocks here: the router (router.py) feeds in what happened (a
request was submitted, an instance sent a message or died, the caller cancelled, time
passed) and carries out the commands that come back (send a message to an instance,
make a conductor call, hand tokens to the request's handle, finish or fail it). So each
path, failures included, is tested without engines (tests/test_serving_lifecycle.py).

A request's stages, as the cluster sees them::

    FETCH   the decision reuses a prefix held by another prefill instance: ``Export``
            went to that holder, which pins the blocks and answers ``Exported``.
    SLOTS   ``Expect`` went to the decode instance. Between the instances, without the
            cluster: decode reserves slots for the blocks and hands the request, with
            the slots, to the prefill instance (``Prefill``); prefill fetches the prefix
            (then ``Fetched``: the holder may unpin), computes, streams KV into the
            slots and tells decode ``KvReady`` with the first token.
    DECODE  decode's first ``Tokens`` (the first token, with the prefill's report) came;
            more ``Tokens`` follow; the one with a ``finish`` ends the request.
    DRAINING the request ended for its caller (failed, cancelled, timed out) while its
            prefill may still copy into the decode slots or out of the holder's
            pinned blocks: the prefill was sent ``Cancel`` and the decode cancel and
            holder unpin wait for its ``Cancelled`` (or its death).

The outcome (finished, failed, cancelled) is the ``Finish`` / ``Fail`` command; the
record is dropped once nothing is held for it anywhere. Rejection (``Overloaded``)
happens before the lifecycle, at ``Cluster.submit``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Union

from ..errors import MooncakeError, TransferFailed, TransferTimeout
from .protocol import (Cancel, Cancelled, Expect, Export, Exported, Failed, Fetch, Fetched, Message, Params,
                       PrefillReport, Tokens, Unpin)

__all__ = [
    "Stage", "Plan", "Submit", "Arrived", "InstanceDown", "CancelRequest", "Tick", "Event",
    "Send", "Conduct", "Deliver", "Finish", "Fail", "Command", "RequestLifecycle",
]


class Stage(enum.Enum):
    FETCH = "fetch"
    SLOTS = "slots"
    DECODE = "decode"
    DRAINING = "draining"


@dataclass(frozen=True)
class Plan:
    """What the lifecycle needs of a request: the conductor's decision and the prompt."""

    rid: int
    prompt: list[int]
    params: Params
    keys: bytes  # every full block's hash: the bytes of a BlockHashes
    prefill: int
    decode: int
    local: int = 0  # leading blocks the prefill instance holds itself
    fetch_from: int | None = None
    fetch_keys: bytes = b""  # the blocks to fetch from fetch_from
    deadline: float | None = None  # monotonic seconds past which it is cancelled
    timeout_s: float = 0.0  # deadline - submit time (for the error message)


# ---- events and commands: plain slotted records (built per message on the router's
# hot path; nobody mutates them)
@dataclass(slots=True)
class Submit:
    plan: Plan


@dataclass(slots=True)
class Arrived:
    """A message from instance ``inst``."""

    inst: int
    msg: Message


@dataclass(slots=True)
class InstanceDown:
    """``inst`` died or was killed; ``what`` says so ("instance decode-0 died (signal 9)")."""

    inst: int
    what: str


@dataclass(slots=True)
class CancelRequest:
    """End ``rid`` now with ``error``. ``outcome``: how the cluster's metrics count it
    (``"cancelled"``: ended early on purpose, ``"timed_out"``: past a deadline, a
    failure; ``"failed"``: any other failure), carried to its ``Fail`` command."""

    rid: int
    error: BaseException
    outcome: str = "cancelled"


@dataclass(slots=True)
class Tick:
    now: float


Event = Union[Submit, Arrived, InstanceDown, CancelRequest, Tick]


# ---- commands
@dataclass(slots=True)
class Send:
    to: int
    msg: Message


@dataclass(slots=True)
class Conduct:
    """A conductor call: ``prefill_started``, ``decode_started`` (the first token came:
    the prefill is over and decoding began, one call for both), ``decode_finished``
    (``n`` output tokens) or ``cancel``."""

    call: str
    rid: int
    n: int = 0


@dataclass(slots=True)
class Deliver:
    """Tokens for the request's handle; ``report`` with the first ones."""

    rid: int
    tokens: list[int]
    report: PrefillReport | None = None


@dataclass(slots=True)
class Finish:
    rid: int
    reason: str


@dataclass(slots=True)
class Fail:
    """End ``rid`` for its caller with ``error``; ``outcome`` is the counter it lands in
    (``"failed"``, ``"timed_out"`` (counted as failed too) or ``"cancelled"``)."""

    rid: int
    error: BaseException
    outcome: str = "failed"


Command = Union[Send, Conduct, Deliver, Finish, Fail]


@dataclass(slots=True)
class _State:
    plan: Plan
    stage: Stage = Stage.SLOTS
    pinned: int | None = None  # the holder that pins blocks for this request
    tokens: int = 0
    later: list[Send] = field(default_factory=list)  # DRAINING: sent once the prefill acks


class RequestLifecycle:
    """Owns the state of every request between submit and the last release."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = dict(names)  # instance id -> name, for error messages
        self.down: set[int] = set()
        self._reqs: dict[int, _State] = {}

    # ---- queries
    def stage(self, rid: int) -> Stage | None:
        st = self._reqs.get(rid)
        return None if st is None else st.stage

    def __len__(self) -> int:
        """Requests with a record (running, or draining)."""
        return len(self._reqs)

    def running(self) -> int:
        return sum(st.stage is not Stage.DRAINING for st in self._reqs.values())

    # ---- the one entry point
    def on(self, ev: Event) -> list[Command]:
        out: list[Command] = []
        match ev:
            case Submit(plan=plan):
                return self.submit(plan)
            case Arrived(inst=inst, msg=msg):
                return self.arrived(inst, msg)
            case InstanceDown(inst=inst, what=what):
                self._down(inst, what, out)
            case CancelRequest(rid=rid, error=error, outcome=outcome):
                st = self._reqs.get(rid)
                if st is not None and st.stage is not Stage.DRAINING:
                    self._fail(st, error, out, outcome=outcome)
            case Tick(now=now):
                for st in [s for s in self._reqs.values() if s.stage is not Stage.DRAINING
                           and s.plan.deadline is not None and now > s.plan.deadline]:
                    self._fail(st, TransferTimeout(f"request {st.plan.rid} passed its deadline "
                                                   f"({st.plan.timeout_s:.3g}s after submit); it was cancelled"), out,
                               outcome="timed_out")
            case _:
                raise TypeError(f"not a lifecycle event: {ev!r}")
        return out

    def submit(self, plan: Plan) -> list[Command]:
        """``on(Submit(plan))`` without building the event (once per request)."""
        out: list[Command] = []
        self._submit(plan, out)
        return out

    def arrived(self, inst: int, msg: Message) -> list[Command]:
        """``on(Arrived(inst, msg))`` without building the event (the router's hot path)."""
        out: list[Command] = []
        self._arrived(inst, msg, out)
        return out

    def more_tokens(self, inst: int, msg: Tokens) -> bool:
        """The router's hot path: True when ``msg`` only carries more tokens of a request
        that is decoding (no finish, no report, from its decode instance). The count is
        updated and the one command ``tokens`` would return is ``Deliver(msg.rid,
        msg.tokens)``: the router delivers them itself, no command list built. False:
        nothing changed, call ``tokens``."""
        st = self._reqs.get(msg.rid)
        if (st is not None and st.stage is Stage.DECODE and msg.finish is None and msg.report is None
                and inst == st.plan.decode):
            st.tokens += len(msg.tokens)
            return True
        return False

    def tokens(self, inst: int, msg: Tokens) -> list[Command]:
        """``arrived`` for a ``Tokens``."""
        out: list[Command] = []
        self._tokens(self._reqs.get(msg.rid), inst, msg, out)
        return out

    # ---- stages
    def _submit(self, plan: Plan, out: list[Command]) -> None:
        if plan.prefill in self.down or plan.decode in self.down:
            # the decision was made just before the conductor heard of the death
            gone = plan.prefill if plan.prefill in self.down else plan.decode
            out.append(Conduct("cancel", plan.rid))
            out.append(Fail(plan.rid, TransferFailed(f"instance {self._name(gone)} is down; request "
                                                     f"{plan.rid} was not started")))
            return
        st = _State(plan)
        self._reqs[plan.rid] = st
        if plan.fetch_from is not None and plan.fetch_keys and plan.fetch_from not in self.down:
            st.stage, st.pinned = Stage.FETCH, plan.fetch_from
            out.append(Send(plan.fetch_from, Export(plan.rid, plan.fetch_keys)))
        else:
            self._dispatch(st, None, out)

    def _dispatch(self, st: _State, fetch: Fetch | None, out: list[Command]) -> None:
        p = st.plan
        st.stage = Stage.SLOTS
        out.append(Send(p.decode, Expect(p.rid, p.prompt, p.params, p.keys, p.local, fetch, p.prefill,
                                                prefill_name=self._name(p.prefill), deadline=p.deadline)))
        out.append(Conduct("prefill_started", p.rid))

    def _arrived(self, inst: int, msg: Message, out: list[Command]) -> None:
        rid = getattr(msg, "rid", None)
        st = self._reqs.get(rid) if isinstance(rid, int) else None
        match msg:
            case Tokens():
                self._tokens(st, inst, msg, out)
            case Exported(offsets=offsets, arena=arena):
                if st is None or st.stage is not Stage.FETCH:
                    self._send(out, inst, Unpin(msg.rid))  # ended while the holder pinned: let go
                    return
                n = len(offsets)
                fetch = Fetch(inst, arena, list(offsets), st.plan.fetch_keys[:16 * n]) if n else None
                if not n:
                    self._unpin(st, out)
                self._dispatch(st, fetch, out)
            case Fetched():
                if st is None:
                    return
                self._unpin(st, out)
                if st.stage is Stage.DRAINING:  # the prefill is done reading: the holder may unpin now
                    unpins = [s for s in st.later if isinstance(s.msg, Unpin)]
                    st.later = [s for s in st.later if not isinstance(s.msg, Unpin)]
                    for s in unpins:
                        self._send(out, s.to, s.msg)
            case Failed(error=error):
                if st is None or st.stage is Stage.DRAINING:
                    return
                p = st.plan
                if st.stage is Stage.FETCH and inst == p.fetch_from:  # the export failed: compute the prefix
                    self._unpin(st, out)
                    self._dispatch(st, None, out)
                    return
                self._fail(st, MooncakeError(f"request {p.rid} failed on {self._name(inst)}: {error}"), out,
                           prefill_gone=inst == p.prefill)
            case Cancelled():
                if st is not None and st.stage is Stage.DRAINING and inst == st.plan.prefill:
                    self._release(st, out)
            case _:
                raise TypeError(f"not a request message: {msg!r}")

    def _tokens(self, st: _State | None, inst: int, msg: Tokens, out: list[Command]) -> None:
        if st is None or st.stage not in (Stage.SLOTS, Stage.DECODE) or inst != st.plan.decode:
            return
        rid, finish = msg.rid, msg.finish
        if st.stage is Stage.SLOTS:  # the first token: the prefill is done
            st.stage = Stage.DECODE
            self._unpin(st, out)  # ... with the holder's blocks too
            if finish is None:
                # one conductor call for both: on_decode_started ends the prefill stage too
                # (what on_prefill_finished would have done first)
                out.append(Conduct("decode_started", rid))
        st.tokens += len(msg.tokens)
        out.append(Deliver(rid, msg.tokens, msg.report))
        if finish is not None:  # decode_finished / cancel end the prefill stage as well
            del self._reqs[rid]
            if finish in ("stop", "length"):
                out.append(Conduct("decode_finished", rid, st.tokens))
            else:
                out.append(Conduct("cancel", rid))
            out.append(Finish(rid, finish))

    # ---- endings
    def _fail(self, st: _State, error: BaseException, out: list[Command], *, prefill_gone: bool = False,
              outcome: str = "failed") -> None:
        """Ends the request for its caller now; frees what instances hold for it in the
        safe order (see the module docstring)."""
        p = st.plan
        later: list[Send] = []
        if st.stage is Stage.FETCH:
            pass  # the holder unpins below (its Export is ahead of the Unpin on its link)
        elif st.stage is Stage.SLOTS:
            later.append(Send(p.decode, Cancel(p.rid)))
        elif st.stage is Stage.DECODE:
            later.append(Send(p.decode, Cancel(p.rid)))
        if st.pinned is not None:
            later.append(Send(st.pinned, Unpin(p.rid)))
            st.pinned = None
        out.append(Conduct("cancel", p.rid))
        out.append(Fail(p.rid, error, outcome))
        if st.stage is Stage.SLOTS and not prefill_gone and p.prefill not in self.down:
            # the prefill may still be writing into the decode slots or reading the
            # holder's blocks: it goes first, the rest once it acks
            st.stage, st.later = Stage.DRAINING, later
            out.append(Send(p.prefill, Cancel(p.rid)))
            return
        st.later = later
        self._release(st, out)

    def _release(self, st: _State, out: list[Command]) -> None:
        self._reqs.pop(st.plan.rid, None)
        for s in st.later:
            self._send(out, s.to, s.msg)
        st.later = []

    def _down(self, inst: int, what: str, out: list[Command]) -> None:
        if inst in self.down:
            return
        self.down.add(inst)
        err = TransferFailed(f"{what}; its in-flight requests failed")
        for st in list(self._reqs.values()):
            p = st.plan
            if st.pinned == inst:
                st.pinned = None  # nothing to unpin; a read from it fails and the prefix is computed
            if st.stage is Stage.DRAINING:
                if p.prefill == inst:  # a dead prefill copies nothing more
                    self._release(st, out)
                continue
            if inst == p.decode or (inst == p.prefill and st.stage is not Stage.DECODE):
                self._fail(st, err, out, prefill_gone=inst == p.prefill)
            elif st.stage is Stage.FETCH and inst == p.fetch_from:
                self._dispatch(st, None, out)  # no fetch: the prefix is computed

    # ---- helpers
    def _unpin(self, st: _State, out: list[Command]) -> None:
        if st.pinned is not None:
            self._send(out, st.pinned, Unpin(st.plan.rid))
            st.pinned = None

    def _send(self, out: list[Command], to: int, msg: Message) -> None:
        if to not in self.down:
            out.append(Send(to, msg))

    def _name(self, inst: int) -> str:
        name = self.names.get(inst)
        return name if name is not None else f"#{inst}"
