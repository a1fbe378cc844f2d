//! A fetch's replica becomes visible when its bytes are there: admission does not write
//! it into the index (the instance reports it stored when the fetch lands), so no later
//! request plans a fetch from the fetching instance, or reuse on another, before then;
//! only a request routed to the fetching instance itself (it runs after the fetch)
//! counts the blocks there. Unit costs as in tests.rs (prefill 1 ms/token, network
//! 0.1 ms/token + 10 ms latency, blocks of 10 tokens), on an idle-priced network.

use super::tests::{close, req4 as req, unit_mooncake};
use super::*;
use crate::index::Tier;

const PREFIX: [u128; 10] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];

/// `PREFIX` followed by two blocks of a request's own.
fn prompt(own: u128) -> Vec<u128> {
    let mut v = PREFIX.to_vec();
    v.extend([own, own + 1]);
    v
}

/// A contention-blind `mooncake` conductor (prefetch staging `stage`): instance 2 holds
/// `PREFIX` with 1 s of queue, 1 is idle and empty.
fn setup(stage: f64) -> Conductor {
    let base = unit_mooncake(stage);
    let c = Conductor::new(ConductorConfig { contention_aware: false, ..base.config().clone() }).unwrap();
    c.add_prefill(2, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    c.on_blocks_stored(2, &PREFIX, Tier::Dram).unwrap();
    assert_eq!(c.schedule(&req(99, &[], 1000, 0.0)).unwrap().prefill, 2);
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c
}

fn holders(c: &Conductor) -> Vec<(u64, usize)> {
    c.index().match_prefix(&PREFIX).iter().map(|m| (m.instance, m.dram)).collect()
}

#[test]
fn a_fetch_in_flight_is_no_fetch_source_and_counts_only_on_its_instance() {
    let c = setup(0.0);
    let (a, b, s) = (prompt(100), prompt(200), prompt(300));
    // A on 1: fetch 100 tokens (20 ms) + prefill 30 tokens = 50 ms (2: 1 s of queue)
    let d = c.schedule(&req(1, &a, 130, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.fetch_blocks, d.reused_blocks), (1, Some(2), 10, 10));
    assert!(close(d.est_ttft_s, 0.05), "{d:?}");
    // the blocks are on their way: 1 is no holder yet
    assert_eq!(holders(&c), vec![(2, 10)]);
    // B shares A's fetched prefix, not A's whole prompt. On 1 it runs after A, so after
    // A's fetch: the prefix counts there (50 ms of queue + 30 ms), not fetched again.
    let d = c.preview(&req(2, &b, 130, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.reused_blocks), (1, None, 10), "{d:?}");
    assert!(close(d.est_ttft_s, 0.08), "{d:?}");
    // A's session's next step (A's whole prompt and more) too (its pending prefix)
    let mut next = a.clone();
    next.push(102);
    let d = c.preview(&req(3, &next, 140, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.reused_blocks), (1, None, 12), "{d:?}");
    assert!(close(d.est_ttft_s, 0.05 + 0.02), "{d:?}");
    // An idle instance is not priced as reusing or fetching from 1, which holds
    // nothing yet: it fetches B's prefix from 2, the one holder there is (20 + 30 ms).
    c.add_prefill(3, PrefillSpec::default()).unwrap();
    let d = c.schedule(&req(2, &b, 130, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.fetch_blocks), (3, Some(2), 10), "{d:?}");
    assert!(close(d.est_ttft_s, 0.05), "{d:?}");
    assert_eq!(holders(&c), vec![(2, 10)]);
    // A's fetch lands: 1 reports the blocks stored, and from then on holds them.
    c.on_blocks_stored(1, &PREFIX, Tier::Dram).unwrap();
    assert_eq!(holders(&c), vec![(1, 10), (2, 10)]);
    // 2 evicts them: 1 is the holder a fetch onto a new idle instance reads now (20 +
    // 30 ms, against 50 + 30 ms on 1).
    c.on_blocks_evicted(2, &PREFIX, None).unwrap();
    c.add_prefill(4, PrefillSpec::default()).unwrap();
    let d = c.schedule(&req(4, &s, 130, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.fetch_blocks), (4, Some(1), 10), "{d:?}");
    c.check_integrity().unwrap();
}

#[test]
fn a_fetch_that_never_lands_leaves_no_replica() {
    let c = setup(0.0);
    let a = prompt(100);
    let d = c.schedule(&req(1, &a, 130, 0.0)).unwrap();
    assert_eq!(d.fetch_from, Some(2));
    // its prefill runs and ends without the instance reporting the blocks (the fetch
    // failed and it recomputed): the index never heard of a copy on 1
    c.on_prefill_started(1, Some(0.0)).unwrap();
    c.on_prefill_finished(1, Some(0.2)).unwrap();
    assert_eq!(holders(&c), vec![(2, 10)]);
    c.check_integrity().unwrap();
}

#[test]
fn a_prefetchs_replica_waits_for_its_arrival_too() {
    // prefetch at decision time: the fetch starts now, but the blocks still take 20 ms
    let c = setup(1e9);
    let d = c.schedule(&req(1, &prompt(100), 130, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.prefetch), (1, Some(2), true), "{d:?}");
    assert_eq!(holders(&c), vec![(2, 10)]);
    c.add_prefill(3, PrefillSpec::default()).unwrap();
    let d = c.schedule(&req(2, &prompt(200), 130, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from), (3, Some(2)), "{d:?}");
    c.check_integrity().unwrap();
}

#[test]
fn no_replica_is_proposed_to_an_instance_that_is_fetching_the_prefix() {
    // every decision that reuses a prefix makes it hot; a holder with 100 ms queued is busy
    let base = unit_mooncake(0.0);
    let cfg = ConductorConfig {
        contention_aware: false,
        hot_min_hits: 1.0,
        hot_busy_fraction: 0.001,
        ..base.config().clone()
    };
    let c = Conductor::new(cfg).unwrap();
    c.add_prefill(2, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    c.on_blocks_stored(2, &PREFIX, Tier::Dram).unwrap();
    assert_eq!(c.schedule(&req(99, &[], 1000, 0.0)).unwrap().prefill, 2);
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    // A fetches PREFIX from 2 (1 s queued: busy) onto 1: hot, and on its way to 1
    let d = c.schedule(&req(1, &prompt(100), 130, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.reused_blocks), (1, Some(2), 10), "{d:?}");
    // 1, the one instance without it, gets it from A's fetch: no copy proposed there
    assert_eq!(c.replication_hints(Some(0.0)).unwrap(), vec![]);
    // an idle instance that lacks it is proposed
    c.add_prefill(3, PrefillSpec::default()).unwrap();
    let hints = c.replication_hints(Some(0.0)).unwrap();
    assert_eq!(hints.iter().map(|h| (h.from_instance, h.to_instance)).collect::<Vec<_>>(), vec![(2, 3)]);
    assert_eq!(hints[0].blocks, PREFIX.to_vec());
    // A's fetch lands: 1 holds it and is not busy (50 ms), so no holder needs relief
    c.on_blocks_stored(1, &PREFIX, Tier::Dram).unwrap();
    assert_eq!(c.replication_hints(Some(0.0)).unwrap(), vec![]);
    c.check_integrity().unwrap();
}
