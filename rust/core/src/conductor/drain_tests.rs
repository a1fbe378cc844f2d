//! Draining and role switches: a drained instance takes nothing new, keeps what it
//! holds, and switches pool without dropping or double-counting a request.

use proptest::prelude::*;

use super::*;

fn cfg() -> ConductorConfig {
    ConductorConfig {
        block_size: 10,
        policy: PolicyKind::LoadBalance,
        rejection: RejectionKind::None,
        ..Default::default()
    }
}

fn sched(c: &Conductor, id: u64, now: f64) -> Result<Decision, ConductorError> {
    c.schedule(&ScheduleRequest {
        request_id: id,
        block_hashes: &[],
        prompt_len: 100,
        now,
        expected_output_len: Some(10),
    })
}

#[test]
fn drained_prefill_gets_nothing_new_and_keeps_its_requests() {
    let c = Conductor::new(cfg()).unwrap();
    c.add_prefill(0, PrefillSpec::default()).unwrap();
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c.add_decode(2, DecodeSpec::default()).unwrap();
    let first = sched(&c, 1, 0.0).unwrap().prefill;
    assert_eq!(c.drain_instance(first).unwrap(), 1);
    assert_eq!(c.drain_instance(first).unwrap(), 1, "draining twice is allowed");
    assert!(c.is_draining(first).unwrap());
    assert!(!c.is_drained(first).unwrap());
    for id in 2..20 {
        assert_ne!(sched(&c, id, 0.0).unwrap().prefill, first);
    }
    assert!(matches!(
        c.switch_role(first, RoleSpec::Decode(DecodeSpec::default())),
        Err(ConductorError::InvalidArgument(_))
    ));
    c.on_prefill_started(1, Some(0.1)).unwrap();
    assert_eq!(c.held_requests(first).unwrap(), 1);
    c.on_prefill_finished(1, Some(0.2)).unwrap();
    // past its prefill, request 1 no longer needs the instance
    assert!(c.is_drained(first).unwrap());
    c.switch_role(first, RoleSpec::Decode(DecodeSpec::default())).unwrap();
    c.check_integrity().unwrap();
    assert!(!c.is_draining(first).unwrap());
    c.on_decode_started(1, Some(0.3)).unwrap();
    c.on_decode_finished(1, 10, Some(0.4)).unwrap();
    let snap = c.snapshot(None).unwrap();
    assert_eq!(snap.prefill.len(), 1);
    assert_eq!(snap.decode.iter().map(|d| d.id).collect::<Vec<_>>(), vec![first, 2]);
    c.check_integrity().unwrap();
}

#[test]
fn all_draining_rejects_and_undrain_restores() {
    let c = Conductor::new(cfg()).unwrap();
    c.add_prefill(0, PrefillSpec::default()).unwrap();
    c.add_decode(1, DecodeSpec::default()).unwrap();
    c.drain_instance(1).unwrap();
    match sched(&c, 1, 0.0) {
        Err(ConductorError::Overloaded { reason: RejectReason::NoDecodeInstance, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(c.is_drained(1).unwrap());
    c.undrain_instance(1).unwrap();
    assert!(!c.is_drained(1).unwrap());
    sched(&c, 1, 0.0).unwrap();
    c.drain_instance(0).unwrap();
    match sched(&c, 2, 0.0) {
        Err(ConductorError::Overloaded { reason: RejectReason::NoPrefillInstance, .. }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_ids_and_specs_are_typed_errors() {
    let c = Conductor::new(cfg()).unwrap();
    c.add_prefill(0, PrefillSpec::default()).unwrap();
    assert_eq!(c.drain_instance(9), Err(ConductorError::UnknownInstance(9)));
    assert_eq!(c.undrain_instance(9), Err(ConductorError::UnknownInstance(9)));
    assert_eq!(c.is_drained(9), Err(ConductorError::UnknownInstance(9)));
    assert_eq!(c.is_draining(9), Err(ConductorError::UnknownInstance(9)));
    assert_eq!(c.held_requests(9), Err(ConductorError::UnknownInstance(9)));
    assert_eq!(c.switch_role(9, RoleSpec::Prefill(PrefillSpec::default())), Err(ConductorError::UnknownInstance(9)));
    assert!(matches!(
        c.switch_role(0, RoleSpec::Decode(DecodeSpec::default())),
        Err(ConductorError::InvalidArgument(_))
    ));
    c.drain_instance(0).unwrap();
    let bad = DecodeSpec { max_batch: 0, ..DecodeSpec::default() };
    assert!(matches!(c.switch_role(0, RoleSpec::Decode(bad)), Err(ConductorError::InvalidConfig(_))));
    assert!(c.is_draining(0).unwrap(), "a refused switch changes nothing");
}

#[derive(Debug, Clone)]
enum Op {
    Schedule,
    /// Advance the k-th in-flight request (modulo) by one stage.
    Step(usize),
    Drain(u64),
    Undrain(u64),
    /// Switch instance id to the other pool if it is drained.
    Switch(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Schedule),
        4 => (0usize..64).prop_map(Op::Step),
        1 => (0u64..5).prop_map(Op::Drain),
        1 => (0u64..5).prop_map(Op::Undrain),
        1 => (0u64..5).prop_map(Op::Switch),
    ]
}

/// Advances request `rid` (at `stage`) by one progress event; true when it finished.
fn step(c: &Conductor, rid: u64, stage: &mut u8, t: f64) -> bool {
    match *stage {
        0 => c.on_prefill_started(rid, Some(t)).unwrap(),
        1 => c.on_prefill_finished(rid, Some(t)).unwrap(),
        2 => c.on_decode_started(rid, Some(t)).unwrap(),
        _ => {
            c.on_decode_finished(rid, 10, Some(t)).unwrap();
            return true;
        }
    }
    *stage += 1;
    false
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Any interleaving of schedules, progress events, drains and role switches: a
    /// draining instance is never chosen, a switch happens only once its instance holds
    /// nothing, every admitted request finishes exactly once through the normal events
    /// (none dropped, none counted twice), and every invariant holds after each step.
    #[test]
    fn drains_and_switches_never_lose_a_request(ops in prop::collection::vec(op(), 1..120)) {
        let c = Conductor::new(cfg()).unwrap();
        for id in 0..2 { c.add_prefill(id, PrefillSpec::default()).unwrap(); }
        for id in 2..5 { c.add_decode(id, DecodeSpec::default()).unwrap(); }
        let mut live: Vec<(u64, u8)> = Vec::new();
        let (mut next, mut admitted, mut finished, mut switches) = (0u64, 0usize, 0usize, 0usize);
        let mut t = 0.0;
        for o in ops {
            t += 0.01;
            match o {
                Op::Schedule => {
                    next += 1;
                    match sched(&c, next, t) {
                        Ok(d) => {
                            prop_assert!(!c.is_draining(d.prefill).unwrap() && !c.is_draining(d.decode).unwrap());
                            admitted += 1;
                            live.push((next, 0));
                        }
                        Err(ConductorError::Overloaded { .. }) => {}
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                }
                Op::Step(k) if !live.is_empty() => {
                    let k = k % live.len();
                    let (rid, mut stage) = live[k];
                    if step(&c, rid, &mut stage, t) {
                        live.swap_remove(k);
                        finished += 1;
                    } else {
                        live[k].1 = stage;
                    }
                }
                Op::Step(_) => {}
                Op::Drain(id) => { c.drain_instance(id).unwrap(); }
                Op::Undrain(id) => { c.undrain_instance(id).unwrap(); }
                Op::Switch(id) => {
                    let snap = c.snapshot(None).unwrap();
                    let to_decode = snap.prefill.iter().any(|p| p.id == id);
                    let role = if to_decode { RoleSpec::Decode(DecodeSpec::default()) } else { RoleSpec::Prefill(PrefillSpec::default()) };
                    let drained = c.is_drained(id).unwrap();
                    let r = c.switch_role(id, role);
                    prop_assert_eq!(r.is_ok(), drained, "switch_role {:?} with is_drained {}", r, drained);
                    if drained { switches += 1; }
                }
            }
            c.check_integrity().map_err(TestCaseError::fail)?;
            let snap = c.snapshot(None).unwrap();
            prop_assert_eq!(snap.requests, live.len());
            prop_assert_eq!(snap.prefill.len() + snap.decode.len(), 5);
            for (id, draining) in snap.prefill.iter().map(|p| (p.id, p.draining)).chain(snap.decode.iter().map(|d| (d.id, d.draining))) {
                prop_assert_eq!(draining, c.is_draining(id).unwrap());
            }
        }
        // Drain everything that is left through the normal events.
        while let Some((rid, mut stage)) = live.pop() {
            while !step(&c, rid, &mut stage, t) {}
            finished += 1;
        }
        prop_assert_eq!(finished, admitted);
        prop_assert_eq!(c.snapshot(None).unwrap().requests, 0);
        c.check_integrity().map_err(TestCaseError::fail)?;
        let _ = switches;
    }
}
