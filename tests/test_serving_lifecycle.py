"""The request lifecycle alone (serving/lifecycle.py): no engines, no threads. Each test
drives a request to a stage, applies one failure and asserts the exact commands: what
is sent to which instance, in which order, which conductor calls, and how the request
ends; then, where the prefill's ack is awaited, what the ack releases."""

from __future__ import annotations

import pytest

from mooncake_rs.base.params import SamplingParams
from mooncake_rs.errors import MooncakeError, TransferFailed, TransferTimeout
from mooncake_rs.serving import protocol as p
from mooncake_rs.serving.lifecycle import (Arrived, CancelRequest, Conduct, Deliver, Fail, Finish, InstanceDown,
                                           Plan, RequestLifecycle, Send, Stage, Submit, Tick)

P, H, D = 0, 1, 2  # the prefill instance, the holder of the prefix (another prefill), the decode instance
H2 = 3  # a second holder of the same prefix (a multi-source fetch)
NAMES = {P: "prefill-0", H: "prefill-1", D: "decode-0"}
NAMES2 = NAMES | {H2: "prefill-2"}
RID = 7
KEYS = p.pack_keys([11, 12, 13, 14])
PARAMS = SamplingParams(max_tokens=4)
EP = p.Endpoint("prefill-1", "", 3)
REPORT = p.PrefillReport(2, 2, 4096, 0.0, 0.1, 0.2)


def plan(fetch: bool = False, deadline: float | None = 100.0) -> Plan:
    return Plan(RID, list(range(70)), PARAMS, KEYS, P, D, local=1 if fetch else 0, fetch_from=H if fetch else None,
                fetch_keys=KEYS[16:48] if fetch else b"", deadline=deadline, timeout_s=5.0)


def expect(fetch: p.Fetch | None = None, planned: bool | None = None) -> Send:
    """The Expect to decode; ``planned``: the decision had a fetch (so the prefill holds
    one block itself), even when the fetch itself fell through."""
    pl = plan(fetch is not None if planned is None else planned)
    return Send(D, p.Expect(RID, pl.prompt, PARAMS, KEYS, pl.local, fetch, P, prefill_name=NAMES[P],
                            deadline=pl.deadline))


def expect_unfetched() -> Send:
    return expect(None, planned=True)


FETCH = p.Fetch(H, EP, [4096, 8192], KEYS[16:48])


def c(call: str, n: int = 0) -> Conduct:
    return Conduct(call, RID, n)


def strip(cmds):
    """Commands with errors replaced by (type, message) so they compare by value."""
    return [("fail", type(x.error), str(x.error)) if isinstance(x, Fail) else x for x in cmds]


def fail(kind, msg: str):
    return ("fail", kind, msg)


# ---- the way to each stage
def at(stage: str) -> RequestLifecycle:
    lc = RequestLifecycle(NAMES)
    if stage == "fetch":
        assert lc.on(Submit(plan(fetch=True))) == [Send(H, p.Export(RID, KEYS[16:48]))]
    elif stage == "slots":
        assert lc.on(Submit(plan())) == [expect()]
    elif stage in ("slots_pinned", "slots_fetched"):
        lc = at("fetch")
        assert lc.on(Arrived(H, p.Exported(RID, EP, [4096, 8192]))) == [expect(FETCH)]
        if stage == "slots_fetched":
            assert lc.on(Arrived(P, p.Fetched(RID))) == [Send(H, p.Unpin(RID))]
    elif stage == "decode":
        lc = at("slots")
        assert lc.on(Arrived(D, p.Tokens(RID, [5], None, REPORT))) == [
            c("decode_started"), Deliver(RID, [5], REPORT)]
    elif stage in ("draining", "draining_pinned"):
        lc = at("slots" if stage == "draining" else "slots_pinned")
        err = MooncakeError("cancelled by the caller")
        assert strip(lc.on(CancelRequest(RID, err))) == [c("cancel"), fail(MooncakeError, str(err)),
                                                         Send(P, p.Cancel(RID))]
    else:
        raise AssertionError(stage)
    want = {"fetch": Stage.FETCH, "decode": Stage.DECODE}.get(stage, Stage.DRAINING if "draining" in stage
                                                               else Stage.SLOTS)
    assert lc.stage(RID) is want
    return lc


# ---- the happy paths
def test_no_fetch_path_is_expect_then_tokens():
    lc = at("decode")
    assert lc.on(Arrived(D, p.Tokens(RID, [6, 7], None))) == [Deliver(RID, [6, 7])]
    assert lc.on(Arrived(D, p.Tokens(RID, [8], "length"))) == [Deliver(RID, [8]), c("decode_finished", 4),
                                                                 Finish(RID, "length")]
    assert len(lc) == 0 and lc.stage(RID) is None


def test_fetch_path_unpins_when_fetched():
    lc = at("slots_fetched")
    assert lc.on(Arrived(D, p.Tokens(RID, [5], "stop", REPORT))) == [
        Deliver(RID, [5], REPORT), c("decode_finished", 1), Finish(RID, "stop")]
    assert len(lc) == 0


def test_first_token_unpins_a_holder_whose_fetched_was_not_seen():
    lc = at("slots_pinned")
    assert lc.on(Arrived(D, p.Tokens(RID, [5], None, REPORT))) == [
        Send(H, p.Unpin(RID)), c("decode_started"), Deliver(RID, [5], REPORT)]


def test_holder_with_nothing_to_export_means_no_fetch():
    lc = at("fetch")
    assert lc.on(Arrived(H, p.Exported(RID, EP, []))) == [Send(H, p.Unpin(RID)), expect_unfetched()]


def test_a_fetch_not_prefetched_says_so_to_decode():
    """``Plan.prefetch`` (the decision's) travels in ``Expect`` (decode forwards it in
    ``Prefill``: the prefill instance starts such a fetch at the request's dequeue)."""
    from dataclasses import replace

    lc = RequestLifecycle(NAMES)
    assert lc.on(Submit(replace(plan(fetch=True), prefetch=False))) == [Send(H, p.Export(RID, KEYS[16:48]))]
    (sent,) = lc.on(Arrived(H, p.Exported(RID, EP, [4096, 8192])))
    assert sent.to == D and sent.msg.fetch == FETCH and sent.msg.prefetch is False
    assert expect(FETCH).msg.prefetch is True  # the default: started on arrival


def test_partial_export_fetches_what_the_holder_has():
    lc = at("fetch")
    got = lc.on(Arrived(H, p.Exported(RID, EP, [4096])))
    assert got == [expect(p.Fetch(H, EP, [4096], KEYS[16:32]))]


def test_prefill_started_when_the_prefill_instance_says_so():
    """Not at dispatch: the request may wait on its instance (its fetch, the requests
    before it that make its prefix); the conductor hears of the start from ``Started``,
    from the request's prefill instance, while its prefill runs."""
    lc = at("slots_fetched")
    assert lc.on(Arrived(D, p.Started(RID))) == []  # not its prefill instance
    assert lc.on(Arrived(P, p.Started(RID))) == [c("prefill_started")]
    assert lc.on(Arrived(D, p.Tokens(RID, [5], None, REPORT))) == [c("decode_started"), Deliver(RID, [5], REPORT)]
    assert lc.on(Arrived(P, p.Started(RID))) == []  # past its prefill
    assert lc.on(Arrived(P, p.Started(RID + 1))) == []  # no such request


def test_request_ended_by_the_prefill():
    # the first token ended it (EOS, max_tokens=1): decode only frees its slots
    lc = at("slots")
    assert lc.on(Arrived(D, p.Tokens(RID, [3], "length", REPORT))) == [
        Deliver(RID, [3], REPORT), c("decode_finished", 1), Finish(RID, "length")]
    assert len(lc) == 0


def test_aborted_finish_tells_the_conductor_cancel():
    lc = at("decode")
    assert lc.on(Arrived(D, p.Tokens(RID, [], "abort"))) == [Deliver(RID, []), c("cancel"), Finish(RID, "abort")]


# ---- every stage x every failure
DIED = "instance {} died (signal 9)"
DOWN = {i: InstanceDown(i, DIED.format(n)) for i, n in NAMES.items()}
DOWN_MSG = {i: DIED.format(n) + "; its in-flight requests failed" for i, n in NAMES.items()}
CANCEL_ERR = MooncakeError(f"request {RID} was cancelled")
LATE = Tick(1e9)
LATE_MSG = f"request {RID} passed its deadline (5s after submit); it was cancelled"


def on_fail(inst: int, error: str) -> str:
    return f"request {RID} failed on {NAMES[inst]}: {error}"


def dead(i):
    return fail(TransferFailed, DOWN_MSG[i])


CANCEL_P, CANCEL_D, UNPIN_H = Send(P, p.Cancel(RID)), Send(D, p.Cancel(RID)), Send(H, p.Unpin(RID))
ENDED = [c("cancel")]

# (stage, failure, commands, commands on the prefill's Cancelled ack or None when none is awaited)
CASES = [
    # FETCH: only the holder holds something (the pins)
    ("fetch", DOWN[P], ENDED + [dead(P), UNPIN_H], None),
    ("fetch", DOWN[D], ENDED + [dead(D), UNPIN_H], None),
    ("fetch", DOWN[H], [expect_unfetched()], None),
    ("fetch", Arrived(H, p.Failed(RID, "LookupError: gone")), [UNPIN_H, expect_unfetched()], None),
    ("fetch", Arrived(D, p.Failed(RID, "boom")), ENDED + [fail(MooncakeError, on_fail(D, "boom")), UNPIN_H], None),
    ("fetch", CancelRequest(RID, CANCEL_ERR), ENDED + [fail(MooncakeError, str(CANCEL_ERR)), UNPIN_H], None),
    ("fetch", LATE, ENDED + [fail(TransferTimeout, LATE_MSG), UNPIN_H], None),
    # SLOTS: decode reserved slots; the prefill may be writing into them
    ("slots", DOWN[P], ENDED + [dead(P), CANCEL_D], None),
    ("slots", DOWN[D], ENDED + [dead(D), CANCEL_P], []),
    ("slots", DOWN[H], [], None),
    ("slots", Arrived(P, p.Failed(RID, "KV hand-off failed: TransferFailed")),
     ENDED + [fail(MooncakeError, on_fail(P, "KV hand-off failed: TransferFailed")), CANCEL_D], None),
    ("slots", Arrived(D, p.Failed(RID, "StoreFull: no slot")),
     ENDED + [fail(MooncakeError, on_fail(D, "StoreFull: no slot")), CANCEL_P], [CANCEL_D]),
    ("slots", CancelRequest(RID, CANCEL_ERR), ENDED + [fail(MooncakeError, str(CANCEL_ERR)), CANCEL_P], [CANCEL_D]),
    ("slots", LATE, ENDED + [fail(TransferTimeout, LATE_MSG), CANCEL_P], [CANCEL_D]),
    # SLOTS with the holder's blocks pinned (the fetch may be reading them)
    ("slots_pinned", DOWN[P], ENDED + [dead(P), CANCEL_D, UNPIN_H], None),
    ("slots_pinned", DOWN[D], ENDED + [dead(D), CANCEL_P], [UNPIN_H]),
    ("slots_pinned", DOWN[H], [], None),
    ("slots_pinned", Arrived(P, p.Failed(RID, "x")), ENDED + [fail(MooncakeError, on_fail(P, "x")), CANCEL_D, UNPIN_H],
     None),
    ("slots_pinned", CancelRequest(RID, CANCEL_ERR), ENDED + [fail(MooncakeError, str(CANCEL_ERR)), CANCEL_P],
     [CANCEL_D, UNPIN_H]),
    ("slots_pinned", LATE, ENDED + [fail(TransferTimeout, LATE_MSG), CANCEL_P], [CANCEL_D, UNPIN_H]),
    ("slots_fetched", CancelRequest(RID, CANCEL_ERR), ENDED + [fail(MooncakeError, str(CANCEL_ERR)), CANCEL_P],
     [CANCEL_D]),
    ("slots_fetched", DOWN[H], [], None),
    # DECODE: the prefill is done; only the decode instance holds the request
    ("decode", DOWN[P], [], None),
    ("decode", DOWN[D], ENDED + [dead(D)], None),
    ("decode", DOWN[H], [], None),
    ("decode", Arrived(D, p.Failed(RID, "oom")), ENDED + [fail(MooncakeError, on_fail(D, "oom")), CANCEL_D], None),
    ("decode", CancelRequest(RID, CANCEL_ERR), ENDED + [fail(MooncakeError, str(CANCEL_ERR)), CANCEL_D], None),
    ("decode", LATE, ENDED + [fail(TransferTimeout, LATE_MSG), CANCEL_D], None),
    # DRAINING: already failed for the caller, waiting for the prefill's ack
    ("draining", DOWN[P], [CANCEL_D], None),
    ("draining", DOWN[D], [], []),
    ("draining", DOWN[H], [], [CANCEL_D]),
    ("draining", CancelRequest(RID, CANCEL_ERR), [], [CANCEL_D]),
    ("draining", LATE, [], [CANCEL_D]),
    ("draining", Arrived(D, p.Tokens(RID, [5], None, REPORT)), [], [CANCEL_D]),
    ("draining", Arrived(P, p.Failed(RID, "late")), [], [CANCEL_D]),
    ("draining_pinned", DOWN[P], [CANCEL_D, UNPIN_H], None),
    ("draining_pinned", DOWN[H], [], [CANCEL_D]),
    ("draining_pinned", Arrived(P, p.Fetched(RID)), [UNPIN_H], [CANCEL_D]),
]


@pytest.mark.parametrize("stage,event,want,after_ack", CASES,
                         ids=[f"{s}-{type(e).__name__}-{i}" for i, (s, e, _, _) in enumerate(CASES)])
def test_stage_x_failure(stage, event, want, after_ack):
    lc = at(stage)
    assert strip(lc.on(event)) == want
    if after_ack is None:
        # nothing awaited: the record is gone (or the request goes on, where the failure did not touch it)
        assert lc.stage(RID) in (None, Stage.DECODE, Stage.SLOTS, Stage.FETCH)
        if lc.stage(RID) is Stage.DRAINING:
            pytest.fail("a DRAINING request must name what the ack releases")
    else:
        assert lc.stage(RID) is Stage.DRAINING
        assert lc.on(Arrived(P, p.Cancelled(RID))) == after_ack
        assert lc.stage(RID) is None and len(lc) == 0
    # whatever happened, later messages of the request change nothing for a gone request
    if lc.stage(RID) is None:
        assert lc.on(Arrived(D, p.Tokens(RID, [1], "stop"))) == []
        assert lc.on(CancelRequest(RID, CANCEL_ERR)) == []


def test_prefill_death_in_decode_lets_the_request_finish():
    lc = at("decode")
    assert lc.on(DOWN[P]) == []
    assert lc.on(Arrived(D, p.Tokens(RID, [6], "stop"))) == [Deliver(RID, [6]), c("decode_finished", 2),
                                                              Finish(RID, "stop")]


def test_no_message_goes_to_a_dead_instance():
    lc = at("slots_pinned")
    lc.on(DOWN[H])
    assert strip(lc.on(CancelRequest(RID, CANCEL_ERR))) == ENDED + [fail(MooncakeError, str(CANCEL_ERR)), CANCEL_P]
    assert lc.on(DOWN[P]) == [CANCEL_D]  # no unpin for the dead holder
    assert len(lc) == 0


# ---- stale and odd inputs
def test_decision_naming_a_dead_instance_fails_at_once():
    lc = RequestLifecycle(NAMES)
    lc.on(DOWN[D])
    assert strip(lc.on(Submit(plan()))) == [c("cancel"), fail(TransferFailed, f"instance decode-0 is down; request "
                                                                              f"{RID} was not started")]
    assert len(lc) == 0


def test_holder_death_is_noticed_before_export():
    lc = RequestLifecycle(NAMES)
    lc.on(DOWN[H])
    assert lc.on(Submit(plan(fetch=True))) == [expect_unfetched()]


def test_export_answer_for_an_ended_request_unpins():
    lc = RequestLifecycle(NAMES)
    assert lc.on(Arrived(H, p.Exported(99, EP, [1]))) == [Send(H, p.Unpin(99))]


def test_messages_from_the_wrong_instance_are_ignored():
    lc = at("slots")
    assert lc.on(Arrived(P, p.Tokens(RID, [1], "stop", REPORT))) == []  # tokens come from the decode instance
    assert lc.on(Arrived(H, p.Cancelled(RID))) == []
    assert lc.stage(RID) is Stage.SLOTS


def test_deadline_not_reached_does_nothing():
    lc = at("slots")
    assert lc.on(Tick(99.0)) == []
    lc2 = RequestLifecycle(NAMES)
    lc2.on(Submit(plan(deadline=None)))
    assert lc2.on(Tick(1e12)) == []


def test_instance_down_twice_is_one_event():
    lc = at("slots")
    first = lc.on(DOWN[P])
    assert first and lc.on(DOWN[P]) == []


def test_many_requests_only_those_on_the_dead_instance_fail():
    lc = RequestLifecycle(NAMES | {3: "decode-1"})
    for rid, dec in ((1, D), (2, 3), (3, D)):
        lc.on(Submit(Plan(rid, [1] * 20, PARAMS, KEYS[:16], P, dec)))
    cmds = lc.on(InstanceDown(3, "instance decode-1 died (exit code 1)"))
    assert [x.rid for x in cmds if isinstance(x, Fail)] == [2]
    assert lc.running() == 2 and len(lc) == 3  # rid 2 drains until the prefill acks
    assert lc.on(Arrived(P, p.Cancelled(2))) == []
    assert len(lc) == 2


def test_unknown_event_is_refused():
    with pytest.raises(TypeError):
        RequestLifecycle(NAMES).on("new")


# ---- several holders (a multi-source fetch, Cluster(multipath=True))
EP2 = p.Endpoint("prefill-2", "", 5)
FKEYS = KEYS[16:48]  # the two blocks fetched
F1 = p.Fetch(H, EP, [4096, 8192], FKEYS)
F2 = p.Fetch(H2, EP2, [0, 12288], FKEYS)
UNPIN_H2 = Send(H2, p.Unpin(RID))


def plan2(also=(H2,)) -> Plan:
    pl = plan(fetch=True)
    return Plan(RID, pl.prompt, PARAMS, KEYS, P, D, pl.local, H, FKEYS, pl.deadline, pl.timeout_s, fetch_also=also)


def expect2(fetch: p.Fetch | None, also=(), split=()) -> Send:
    pl = plan(True)
    return Send(D, p.Expect(RID, pl.prompt, PARAMS, KEYS, pl.local, fetch, P, prefill_name=NAMES[P],
                            deadline=pl.deadline, fetch_also=list(also), fetch_split=list(split)))


def at2(stage: str) -> RequestLifecycle:
    """A request fetching from H and H2 at ``stage``: "fetch" (both asked), "fetch_one"
    (H answered, H2 not yet), "slots" (both exported, the fetch may be reading)."""
    lc = RequestLifecycle(NAMES2)
    assert lc.on(Submit(plan2())) == [Send(H, p.Export(RID, FKEYS)), Send(H2, p.Export(RID, FKEYS))]
    if stage == "fetch":
        return lc
    assert lc.on(Arrived(H, p.Exported(RID, EP, [4096, 8192]))) == []  # waits for the other holder
    assert lc.stage(RID) is Stage.FETCH
    if stage == "fetch_one":
        return lc
    assert lc.on(Arrived(H2, p.Exported(RID, EP2, [0, 12288]))) == [expect2(F1, [F2], [1, 1])]
    assert stage == "slots" and lc.stage(RID) is Stage.SLOTS
    return lc


def test_two_holders_fetch_then_both_unpin_once():
    lc = at2("slots")
    assert lc.on(Arrived(P, p.Fetched(RID))) == [Send(H, p.Unpin(RID)), UNPIN_H2]
    assert lc.on(Arrived(D, p.Tokens(RID, [5], "stop", REPORT))) == [
        Deliver(RID, [5], REPORT), c("decode_finished", 1), Finish(RID, "stop")]  # no second unpin
    assert len(lc) == 0


def test_two_holders_first_token_unpins_both():
    lc = at2("slots")
    assert lc.on(Arrived(D, p.Tokens(RID, [5], None, REPORT)))[:2] == [Send(H, p.Unpin(RID)), UNPIN_H2]


def test_a_holder_with_nothing_or_less_is_left_out():
    lc = at2("fetch")
    assert lc.on(Arrived(H2, p.Exported(RID, EP2, []))) == [UNPIN_H2]  # nothing there: let go at once
    assert lc.on(Arrived(H, p.Exported(RID, EP, [4096, 8192]))) == [expect2(F1)]
    lc = at2("fetch")
    assert lc.on(Arrived(H, p.Exported(RID, EP, [4096]))) == []
    # H2 has the longer run: fetch it from H2 alone, H (one block) is let go
    assert lc.on(Arrived(H2, p.Exported(RID, EP2, [0, 12288]))) == [
        Send(H, p.Unpin(RID)), expect2(p.Fetch(H2, EP2, [0, 12288], FKEYS))]
    assert lc.on(Arrived(P, p.Fetched(RID))) == [UNPIN_H2]


@pytest.mark.parametrize("how", ["died", "failed"])
@pytest.mark.parametrize("stage", ["fetch", "fetch_one"])
def test_a_holder_lost_before_it_exported_drops_out(how, stage):
    lc = at2(stage)
    ev = InstanceDown(H2, "instance prefill-2 died") if how == "died" else Arrived(H2, p.Failed(RID, "gone"))
    let_go = [] if how == "died" else [UNPIN_H2]  # a dead holder holds nothing to let go
    if stage == "fetch":
        assert lc.on(ev) == let_go
        assert lc.on(Arrived(H, p.Exported(RID, EP, [4096, 8192]))) == [expect2(F1)]
    else:
        assert lc.on(ev) == let_go + [expect2(F1)]
    assert lc.on(Arrived(P, p.Fetched(RID))) == [Send(H, p.Unpin(RID))]
    assert len(lc) == 1 and lc.on(Arrived(D, p.Tokens(RID, [5], "stop", REPORT)))[-1] == Finish(RID, "stop")


def test_a_holder_dead_after_it_exported_is_no_source():
    lc = at2("fetch_one")
    assert lc.on(InstanceDown(H, "instance prefill-1 died")) == []  # H2 still to answer
    assert lc.on(Arrived(H2, p.Exported(RID, EP2, [0, 12288]))) == [
        expect2(p.Fetch(H2, EP2, [0, 12288], FKEYS))]
    assert lc.on(Arrived(P, p.Fetched(RID))) == [UNPIN_H2]


def test_every_holder_lost_means_the_prefix_is_computed():
    lc = at2("fetch")
    assert lc.on(Arrived(H, p.Failed(RID, "x"))) == [Send(H, p.Unpin(RID))]
    assert lc.on(InstanceDown(H2, "instance prefill-2 died")) == [expect2(None)]
    assert lc.on(Arrived(P, p.Fetched(RID))) == []


def test_a_holder_dying_during_the_fetch_leaves_the_other_pinned_until_fetched():
    lc = at2("slots")
    assert lc.on(InstanceDown(H, "instance prefill-1 died")) == []  # the prefill reads around it
    assert lc.on(Arrived(P, p.Fetched(RID))) == [UNPIN_H2]
    assert lc.on(Arrived(D, p.Tokens(RID, [5], "stop", REPORT)))[-1] == Finish(RID, "stop")


def test_holders_dead_before_submit_are_not_asked():
    lc = RequestLifecycle(NAMES2)
    lc.on(InstanceDown(H, "instance prefill-1 died"))
    assert lc.on(Submit(plan2())) == [Send(H2, p.Export(RID, FKEYS))]
    # the decision's holder named again in fetch_also, or the prefill instance itself: asked once / never
    lc = RequestLifecycle(NAMES2)
    assert lc.on(Submit(plan2(also=(H, P, D, H2)))) == [Send(H, p.Export(RID, FKEYS)), Send(H2, p.Export(RID, FKEYS))]


@pytest.mark.parametrize("stage", ["fetch", "fetch_one", "slots"])
@pytest.mark.parametrize("ending", ["cancel", "late", "prefill_died", "decode_died"])
def test_two_holders_every_ending_unpins_each_once(stage, ending):
    """Each ending at each stage: every live holder gets exactly one Unpin, never while
    the prefill may still read (then only after its Cancelled ack), and a holder's late
    Exported (for a request that ended) is answered with an Unpin of its own."""
    lc = at2(stage)
    ev = {"cancel": CancelRequest(RID, CANCEL_ERR), "late": LATE, "prefill_died": DOWN[P],
          "decode_died": DOWN[D]}[ending]
    cmds = lc.on(ev)
    assert [x for x in cmds if isinstance(x, Fail)] and lc.running() == 0
    unpins = [x.to for x in cmds if isinstance(x, Send) and isinstance(x.msg, p.Unpin)]
    if stage == "slots" and ending != "prefill_died":  # the prefill may be reading: the ack first
        assert unpins == [] and Send(P, p.Cancel(RID)) in cmds
        after = lc.on(Arrived(P, p.Cancelled(RID)))
        unpins = [x.to for x in after if isinstance(x, Send) and isinstance(x.msg, p.Unpin)]
    assert unpins == [H, H2]
    assert len(lc) == 0
    if stage != "slots":  # a holder still to answer does, later: it lets go again (its pins are gone already)
        assert lc.on(Arrived(H2, p.Exported(RID, EP2, [0]))) == [UNPIN_H2]


def test_split_follows_the_holders_flows():
    """The holder that is busy (prefilling another request, serving another fetch) sends
    less: its free bandwidth is bandwidth / (flows + 1)."""
    keys6 = p.pack_keys(list(range(100, 106)))
    lc = RequestLifecycle(NAMES2 | {4: "prefill-3"})
    # request 1 prefills on H (its KV streams out of H's link)
    lc.on(Submit(Plan(1, list(range(40)), PARAMS, KEYS[:32], H, D)))
    assert lc.stage(1) is Stage.SLOTS
    pl = Plan(RID, list(range(120)), PARAMS, keys6 + KEYS[:16], 4, D, 0, H, keys6, fetch_also=(H2,))
    lc.on(Submit(pl))
    lc.on(Arrived(H, p.Exported(RID, EP, list(range(6)))))
    cmds = lc.on(Arrived(H2, p.Exported(RID, EP2, list(range(6)))))
    exp = cmds[0].msg
    assert isinstance(exp, p.Expect) and exp.fetch_split == [2, 4]  # free: 1/2 vs 1
    assert [f.holder for f in [exp.fetch, *exp.fetch_also]] == [H, H2]


# ---- the router (the pump), with a fake cluster port and conductor: no engines, no thread
class FakeConductor:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a: self.calls.append((name, *a))


class FakePort:
    prefix_reuse, block_size = True, 16

    def __init__(self):
        from mooncake_rs.serving.metrics import ClusterMetrics

        self.conductor = FakeConductor()
        self.metrics = ClusterMetrics()
        self.sent, self.down, self.lost_peers, self.replies = [], [], [], []

    def send(self, inst, msg):
        self.sent.append((inst, msg))

    def instance_ready(self, inst, msg):
        self.replies.append(("ready", inst))

    def instance_down(self, inst, reason):
        self.down.append((inst, reason))
        return f"instance {NAMES[inst]} died ({reason})"

    def exited(self):
        return []

    def link_reports(self):
        return []

    replicate_every_s = None
    replica_max_bytes = 0.0

    def peer_lost(self, inst, peer, reason):
        self.lost_peers.append((inst, peer))

    def reply(self, inst, msg):
        self.replies.append((inst, msg))

    def output(self, record, reason):
        return (record.plan.rid, list(record.tokens), reason)

    def now(self):
        return 1.0


def _router():
    from mooncake_rs.serving.router import Router

    port = FakePort()
    return Router(port, NAMES), port


def _record(rid, fetch=False):
    import time as _t

    from mooncake_rs.client.handle import RequestHandle
    from mooncake_rs.serving.router import RequestRecord

    pl = plan(fetch)
    pl = Plan(rid, pl.prompt, pl.params, pl.keys, pl.prefill, pl.decode, pl.local, pl.fetch_from, pl.fetch_keys)
    return RequestRecord(pl, RequestHandle(rid, pl.prompt), _t.monotonic())


def test_router_pumps_a_request_through():
    from mooncake_rs.serving.router import New

    router, port = _router()
    a, b = _record(1), _record(2)
    router.handle(-1, New(a))
    router.handle(-1, New(b))
    assert [(i, type(m).__name__) for i, m in port.sent] == [(D, "Expect"), (D, "Expect")]
    assert router.in_flight() == 0  # not submitted through submit(): nothing counted
    router.handle(P, p.Started(1))  # the prefill instance's engine took them
    router.handle(P, p.Started(2))
    router.handle(D, p.Step([p.Tokens(1, [5], None, REPORT), p.Tokens(2, [6], "stop", REPORT)]))
    router.handle(D, p.Tokens(1, [7], "length"))
    assert a.handle.result(0) == (1, [5, 7], "length") and b.handle.result(0) == (2, [6], "stop")
    assert a.metrics.reused_tokens == 2 * 16 and a.metrics.transferred_bytes == 4096 and a.metrics.ttft_s >= 0
    assert port.metrics.finished == 2
    names = [c[0] for c in port.conductor.calls]
    assert names.count("on_prefill_started") == 2 and names.count("on_decode_finished") == 2


def test_router_instance_death_and_conductor_swap():
    from mooncake_rs.serving.control import Lost
    from mooncake_rs.serving.router import New, SwapConductor

    router, port = _router()
    rec = _record(1)
    router.handle(-1, New(rec))
    router.handle(D, Lost("closed"))
    assert port.down == [(D, "closed")]
    assert ("remove_instance", D) in port.conductor.calls
    with pytest.raises(TransferFailed, match="decode-0 died"):
        rec.handle.result(0)
    assert (P, p.Cancel(1)) in port.sent  # the prefill goes first; the decode is dead
    router.handle(D, Lost("closed"))  # once is enough
    assert len(port.down) == 1
    import threading

    fresh, done = FakeConductor(), threading.Event()
    router.handle(-1, SwapConductor(fresh, done))
    assert done.is_set() and port.conductor is fresh and fresh.calls == [("remove_instance", D)]


def test_router_routes_the_rest():
    router, port = _router()
    events = b"MCE1" + b"\0" * 18  # passed on as they are: the conductor decodes them
    router.handle(P, p.StoreEvents(events))
    assert port.conductor.calls == [("apply_store_events", P, events)]
    router.handle(P, p.PeerLost(D, "bad frame"))
    assert port.lost_peers == [(P, D)]
    router.handle(P, p.Timings([(16, 0, 0.1)]))
    router.handle(P, p.Failed(None, "measure failed"))
    assert [type(m).__name__ for _, m in port.replies] == ["Timings", "Failed"]
    router.handle(P, p.Ready(p.PROTOCOL_VERSION, EP, 1, 8192, 64, 1024))
    assert ("ready", P) in port.replies


# ---- random interleavings: the safety rules hold whatever the order
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

@settings(max_examples=400, deadline=None)
@given(st.data())
def test_random_interleavings_keep_the_safety_rules(data):
    """Any order of what can really happen (submissions, holder answers, fetches, tokens,
    failures, deaths, cancels, deadlines, acks): each request ends exactly once for its
    caller; nothing is sent to a dead instance; the decode instance is never told to free
    a request's slots, nor a holder to unpin its blocks, while the prefill instance may
    still write into those slots or read those blocks; and once every request has ended
    and every ack is in, nothing is left. A request may fetch from two holders at once
    (multipath): each holder answers, fails or dies on its own."""
    lc = RequestLifecycle(NAMES2)
    rids = [1, 2, 3]
    fetch_of = {r: data.draw(st.booleans(), label=f"fetch {r}") for r in rids}
    also_of = {r: data.draw(st.sampled_from([(), (), (H2,)]), label=f"also {r}") for r in rids}
    submitted, ended, down = set(), {}, set()
    expect_sent, fetch_sent, cancel_p, acked, reported = set(), set(), set(), set(), set()
    # the prefill may write the decode slots of (rid) / read the pinned blocks of (rid, holder)
    writing, reading = set(), set()
    export_sent, unpinned = set(), set()  # (rid, holder)
    answered = set()  # (rid, holder): Exported or Failed sent

    def apply(ev):
        cmds = lc.on(ev)
        for c in cmds:
            if isinstance(c, Send):
                assert c.to not in down, (ev, c)
                rid = getattr(c.msg, "rid", None)
                if isinstance(c.msg, p.Expect):
                    expect_sent.add(rid)
                    writing.add(rid)
                    if c.msg.fetch is not None:
                        fetch_sent.add(rid)
                        for f in [c.msg.fetch, *c.msg.fetch_also]:
                            assert (rid, f.holder) in export_sent and (rid, f.holder) not in unpinned
                            assert f.holder not in down
                            reading.add((rid, f.holder))
                        if c.msg.fetch_also:
                            assert sum(c.msg.fetch_split) == len(c.msg.fetch.offsets)
                elif isinstance(c.msg, p.Export):
                    export_sent.add((rid, c.to))
                elif isinstance(c.msg, p.Cancel) and c.to == D:
                    assert rid not in writing, f"decode slots of {rid} freed while the prefill may write: {ev}"
                elif isinstance(c.msg, p.Cancel) and c.to == P:
                    cancel_p.add(rid)
                elif isinstance(c.msg, p.Unpin):
                    assert (rid, c.to) not in reading, f"holder unpinned {rid} while the prefill may read: {ev}"
                    unpinned.add((rid, c.to))
            elif isinstance(c, (Finish, Fail)):
                assert c.rid not in ended, f"{c.rid} ended twice"
                ended[c.rid] = c
        return cmds

    def stop_reading(rid):
        for x in [x for x in reading if x[0] == rid]:
            reading.discard(x)

    def prefill_done(rid):
        writing.discard(rid)
        stop_reading(rid)

    for _ in range(data.draw(st.integers(5, 40), label="steps")):
        choices = []  # progress 4x as likely as a fault, so long lives get explored too
        for r in rids:
            if r not in submitted:
                choices += [("submit", r)] * 4
                continue
            for h in (H, H2):
                if (r, h) in export_sent and (r, h) not in answered:  # a dead holder's last words too
                    choices += [("exported", (r, h))] * 4
                    choices.append(("export_failed", (r, h)))
            if r in fetch_sent and P not in down:
                choices += [("fetched", r)] * 4
            if r in expect_sent and P not in down and D not in down and r not in reported:
                choices += [("first", r)] * 4
            if r in reported and D not in down:
                choices += [("more", r)] * 4
                choices += [("final", r)] * 4
            if r in expect_sent and P not in down:
                choices.append(("prefill_failed", r))
            if r in expect_sent and D not in down:
                choices.append(("decode_failed", r))
            if r in cancel_p and r not in acked and P not in down:
                choices += [("ack", r)] * 4
            choices.append(("cancel", r))
        choices += [("down", i) for i in (P, H, H2, D) if i not in down] + [("late", 0)]
        kind, r = data.draw(st.sampled_from(choices))
        if kind == "submit":
            submitted.add(r)
            pl = plan(fetch_of[r])
            apply(Submit(Plan(r, pl.prompt, PARAMS, KEYS, P, D, pl.local, pl.fetch_from, pl.fetch_keys,
                              deadline=50.0 + r, timeout_s=1.0, fetch_also=also_of[r])))
        elif kind == "exported":
            answered.add(r)
            apply(Arrived(r[1], p.Exported(r[0], EP, data.draw(st.sampled_from([[], [4096], [4096, 8192]])))))
        elif kind == "export_failed":
            answered.add(r)
            apply(Arrived(r[1], p.Failed(r[0], "boom")))
        elif kind == "fetched":
            stop_reading(r)
            apply(Arrived(P, p.Fetched(r)))
        elif kind == "first":
            reported.add(r)
            prefill_done(r)  # decode got KvReady: the prefill is done with slots and holder
            apply(Arrived(D, p.Tokens(r, [5], data.draw(st.sampled_from([None, None, "length"])), REPORT)))
        elif kind == "more":
            apply(Arrived(D, p.Tokens(r, [6], None)))
        elif kind == "final":
            apply(Arrived(D, p.Tokens(r, [7], "stop")))
        elif kind == "prefill_failed":
            prefill_done(r)  # the prefill dropped it before reporting
            apply(Arrived(P, p.Failed(r, "KV hand-off failed")))
        elif kind == "decode_failed":
            apply(Arrived(D, p.Failed(r, "StoreFull")))
        elif kind == "ack":
            acked.add(r)
            prefill_done(r)
            apply(Arrived(P, p.Cancelled(r)))
        elif kind == "cancel":
            apply(CancelRequest(r, MooncakeError("cancelled")))
        elif kind == "down":
            down.add(r)
            if r == P:
                for x in rids:
                    prefill_done(x)
            if r in (H, H2):  # a dead holder has nothing left to read
                for x in [x for x in reading if x[1] == r]:
                    reading.discard(x)
            apply(InstanceDown(r, f"instance {NAMES2[r]} died"))
        elif kind == "late":
            apply(Tick(1e9))
    # drain: every request ends, every awaited ack arrives (or the prefill dies)
    for r in rids:
        if r in submitted:
            apply(CancelRequest(r, MooncakeError("end of test")))
    for r in rids:
        if lc.stage(r) is Stage.DRAINING:
            prefill_done(r)
            apply(Arrived(P, p.Cancelled(r)))
    assert set(ended) == submitted
    assert len(lc) == 0
    # every pin of a live holder was let go
    assert {x for x in export_sent if x[1] not in down} <= unpinned, (export_sent, unpinned)


def test_store_events_reach_a_real_conductor_and_bad_ones_down_the_sender():
    """The store's drained events travel as its own bytes and land in the conductor's
    index as they are; bytes the conductor refuses take the sending instance down (it is
    at fault), never the router."""
    import mooncake_rs as mr

    router, port = _router()
    port.conductor = mr.Conductor(mr.ConductorConfig(block_size=16))
    port.conductor.add_prefill(P)
    port.conductor.add_decode(D)
    store = mr.Store(4096, 4096 * 8)
    store.put(5, bytes(4096))
    store.put(6, bytes(4096))
    router.handle(P, p.StoreEvents(store.drain_events_batch().to_bytes()))
    assert port.conductor.index.match_prefix([5, 6]).get(P) == 2
    router.handle(P, p.StoreEvents(b"MCE1 truncated"))
    assert port.down and port.down[-1][0] == P and "malformed store events" in port.down[-1][1]


@pytest.mark.parametrize("stage", ["fetch", "slots", "decode"])
def test_each_ending_carries_its_outcome(stage):
    # the metrics counter a Fail lands in: a caller's cancel is "cancelled" unless it
    # says otherwise, a deadline "timed_out", an instance's death "failed"
    def outcome_of(ev):
        lc = at(stage)
        fails = [x for x in lc.on(ev) if isinstance(x, Fail)]
        assert len(fails) == 1
        return fails[0].outcome

    assert outcome_of(CancelRequest(RID, CANCEL_ERR)) == "cancelled"
    assert outcome_of(CancelRequest(RID, CANCEL_ERR, "failed")) == "failed"
    assert outcome_of(LATE) == "timed_out"
    assert outcome_of(InstanceDown(D, "instance decode-0 died (signal 9)")) == "failed"


def test_every_member_is_known_before_any_instance_runs(monkeypatch):
    """An in-process instance can send Ready before spawn_all returns, and the router
    looks the sender up among the cluster's members when it does: spawn_all fills the
    cluster's dict before it starts any instance (a Ready that arrived first was dropped
    and the Cluster waited out its 180 s start-up timeout)."""
    import queue

    from mooncake_rs.serving import members as M

    into: dict = {}
    seen: list = []
    monkeypatch.setattr(M, "_run_instance", lambda spec, *a: seen.append((spec.id, set(into))))
    specs = [p.InstanceSpec(i, role, f"{role}-{i}", "tiny", 16, 1 << 20) for i, role in
             ((0, "prefill"), (1, "prefill"), (2, "decode"))]
    out = M.spawn_all(specs, False, queue.SimpleQueue(), None, "", members=into)
    for m in out.values():
        m.thread.join(timeout=10)
    assert out is into and sorted(seen) == [(i, {0, 1, 2}) for i in range(3)]


def test_more_tokens_is_the_tokens_fast_path():
    # what the router's hot path asks: True exactly when ``tokens`` would answer one
    # Deliver of the message's tokens (and the count moved the same way)
    lc = at("decode")
    assert lc.more_tokens(D, p.Tokens(RID, [6, 7], None))
    assert not lc.more_tokens(P, p.Tokens(RID, [8], None))  # not its decode instance
    assert not lc.more_tokens(D, p.Tokens(RID, [8], "length"))  # a finish: tokens() decides
    assert not lc.more_tokens(D, p.Tokens(RID + 1, [8], None))  # unknown request
    assert not at("slots").more_tokens(D, p.Tokens(RID, [5], None, REPORT))  # the first token
    # the two counted tokens are in decode_finished's n (1 first + 2 more + 1 last)
    assert lc.tokens(D, p.Tokens(RID, [8], "length")) == [Deliver(RID, [8]), c("decode_finished", 4),
                                                         Finish(RID, "length")]


def test_router_keeps_a_real_conductors_loads_right():
    """One conductor call at the first token (decode_started ends the prefill stage too):
    the prefill's queue empties at the first token, the decode batch at the last."""
    import mooncake_rs as mr
    from mooncake_rs.serving.router import New

    router, port = _router()
    cond = port.conductor = mr.Conductor(mr.ConductorConfig(block_size=16))
    cond.add_prefill(P)
    cond.add_decode(D)
    rec = _record(1)
    cond.schedule(1, [11, 12, 13, 14], len(rec.plan.prompt), 0.5)
    router.handle(-1, New(rec))

    def loads():
        s = cond.snapshot()
        pre, dec = s.prefill[0], s.decode[0]
        return pre.queued + pre.running, dec.batch, dec.decoding

    assert loads() == (1, 1, 0)  # prefilling; its decode slot is reserved
    router.handle(D, p.Tokens(1, [5], None, REPORT))
    assert loads() == (0, 1, 1)
    router.handle(D, p.Tokens(1, [6], None))
    router.handle(D, p.Tokens(1, [7], "length"))
    assert loads() == (0, 0, 0)
    assert rec.handle.result(0) == (1, [5, 6, 7], "length")
    assert cond.predicted_output_len(11) == pytest.approx(3.0, rel=0.5)  # history learnt from it
    # a request whose first token is its last: decode_finished alone, straight from prefilling
    one = _record(2)
    cond.schedule(2, [11, 12, 13, 14], len(one.plan.prompt), 0.6)
    router.handle(-1, New(one))
    assert loads() == (1, 1, 0)
    router.handle(D, p.Tokens(2, [9], "stop", REPORT))
    assert loads() == (0, 0, 0) and one.handle.result(0) == (2, [9], "stop")


def test_handle_result_waits_for_every_waiter_and_times_out():
    import threading

    from mooncake_rs.client.handle import RequestHandle

    h = RequestHandle(1, [1, 2])
    cancelled = []
    h._on_cancel = lambda rid, err, outcome: cancelled.append((rid, outcome))
    got: list = []
    waiters = [threading.Thread(target=lambda: got.append(h.result(30))) for _ in range(3)]
    for t in waiters:
        t.start()
    assert not h.done
    h._finish("out")
    for t in waiters:
        t.join(10)
    assert got == ["out"] * 3 and h.done and h.result(0) == "out"
    h._fail(MooncakeError("late"))  # ended already: the output stands
    assert h.result() == "out" and list(h) == []

    slow = RequestHandle(2, [1])
    slow._on_cancel = lambda rid, err, outcome: cancelled.append((rid, outcome))
    with pytest.raises(TransferTimeout, match="did not finish within 0.05s"):
        slow.result(0.05)
    assert slow.done and cancelled == [(2, "timed_out")]
    with pytest.raises(TransferTimeout):
        slow.result(0)


def test_a_token_queued_after_a_cancel_is_not_streamed():
    """A cancel from another thread (the HTTP front's drain at shutdown) ends the handle
    while the router may still deliver a token it already had: that token lands behind the
    end marker. The async stream ends at the marker and raises the cancel's error; the
    late token is dropped, not handed out as a token (it was, with the marker, to the
    HTTP front's detokenizer: a TypeError instead of the shutdown's error)."""
    import asyncio

    from mooncake_rs.client.handle import RequestHandle

    async def stream(h: RequestHandle) -> tuple[list[list[int]], BaseException | None]:
        got: list[list[int]] = []
        try:
            async for batch in h.batches():
                got.append(batch)
        except MooncakeError as e:
            return got, e
        return got, None

    h = RequestHandle(1, [1, 2])
    h._token(5)
    h.cancel(MooncakeError("shutting down"))
    h._token(6)  # the router's late delivery
    got, err = asyncio.run(asyncio.wait_for(stream(h), 10))  # (it waited forever for a marker it had passed)
    assert got == [[5]] and str(err) == "shutting down"

    sync = RequestHandle(2, [1])
    sync._token(5)
    sync.cancel(MooncakeError("shutting down"))
    sync._token(6)
    toks = []
    with pytest.raises(MooncakeError, match="shutting down"):
        for t in sync:
            toks.append(t)
    assert toks == [5]
