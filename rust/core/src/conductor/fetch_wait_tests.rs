//! A request waiting for its peer fetch does not hold its prefill instance (the serving
//! `Cluster` computes other requests while a fetch is in flight, and so does the
//! simulator): what it adds to its instance's queue is its compute and its loads from
//! the instance's own tiers, not the fetch, which is its own wait. Unit costs as in
//! tests.rs: prefill 1 ms/token, network 10,000 B/s at 1 B/token + 10 ms latency, SSD
//! 2,000 B/s, blocks of 10.

use super::tests::{close, req4 as req, unit_mooncake};
use super::*;
use crate::index::Tier;

const A: [u128; 10] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];

fn queue_of(c: &Conductor, id: u64, now: f64) -> f64 {
    c.snapshot(Some(now)).unwrap().prefill.iter().find(|p| p.id == id).unwrap().queue_s
}

/// Instance 1 is idle and empty; instance 2 holds A with a 1 s queue, its links
/// reported idle.
fn setup(c: &Conductor) {
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c.add_prefill(2, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    c.on_blocks_stored(2, &A, Tier::Dram).unwrap();
    c.on_blocks_stored(2, &[50], Tier::Dram).unwrap(); // 99 goes to 2
    assert_eq!(c.schedule(&req(99, &[50], 1000, 0.0)).unwrap().prefill, 2);
    c.report_link_load(2, 0.0, 0.0, 0.0, 0.0).unwrap();
}

#[test]
fn a_later_request_waits_for_the_computes_ahead_not_for_a_fetch() {
    for staging in [0.0, 1e9] {
        // prefetch off: the fetch starts at dequeue; on: at the decision. Either way
        // request 1 fetches A (100 tokens: 20 ms) onto 1 and computes 20 tokens (20 ms)
        let c = unit_mooncake(staging);
        setup(&c);
        let d = c.schedule(&req(1, &A, 120, 0.0)).unwrap();
        assert_eq!((d.prefill, d.fetch_from, d.fetch_blocks), (1, Some(2), 10), "{d:?}");
        assert!(close(d.est_ttft_s, 0.04) && close(d.est_transfer_s, 0.02), "{d:?}");
        // 1's queue is 1's compute (20 ms), not its fetch and compute (40 ms)
        assert!(close(queue_of(&c, 1, 0.0), 0.02), "staging {staging}: {}", queue_of(&c, 1, 0.0));
        // a 50-token request with nothing cached: 20 ms of queue on 1, 50 ms of compute
        let d2 = c.schedule(&req(2, &[], 50, 0.0)).unwrap();
        assert_eq!(d2.prefill, 1);
        assert!(close(d2.est_queue_s, 0.02) && close(d2.est_ttft_s, 0.07), "{d2:?}");
        // request 1 starts computing once its fetch is in (20 ms): 10 ms of it are left at
        // 30 ms, and request 2's 50 ms are queued
        c.on_prefill_started(1, Some(0.02)).unwrap();
        assert!(close(queue_of(&c, 1, 0.03), 0.01 + 0.05));
        c.check_integrity().unwrap();
    }
}

#[test]
fn loads_from_the_instances_own_ssd_hold_it() {
    // ttft_optimal prices an SSD hit: 1 holds A on SSD (100 tokens: 50 ms to read at
    // 2,000 B/s), then 20 ms of compute: both are 1's time (its store reads the blocks
    // on its own loop), so both are in its queue
    let cfg = ConductorConfig { policy: PolicyKind::TtftOptimal, ..unit_mooncake(0.0).config().clone() };
    let c = Conductor::new(cfg).unwrap();
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    c.on_blocks_stored(1, &A, Tier::Ssd).unwrap();
    let d = c.schedule(&req(1, &A, 120, 0.0)).unwrap();
    assert_eq!((d.prefill, d.reused_blocks, d.fetch_from), (1, 10, None), "{d:?}");
    assert!(close(d.est_transfer_s, 0.05) && close(d.est_prefill_s, 0.02), "{d:?}");
    assert!(close(queue_of(&c, 1, 0.0), 0.07));
    // a fetch it makes from a peer's DRAM is not: 2 holds B in DRAM, 1 has B's first
    // block on SSD (5 ms), and fetching the other 9 (90 tokens: 19 ms) beats recomputing
    // them (90 ms); 1's queue grows by its own load and its compute only
    const B: [u128; 10] = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20];
    c.add_prefill(2, PrefillSpec::default()).unwrap();
    c.on_blocks_stored(2, &B, Tier::Dram).unwrap();
    c.on_blocks_stored(1, &B[..1], Tier::Ssd).unwrap();
    c.on_blocks_stored(2, &[50], Tier::Dram).unwrap(); // 98 goes to 2: it is busy then
    assert_eq!(c.schedule(&req(98, &[50], 1000, 0.0)).unwrap().prefill, 2);
    c.report_link_load(2, 0.0, 0.0, 0.0, 0.0).unwrap();
    let d = c.schedule(&req(2, &B, 120, 0.0)).unwrap();
    assert_eq!((d.prefill, d.reused_blocks, d.fetch_blocks, d.fetch_from), (1, 10, 9, Some(2)), "{d:?}");
    assert!(close(d.est_transfer_s, 0.005 + 0.019) && close(d.est_prefill_s, 0.02), "{d:?}");
    assert!(close(queue_of(&c, 1, 0.0), 0.07 + 0.005 + 0.02), "{}", queue_of(&c, 1, 0.0));
    c.check_integrity().unwrap();
}

#[test]
fn the_calibration_compares_an_instances_time_with_the_compute_it_was_priced() {
    // the serving cluster reports an instance's time on a request from when its engine
    // took it (after its fetch, prefill.py); priced at its compute alone, a request
    // served exactly as priced leaves the service scale at 1 (priced at its fetch too,
    // it read as an instance twice as fast as the model)
    let c = unit_mooncake(0.0);
    c.set_online_calibration(true);
    setup(&c);
    let d = c.schedule(&req(1, &A, 120, 0.0)).unwrap();
    assert_eq!(d.fetch_from, Some(2));
    c.on_prefill_started(1, Some(0.0)).unwrap();
    c.on_prefill_served(1, 0.02).unwrap();
    let (scale, _) = c.calibration_scales(0.04);
    assert!(close(scale, 1.0), "{scale}");
}

#[test]
fn a_request_building_on_a_fetching_one_waits_for_its_prefill_end() {
    // request 1 fetches A onto 1 (20 ms) and computes 20 ms: its compute alone is 1's
    // queue, but the next step of its session (A and one more block) reuses A on 1 only
    // once 1 has it: its queue there is the 40 ms until request 1's predicted end
    let c = unit_mooncake(0.0);
    setup(&c);
    let d = c.schedule(&req(1, &A, 120, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from), (1, Some(2)));
    let mut next = A.to_vec();
    next.push(11);
    let d = c.preview(&req(2, &next, 130, 0.0)).unwrap();
    assert_eq!((d.prefill, d.reused_blocks, d.fetch_from), (1, 10, None), "{d:?}");
    assert!(close(d.est_queue_s, 0.04) && close(d.est_ttft_s, 0.07), "{d:?}");
    // a request that does not build on it waits for its compute only
    assert!(close(c.preview(&req(3, &[], 50, 0.0)).unwrap().est_queue_s, 0.02));
    // once request 1 computes (its fetch is in), what is left of its compute is the queue
    c.on_prefill_started(1, Some(0.02)).unwrap();
    let d = c.preview(&req(2, &next, 130, 0.03)).unwrap();
    assert_eq!((d.prefill, d.reused_blocks), (1, 10), "{d:?}");
    assert!(close(d.est_queue_s, 0.01), "{d:?}");
}
