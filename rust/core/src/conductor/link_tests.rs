//! The contention-aware estimate end to end: fetches priced on loaded links, holders
//! chosen by free bandwidth, instance reports, pending prefixes, the abandon bound.
//! Unit costs as in tests.rs: prefill 1 ms/token, network 10,000 B/s at 1 B/token
//! (0.1 ms/token) + 10 ms latency, blocks of 10 tokens.

use super::tests::{close, req4 as req, unit_mooncake};
use super::*;
use crate::index::Tier;

const HASHES: [u128; 10] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];

/// Two prefill instances: 2 holds the 100-token prefix and has 1 s of queue (a request
/// of its own, whose 1,000-byte KV stream it reports gone), 1 is empty and idle.
fn setup(c: &Conductor) {
    c.add_prefill(2, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    c.on_blocks_stored(2, &HASHES, Tier::Dram).unwrap();
    assert_eq!(c.schedule(&req(99, &[], 1000, 0.0)).unwrap().prefill, 2);
    // (false on a contention-blind conductor: nothing to correct)
    c.report_link_load(2, 0.0, 0.0, 0.0, 0.0).unwrap();
    c.add_prefill(1, PrefillSpec::default()).unwrap();
}

#[test]
fn idle_holder_is_fetched_from() {
    let c = unit_mooncake(0.0);
    setup(&c);
    let d = c.schedule(&req(1, &HASHES, 120, 0.0)).unwrap();
    // 1: fetch 100 tokens (10 ms + 10 ms) + prefill 20 tokens = 40 ms
    assert_eq!((d.prefill, d.fetch_blocks, d.fetch_from), (1, 10, Some(2)));
    assert!(close(d.est_ttft_s, 0.04), "{d:?}");
    // the fetch's abandon bound: recomputing the 100 fetched tokens = 100 ms
    assert!(close(d.fetch_abandon_s, 0.1));
    c.check_integrity().unwrap();
}

#[test]
fn saturated_holder_is_declined_and_the_request_computes() {
    let c = unit_mooncake(0.0);
    setup(&c);
    // 2's NIC out is 2,000 bytes behind (a KV stream in flight): a fetch from it waits 0.2 s
    assert!(c.report_link_load(2, 0.0, 2000.0, 0.0, 0.0).unwrap());
    let d = c.schedule(&req(1, &HASHES, 120, 0.0)).unwrap();
    // fetch 0.02 + 0.2 wait + 0.02 > recompute 0.12: 1 computes everything
    assert_eq!((d.prefill, d.fetch_blocks, d.fetch_from, d.reused_blocks), (1, 0, None, 0));
    assert!(close(d.est_ttft_s, 0.12), "{d:?}");
    assert!(d.fetch_abandon_s.is_infinite());
    // ... the same decision as a contention-blind conductor would not take
    let blind = Conductor::new(ConductorConfig { contention_aware: false, ..c.config().clone() }).unwrap();
    setup(&blind);
    assert_eq!(blind.schedule(&req(1, &HASHES, 120, 0.0)).unwrap().fetch_from, Some(2));
    // once the backlog has drained (0.2 s at 10,000 B/s) the holder is idle again
    let d = c.preview(&req(2, &HASHES, 120, 0.25)).unwrap();
    assert_eq!(d.fetch_from, Some(2));
}

#[test]
fn the_conductors_own_streams_load_the_holder() {
    let c = unit_mooncake(0.0);
    c.add_prefill(2, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    c.on_blocks_stored(2, &HASHES, Tier::Dram).unwrap();
    // 2 takes a 3,000-token request: its KV stream (3,000 B) leaves 2's NIC out from when
    // its compute starts (now), so a fetch from 2 now waits 0.3 s
    let d = c.schedule(&req(50, &[], 3000, 0.0)).unwrap();
    assert_eq!(d.prefill, 2);
    let loads = c.link_loads(Some(0.0)).unwrap();
    let two = loads.iter().find(|l| l.instance == 2).unwrap();
    assert!(close(two.nic_out_bytes, 3000.0), "{loads:?}");
    let ten = loads.iter().find(|l| l.instance == 10).unwrap();
    assert!(close(ten.nic_in_bytes, 3000.0));
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    let d = c.schedule(&req(51, &HASHES, 120, 0.0)).unwrap();
    // on 1: fetch = 0.02 + 0.3 wait + 0.02 > recompute 0.12; on 2: queue 3 s. 1 computes.
    assert_eq!((d.prefill, d.fetch_from), (1, None));
    // 0.3 s later the stream has left: the fetch is worth it again
    assert_eq!(c.preview(&req(52, &HASHES, 120, 0.3)).unwrap().fetch_from, Some(2));
    c.check_integrity().unwrap();
}

#[test]
fn holders_are_chosen_by_free_bandwidth() {
    let c = unit_mooncake(0.0);
    c.add_prefill(2, PrefillSpec::default()).unwrap();
    c.add_prefill(3, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    c.on_blocks_stored(2, &HASHES, Tier::Dram).unwrap();
    c.on_blocks_stored(3, &HASHES, Tier::Dram).unwrap();
    // keep 2 and 3 busy so 1 is the instance to run on
    assert_eq!(c.schedule(&req(90, &[], 1000, 0.0)).unwrap().prefill, 2);
    assert_eq!(c.schedule(&req(91, &[], 1000, 0.0)).unwrap().prefill, 3);
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c.report_link_load(2, 0.0, 500.0, 0.0, 0.0).unwrap();
    c.report_link_load(3, 0.0, 100.0, 0.0, 0.0).unwrap();
    let d = c.schedule(&req(1, &HASHES, 120, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from), (1, Some(3)));
    assert!(close(d.est_transfer_s, 0.02 + 0.01), "{d:?}");
}

#[test]
fn stale_and_out_of_order_reports() {
    let c = unit_mooncake(0.0);
    setup(&c);
    assert!(c.report_link_load(2, 5.0, 10_000.0, 0.0, 0.0).unwrap());
    assert!(!c.report_link_load(2, 4.0, 0.0, 0.0, 0.0).unwrap()); // older: ignored
                                                                  // measured at 5 s, read at 5.5 s: half drained
    let l = c.link_loads(Some(5.5)).unwrap();
    assert!(close(l.iter().find(|x| x.instance == 2).unwrap().nic_out_bytes, 5000.0));
    assert!(c.report_link_load(99, 1.0, 0.0, 0.0, 0.0).is_err());
    assert!(c.report_link_load(2, 6.0, -1.0, 0.0, 0.0).is_err());
    assert!(c.report_link_load(2, f64::NAN, 0.0, 0.0, 0.0).is_err());
    assert!(c.set_link_bandwidth(2, 0.0, 1.0).is_err());
    c.set_link_bandwidth(2, 1e9, f64::INFINITY).unwrap();
    assert!(c.link_loads(Some(6.0)).unwrap().iter().all(|x| x.nic_out_bytes < 1.0));
}

#[test]
fn a_queued_prompt_counts_as_local_for_its_next_step() {
    let c = unit_mooncake(0.0);
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c.add_prefill(2, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    // step 1 of a session (5 blocks) goes to 1 and waits there
    let step1 = &HASHES[..5];
    let d1 = c.schedule(&req(1, step1, 55, 0.0)).unwrap();
    assert_eq!(d1.prefill, 1);
    // step 2 extends it before step 1 ran: on 1 it will reuse step 1's 5 blocks
    let d2 = c.preview(&req(2, &HASHES, 105, 0.0)).unwrap();
    assert_eq!((d2.prefill, d2.reused_blocks, d2.fetch_blocks), (2, 0, 0)); // 2 idle: 0.105 < 0.055 + 0.055
    c.on_prefill_started(1, Some(0.0)).unwrap();
    let d2 = c.preview(&req(2, &HASHES, 105, 0.05)).unwrap();
    assert_eq!((d2.prefill, d2.reused_blocks, d2.fetch_blocks), (1, 5, 0));
    c.check_integrity().unwrap();
    // the entry goes with the prefill
    c.on_prefill_finished(1, Some(0.06)).unwrap();
    let d2 = c.preview(&req(2, &HASHES, 105, 0.06)).unwrap();
    assert_eq!(d2.reused_blocks, 0);
    c.check_integrity().unwrap();
}

/// Issue 25's 100 GB/s misses: the holders of the longest prefix were the busy ones and
/// Algorithm 1 looked no further. Now a slightly shorter prefix on an idle holder is
/// priced too (with the load-aware estimate), and wins when the long one waits behind
/// a backlog.
#[test]
fn a_shorter_prefix_on_an_idle_holder_beats_the_longest_on_a_saturated_one() {
    let c = unit_mooncake(0.0);
    c.add_decode(10, DecodeSpec::default()).unwrap();
    c.add_prefill(2, PrefillSpec::default()).unwrap();
    c.add_prefill(3, PrefillSpec::default()).unwrap();
    c.on_blocks_stored(2, &HASHES, Tier::Dram).unwrap();
    c.on_blocks_stored(3, &HASHES[..9], Tier::Dram).unwrap();
    // both holders busy for 1 s (a 1,000-token request each, ties to the lowest id)
    assert_eq!(c.schedule(&req(99, &[], 1000, 0.0)).unwrap().prefill, 2);
    assert_eq!(c.schedule(&req(98, &[], 1000, 0.0)).unwrap().prefill, 3);
    // their KV streams went elsewhere: both NICs idle, 1 fetches the longest prefix
    assert!(c.report_link_load(2, 0.0, 0.0, 0.0, 0.0).unwrap());
    assert!(c.report_link_load(3, 0.0, 0.0, 0.0, 0.0).unwrap());
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    let d = c.preview(&req(1, &HASHES, 120, 0.0)).unwrap();
    assert_eq!((d.prefill, d.fetch_from, d.reused_blocks), (1, Some(2), 10), "{d:?}");
    // now 2's NIC out is 2,000 bytes behind (0.2 s)
    assert!(c.report_link_load(2, 0.0, 2000.0, 0.0, 0.0).unwrap());
    let d = c.schedule(&req(1, &HASHES, 120, 0.0)).unwrap();
    // on 1: 9 blocks from 3 = 10 ms + 9 ms, then 30 tokens = 30 ms: 49 ms; the 10 from 2
    // would be 0.2 + 0.02 + 0.02 s; recomputing 120 ms. Algorithm 1 as the paper has it
    // (holders of the longest prefix only) would have computed locally.
    assert_eq!((d.prefill, d.fetch_from, d.fetch_blocks, d.reused_blocks), (1, Some(3), 9, 9), "{d:?}");
    assert!(close(d.est_ttft_s, 0.049), "{d:?}");
    c.check_integrity().unwrap();
}
