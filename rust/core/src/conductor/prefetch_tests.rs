//! Prefetch at decision time (`ConductorConfig::prefetch_staging_bytes`): a fetch that
//! fits the instance's free staging memory starts at the decision and overlaps the
//! queue; the staging memory is held until the request leaves its queue; a fetch that
//! does not fit is priced and planned as without prefetch. Unit costs as in tests.rs:
//! prefill 1 ms/token, network 10,000 B/s at 1 B/token + 10 ms latency, blocks of 10.

use super::tests::{close, req4 as req, unit_mooncake};
use super::*;
use crate::index::Tier;

const A: [u128; 10] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
const B: [u128; 10] = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20];
const C: [u128; 10] = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30];
const D: [u128; 10] = [31, 32, 33, 34, 35, 36, 37, 38, 39, 40];

/// Instance 1 is empty with 50 ms of queue; instance 2 holds the 100-token prefixes A,
/// B, C and D with 1 s of queue, its links reported idle.
fn setup(c: &Conductor) {
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    assert_eq!(c.schedule(&req(98, &[], 50, 0.0)).unwrap().prefill, 1);
    c.add_prefill(2, PrefillSpec::default()).unwrap();
    for h in [&A, &B, &C, &D] {
        c.on_blocks_stored(2, h, Tier::Dram).unwrap();
    }
    assert_eq!(c.schedule(&req(99, &[], 1000, 0.0)).unwrap().prefill, 2);
    c.report_link_load(2, 0.0, 0.0, 0.0, 0.0).unwrap();
}

#[test]
fn a_prefetch_overlaps_the_queue() {
    // off: queue 50 ms + fetch 20 ms + prefill 20 ms
    let off = unit_mooncake(0.0);
    setup(&off);
    let d = off.schedule(&req(1, &A, 120, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.prefetch), (1, Some(2), false));
    assert!(close(d.est_ttft_s, 0.09) && close(d.est_transfer_s, 0.02), "{d:?}");
    // on: the 20 ms fetch runs while the request waits its 50 ms
    let on = unit_mooncake(100.0);
    setup(&on);
    let d = on.schedule(&req(1, &A, 120, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.fetch_blocks, d.prefetch), (1, Some(2), 10, true));
    assert!(close(d.est_ttft_s, 0.07) && close(d.est_transfer_s, 0.0), "{d:?}");
    assert!(close(d.fetch_abandon_s, 0.1));
    on.check_integrity().unwrap();
}

#[test]
fn a_fetch_longer_than_the_queue_adds_only_its_excess() {
    let c = unit_mooncake(1e9);
    setup(&c);
    // 2's NIC out is 1,000 bytes behind now: the prefetch takes 0.1 + 0.02 s, of which
    // the 50 ms queue hides 50 ms
    c.report_link_load(2, 0.0, 1000.0, 0.0, 0.0).unwrap();
    let d = c.schedule(&req(1, &A, 120, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.prefetch), (1, Some(2), true));
    assert!(close(d.est_transfer_s, 0.07) && close(d.est_ttft_s, 0.14), "{d:?}");
}

#[test]
fn staging_is_bounded_and_freed_when_the_request_leaves_its_queue() {
    let c = unit_mooncake(100.0);
    setup(&c);
    assert!(c.schedule(&req(1, &A, 120, 0.0)).unwrap().prefetch);
    c.check_integrity().unwrap();
    // 1's 100 staging bytes are taken: B's fetch starts at dequeue, after 98 and 1
    // (50 + 20 ms of queue), priced as without prefetch
    let d = c.schedule(&req(2, &B, 120, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.prefetch), (1, Some(2), false));
    assert!(close(d.est_queue_s, 0.07) && close(d.est_transfer_s, 0.02), "{d:?}");
    c.check_integrity().unwrap();
    // 98 starts: 1 still waits and holds its staging
    c.on_prefill_started(98, Some(0.0)).unwrap();
    assert!(!c.preview(&req(3, &C, 120, 0.0)).unwrap().prefetch);
    // 1 starts: its prefix leaves staging for the engine, and C can prefetch
    c.on_prefill_started(1, Some(0.05)).unwrap();
    c.check_integrity().unwrap();
    let d = c.schedule(&req(3, &C, 120, 0.05)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.prefetch), (1, Some(2), true));
    // a cancelled queued request frees its staging too (C is indexed on 1 since its
    // admission, so the next fetch is D's)
    assert!(!c.preview(&req(4, &D, 120, 0.05)).unwrap().prefetch);
    c.cancel(3).unwrap();
    c.check_integrity().unwrap();
    assert!(c.preview(&req(4, &D, 120, 0.05)).unwrap().prefetch);
}

#[test]
fn a_prefetch_loads_the_links_from_the_decision() {
    let on = unit_mooncake(100.0);
    let off = unit_mooncake(0.0);
    for c in [&on, &off] {
        setup(c);
        c.schedule(&req(1, &A, 120, 0.0)).unwrap();
    }
    let nic_out =
        |c: &Conductor, t: f64| c.link_loads(Some(t)).unwrap().iter().find(|l| l.instance == 2).unwrap().nic_out_bytes;
    // prefetch: 100 bytes on 2's NIC out from 0; at dequeue (50 ms): from then
    assert!(close(nic_out(&on, 0.0), 100.0));
    assert!(close(nic_out(&off, 0.0), 0.0));
    assert!(close(nic_out(&off, 0.05), 100.0));
}

#[test]
fn a_negative_or_infinite_staging_size_is_refused() {
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let cfg = ConductorConfig { prefetch_staging_bytes: bad, ..Default::default() };
        assert!(
            matches!(cfg.validate(), Err(ConductorError::InvalidConfig(m)) if m.contains("prefetch_staging_bytes"))
        );
    }
}

#[test]
fn a_tie_between_a_hidden_fetch_and_an_idle_instance_goes_to_the_idle_one() {
    // 1 has 10 ms of queue, 3 none; 2 holds A with 1 s of queue. A 100-token fetch takes
    // 20 ms: on 1 it hides the 10 ms queue (10 + 10 + 20 ms), on 3 it runs alone (20 + 20
    // ms): the same 40 ms, and the idle instance takes it although 1 comes first
    let c = unit_mooncake(1e9);
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    assert_eq!(c.schedule(&req(98, &[], 10, 0.0)).unwrap().prefill, 1);
    c.add_prefill(2, PrefillSpec::default()).unwrap();
    c.on_blocks_stored(2, &A, Tier::Dram).unwrap();
    assert_eq!(c.schedule(&req(99, &[], 1000, 0.0)).unwrap().prefill, 2);
    c.report_link_load(2, 0.0, 0.0, 0.0, 0.0).unwrap();
    c.add_prefill(3, PrefillSpec::default()).unwrap();
    let d = c.preview(&req(1, &A, 120, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.prefetch), (3, Some(2), true), "{d:?}");
    assert!(close(d.est_ttft_s, 0.04), "{d:?}");
    // the busy instance's option is the same estimate
    let snap = c.snapshot(Some(0.0)).unwrap();
    assert!(close(snap.prefill.iter().find(|p| p.id == 1).unwrap().queue_s, 0.01));
}
