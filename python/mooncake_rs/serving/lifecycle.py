"""Every request's life at the cluster, as a pure state machine: ``on(event) -> commands``.

No threads, sockets or clocks here: the router (router.py) feeds in what happened (a
request was submitted, an instance sent a message or died, the caller cancelled, time
passed) and carries out the commands that come back (send a message to an instance,
make a conductor call, hand tokens to the request's handle, finish or fail it). So each
path, failures included, is tested without engines (tests/test_serving_lifecycle.py).

A request's stages, as the cluster sees them::

    FETCH   the decision reuses a prefix held by another prefill instance: ``Export``
            went to that holder, which pins the blocks and answers ``Exported``. A
            multi-source fetch (``Plan.fetch_also``, ``Cluster(multipath=True)``) sends
            ``Export`` to every holder and waits for all of them; a holder that fails,
            dies or has nothing is dropped from the fetch (its pin let go), and the
            rest go on (none left: the prefix is computed).
    SLOTS   ``Expect`` went to the decode instance. Between the instances, without the
            cluster: decode reserves slots for the blocks and hands the request, with
            the slots, to the prefill instance (``Prefill``); prefill fetches the prefix
            (then ``Fetched``: the holder may unpin), hands it to its engine (then
            ``Started``: the conductor counts it running, ``on_prefill_started``),
            computes, streams KV into the slots and tells decode ``KvReady`` with the
            first token.
    DECODE  decode's first ``Tokens`` (the first token, with the prefill's report) came;
            more ``Tokens`` follow; the one with a ``finish`` ends the request.
    DRAINING the request ended for its caller (failed, cancelled, timed out) while its
            prefill may still copy into the decode slots or out of the holder's
            pinned blocks: the prefill was sent ``Cancel`` and the decode cancel and
            holder unpin wait for its ``Cancelled`` (or its death).

The outcome (finished, failed, cancelled) is the ``Finish`` / ``Fail`` command; the
record is dropped once nothing is held for it anywhere. Rejection (``Overloaded``)
happens before the lifecycle, at ``Cluster.submit``.

Pins: every holder that was sent ``Export`` pins the run until it is sent ``Unpin``;
``_State.pins`` lists those still to be unpinned, so each failure path unpins each of
them (at once, or once the prefill acks a cancel) and the list empties on every path.

The split of a multi-source fetch is made here, when the last holder has answered: in
proportion to each holder's free bandwidth (multisource.split_blocks; every link is the
same, so by flows): ``bandwidth / (flows + 1)``, where a holder's flows are what this
lifecycle knows it sends now, the fetches of other requests still reading it and the
requests it is prefilling (their KV streams out on the same link).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Union

from ..base.params import SamplingParams
from ..errors import MooncakeError, TransferFailed, TransferTimeout
from .multisource import Holder, split_blocks
from .protocol import (Cancel, Cancelled, Expect, Export, Exported, Failed, Fetch, Fetched, Message, Started,
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
    params: SamplingParams
    keys: bytes  # every full block's hash: the bytes of a BlockHashes
    prefill: int
    decode: int
    local: int = 0  # leading blocks the prefill instance holds itself
    fetch_from: int | None = None
    fetch_keys: bytes = b""  # the blocks to fetch from fetch_from
    deadline: float | None = None  # monotonic seconds past which it is cancelled
    timeout_s: float = 0.0  # deadline - submit time (for the error message)
    #: other holders of fetch_keys to fetch from at once (a multi-source fetch)
    fetch_also: tuple[int, ...] = ()
    #: the decision's prefetch: the fetch starts on arrival at the prefill instance, or
    #: (False) when the requests computing there before it are done
    prefetch: bool = True


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
    pins: list[int] = field(default_factory=list)  # holders that pin blocks for this request (Export order)
    waiting: list[int] = field(default_factory=list)  # FETCH: holders whose Exported has not come
    answers: dict[int, Exported] = field(default_factory=dict)  # FETCH: holders that exported blocks
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
        holders: list[int] = []
        if plan.fetch_from is not None and plan.fetch_keys:
            for h in (plan.fetch_from, *plan.fetch_also):
                if h not in self.down and h not in holders and h not in (plan.prefill, plan.decode):
                    holders.append(h)
        if holders:
            st.stage, st.pins, st.waiting = Stage.FETCH, list(holders), list(holders)
            for h in holders:
                out.append(Send(h, Export(plan.rid, plan.fetch_keys)))
        else:
            self._dispatch(st, None, out)

    def _dispatch(self, st: _State, fetch: Fetch | None, out: list[Command], also: list[Fetch] | None = None,
                  split: list[int] | None = None) -> None:
        p = st.plan
        st.stage = Stage.SLOTS
        st.waiting, st.answers = [], {}
        out.append(Send(p.decode, Expect(p.rid, p.prompt, p.params, p.keys, p.local, fetch, p.prefill,
                                         prefill_name=self._name(p.prefill), deadline=p.deadline,
                                         fetch_also=also or [], fetch_split=split or [], prefetch=p.prefetch)))

    def _answered(self, st: _State, inst: int, out: list[Command], exported: Exported | None) -> None:
        """FETCH: holder ``inst`` answered (``exported``) or dropped out (None: it failed
        or died); once every holder has, the request goes on with what they export."""
        if inst not in st.waiting:
            return
        st.waiting.remove(inst)
        if exported is not None and exported.offsets:
            st.answers[inst] = exported
        else:
            self._unpin_one(st, inst, out)  # nothing to read there (a dead holder: nothing to send)
        if not st.waiting:
            self._dispatch_fetch(st, out)

    def _dispatch_fetch(self, st: _State, out: list[Command]) -> None:
        """Every holder has answered: fetch the longest exported run from every holder
        that exported all of it (each must have pinned the whole run, so any of them
        can be read again for a share another failed), split by free bandwidth; the
        holders that exported less are let go."""
        p, answers = st.plan, st.answers
        if not answers:
            self._dispatch(st, None, out)
            return
        n = max(len(a.offsets) for a in answers.values())
        sources = [h for h in st.pins if h in answers and len(answers[h].offsets) == n]
        for h in [h for h in st.pins if h in answers and h not in sources]:
            self._unpin_one(st, h, out)
        keys = p.fetch_keys[:16 * n]
        fetches = [Fetch(h, answers[h].arena, list(answers[h].offsets), keys) for h in sources]
        split: list[int] = []
        if len(fetches) > 1:
            split = split_blocks(n, [Holder(h, None, self._flows(h, p.rid)) for h in sources])
        self._dispatch(st, fetches[0], out, fetches[1:], split)

    def _flows(self, inst: int, rid: int) -> int:
        """What ``inst`` sends on its link now, as far as the cluster knows: the fetches of
        other requests reading it (pinned, not yet ``Fetched``) and the requests it is
        prefilling (their KV streams out to a decode instance)."""
        n = 0
        for st in self._reqs.values():
            if st.plan.rid == rid or st.stage is not Stage.SLOTS:
                continue
            n += (inst in st.pins) + (st.plan.prefill == inst)
        return n

    def _arrived(self, inst: int, msg: Message, out: list[Command]) -> None:
        rid = getattr(msg, "rid", None)
        st = self._reqs.get(rid) if isinstance(rid, int) else None
        match msg:
            case Tokens():
                self._tokens(st, inst, msg, out)
            case Exported():
                if st is None or st.stage is not Stage.FETCH or inst not in st.waiting:
                    self._send(out, inst, Unpin(msg.rid))  # ended while the holder pinned: let go
                    return
                self._answered(st, inst, out, msg)
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
                if st.stage is Stage.FETCH and inst in st.waiting:  # an export failed: fetch from the rest
                    self._answered(st, inst, out, None)
                    return
                self._fail(st, MooncakeError(f"request {p.rid} failed on {self._name(inst)}: {error}"), out,
                           prefill_gone=inst == p.prefill)
            case Started():
                # not at dispatch: a request waits on its instance for its fetch and for the
                # requests before it that make its prefix; the conductor's queue is the computing
                if st is not None and st.stage is Stage.SLOTS and inst == st.plan.prefill:
                    out.append(Conduct("prefill_started", msg.rid))
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
        for h in st.pins:
            later.append(Send(h, Unpin(p.rid)))
        st.pins = []
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
            if inst in st.pins:
                # nothing to unpin there; a read from it fails and is read around
                # (another holder) or the prefix is computed
                st.pins.remove(inst)
            st.answers.pop(inst, None)  # exported, but gone before the fetch was sent: not a source
            if st.stage is Stage.DRAINING:
                if p.prefill == inst:  # a dead prefill copies nothing more
                    self._release(st, out)
                continue
            if inst == p.decode or (inst == p.prefill and st.stage is not Stage.DECODE):
                self._fail(st, err, out, prefill_gone=inst == p.prefill)
            elif st.stage is Stage.FETCH and inst in st.waiting:
                self._answered(st, inst, out, None)  # fetch from the other holders, if any

    # ---- helpers
    def _unpin(self, st: _State, out: list[Command]) -> None:
        for h in st.pins:
            self._send(out, h, Unpin(st.plan.rid))
        st.pins = []

    def _unpin_one(self, st: _State, inst: int, out: list[Command]) -> None:
        if inst in st.pins:
            st.pins.remove(inst)
            self._send(out, inst, Unpin(st.plan.rid))

    def _send(self, out: list[Command], to: int, msg: Message) -> None:
        if to not in self.down:
            out.append(Send(to, msg))

    def _name(self, inst: int) -> str:
        name = self.names.get(inst)
        return name if name is not None else f"#{inst}"
