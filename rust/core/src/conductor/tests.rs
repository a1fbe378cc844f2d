//! Hand-computed cases for every policy, admission mode and event path.
//!
//! Unit costs used throughout (see `unit_costs`): prefill 1 ms per new token and
//! nothing else; transfer 0.1 ms per token over the network plus 10 ms latency; SSD
//! 0.5 ms per token; decode step 10 ms + 1 ms per sequence. Blocks of 10 tokens.

use std::sync::Arc;

use super::policy::{self, estimate_for, Candidate, Choice, PolicyInput};
use super::*;
use crate::index::{BlockIndex, PrefixMatch, Tier};

pub(super) fn unit_costs() -> CostModels {
    CostModels {
        prefill: PrefillCostModel { c0: 0.0, c_new: 0.001, c_new2: 0.0, c_cross: 0.0 },
        transfer: TransferCostModel {
            bytes_per_token: 1.0,
            network_bandwidth: 10_000.0,
            ssd_bandwidth: 2_000.0,
            latency_s: 0.01,
            dram_bandwidth: f64::INFINITY,
        },
        decode: DecodeCostModel { base_s: 0.01, per_seq_s: 0.001, per_token_s: 0.0 },
    }
}

fn cand(id: u64, queue_s: f64, dram: usize, ssd: usize) -> Candidate {
    Candidate { id, queue_s, speed: 1.0, dram, ssd, gpu: 0, stage_free_bytes: 0.0 }
}

fn pm(instance: u64, dram: usize, ssd: usize) -> PrefixMatch {
    PrefixMatch { instance, dram, ssd, gpu: 0 }
}

fn run(kind: PolicyKind, cands: &[Candidate], matches: &[PrefixMatch], threshold: f64, cost: &CostModels) -> Choice {
    let input = PolicyInput {
        prompt_len: 120,
        block_size: 10,
        cands,
        matches,
        best: crate::index::best_of(matches),
        cost,
        balancing_threshold: threshold,
        now: 0.0,
        links: None,
        prefetch: false,
    };
    let mut rng = 7;
    policy::choose(kind, &input, &mut rng).expect("candidates")
}

pub(super) fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

/// A `mooncake` conductor on the unit costs with SLOs out of the way (100 s), with
/// `prefetch_staging_bytes` of staging per instance (0: prefetch off). For the link and
/// prefetch tests.
pub(super) fn unit_mooncake(prefetch_staging_bytes: f64) -> Conductor {
    let cfg = ConductorConfig {
        block_size: 10,
        ttft_slo_s: 100.0,
        tbt_slo_s: 100.0,
        policy: PolicyKind::Mooncake,
        cost: unit_costs(),
        prefetch_staging_bytes,
        ..Default::default()
    };
    Conductor::new(cfg).unwrap()
}

/// A request expecting 4 output tokens (the link and prefetch tests' shape).
pub(super) fn req4(id: u64, hashes: &[u128], prompt_len: usize, now: f64) -> ScheduleRequest<'_> {
    ScheduleRequest { request_id: id, block_hashes: hashes, prompt_len, now, expected_output_len: Some(4) }
}

// Instance 1 is idle with no cache; instance 2 holds 10 of the 12 blocks but is busy.
#[test]
fn local_cache_aware_idle_vs_busy() {
    let c = unit_costs();
    let m = [pm(2, 10, 0)];
    // 1: 0 + 120 ms; 2: 500 ms + 20 ms -> 1 wins.
    let ch = run(PolicyKind::LocalCacheAware, &[cand(1, 0.0, 0, 0), cand(2, 0.5, 10, 0)], &m, 2.0, &c);
    assert_eq!((ch.idx, ch.reused_blocks, ch.fetch_blocks), (0, 0, 0));
    assert!(close(ch.ttft(), 0.12));
    // 2 only 50 ms busy: 50 + 20 = 70 ms < 120 ms -> 2 wins, reusing its 10 blocks.
    let ch = run(PolicyKind::LocalCacheAware, &[cand(1, 0.0, 0, 0), cand(2, 0.05, 10, 0)], &m, 2.0, &c);
    assert_eq!((ch.idx, ch.reused_blocks), (1, 10));
    assert!(close(ch.ttft(), 0.07));
}

#[test]
fn load_balance_ignores_cache() {
    let c = unit_costs();
    let m = [pm(2, 10, 0)];
    let ch =
        run(PolicyKind::LoadBalance, &[cand(1, 0.01, 0, 0), cand(2, 0.05, 10, 0), cand(3, 0.01, 0, 0)], &m, 2.0, &c);
    assert_eq!(ch.idx, 0); // least queue; tie with 3 goes to the lower id
    assert!(close(ch.ttft(), 0.01 + 0.12));
}

#[test]
fn random_covers_every_instance_and_reuses_local() {
    let c = unit_costs();
    let cands = [cand(1, 0.0, 0, 0), cand(2, 0.0, 4, 0), cand(3, 0.0, 0, 0)];
    let input = PolicyInput {
        prompt_len: 120,
        block_size: 10,
        cands: &cands,
        matches: &[pm(2, 4, 0)],
        best: Some(pm(2, 4, 0)),
        cost: &c,
        balancing_threshold: 2.0,
        now: 0.0,
        links: None,
        prefetch: false,
    };
    let mut rng = 1;
    let mut seen = [0; 3];
    for _ in 0..300 {
        let ch = policy::choose(PolicyKind::Random, &input, &mut rng).unwrap();
        seen[ch.idx] += 1;
        assert_eq!(ch.reused_blocks, cands[ch.idx].local());
        assert_eq!(ch.fetch_blocks, 0);
    }
    assert!(seen.iter().all(|&n| n > 60), "{seen:?}");
}

#[test]
fn mooncake_fetch_worth_it_and_not() {
    let mut c = unit_costs();
    let cands = [cand(1, 0.0, 0, 0), cand(2, 0.5, 10, 0)];
    let m = [pm(2, 10, 0)];
    // 1: fetch 100 tokens = 10 + 10 ms, prefill 20 tokens = 20 ms -> 40 ms < 120 ms recompute.
    let ch = run(PolicyKind::Mooncake, &cands, &m, 2.0, &c);
    assert_eq!((ch.idx, ch.reused_blocks, ch.fetch_blocks, ch.fetch_from), (0, 10, 10, Some(2)));
    assert!(close(ch.transfer_s, 0.02) && close(ch.prefill_s, 0.02) && close(ch.ttft(), 0.04));
    // Slow network (500 tok/s): fetch = 10 + 200 ms + 20 ms = 230 ms > 120 ms: recompute on 1.
    c.transfer.network_bandwidth = 500.0;
    c.transfer.ssd_bandwidth = 500.0;
    let ch = run(PolicyKind::Mooncake, &cands, &m, 2.0, &c);
    assert_eq!((ch.idx, ch.reused_blocks, ch.fetch_blocks, ch.fetch_from), (0, 0, 0, None));
    assert!(close(ch.ttft(), 0.12));
}

#[test]
fn mooncake_balancing_threshold() {
    let c = unit_costs();
    let cands = [cand(1, 0.0, 6, 0), cand(2, 0.5, 10, 0)];
    let m = [pm(1, 6, 0), pm(2, 10, 0)];
    // 10 / 6 = 1.67 <= 2: instance 1 uses its own 6 blocks: 60 ms.
    let ch = run(PolicyKind::Mooncake, &cands, &m, 2.0, &c);
    assert_eq!((ch.idx, ch.reused_blocks, ch.fetch_blocks), (0, 6, 0));
    assert!(close(ch.ttft(), 0.06));
    // Threshold 1.5: fetch 4 blocks (10 + 4 ms) and prefill 20 tokens: 34 ms.
    let ch = run(PolicyKind::Mooncake, &cands, &m, 1.5, &c);
    assert_eq!((ch.idx, ch.reused_blocks, ch.fetch_blocks, ch.fetch_from), (0, 10, 4, Some(2)));
    assert!(close(ch.ttft(), 0.034));
}

#[test]
fn ttft_optimal_prices_ssd() {
    let c = unit_costs();
    // 1 holds 10 blocks on SSD: load 100 tokens at 2000/s = 50 ms + prefill 20 ms = 70 ms
    // (recompute: 120 ms). Mooncake counts the SSD blocks as free: 20 ms.
    let cands = [cand(1, 0.0, 0, 10), cand(2, 1.0, 10, 0)];
    let m = [pm(1, 0, 10), pm(2, 10, 0)];
    let ch = run(PolicyKind::TtftOptimal, &cands, &m, 2.0, &c);
    assert_eq!((ch.idx, ch.reused_blocks, ch.fetch_blocks), (0, 10, 0));
    assert!(close(ch.ttft(), 0.07));
    assert!(close(run(PolicyKind::Mooncake, &cands, &m, 2.0, &c).ttft(), 0.02));
    // Holder 5 (not a prefill instance) keeps 10 blocks on SSD: a fetch runs at SSD speed:
    // 10 + 50 ms + prefill 20 ms = 80 ms < 120 ms. Mooncake prices it at 40 ms.
    let cands = [cand(1, 0.0, 0, 0)];
    let m = [pm(5, 0, 10)];
    let ch = run(PolicyKind::TtftOptimal, &cands, &m, 2.0, &c);
    assert_eq!((ch.fetch_blocks, ch.fetch_from), (10, Some(5)));
    assert!(close(ch.ttft(), 0.08));
    assert!(close(run(PolicyKind::Mooncake, &cands, &m, 2.0, &c).ttft(), 0.04));
    // It fetches from the cheaper of two holders: 6 DRAM blocks vs 10 SSD blocks.
    // DRAM: 10 + 6 ms + 60 ms = 76 ms; SSD: 80 ms -> the DRAM holder.
    let m = [pm(5, 0, 10), pm(6, 6, 0)];
    let ch = run(PolicyKind::TtftOptimal, &cands, &m, 2.0, &c);
    assert_eq!((ch.fetch_blocks, ch.fetch_from), (6, Some(6)));
    assert!(close(ch.ttft(), 0.076));
    // Its estimate for every instance is never above Mooncake's option on that instance
    // once SSD is as fast as the network.
    let _ = estimate_for;
}

fn conductor(policy: PolicyKind, rejection: RejectionKind) -> Conductor {
    Conductor::new(ConductorConfig { policy, ..conductor_cfg(rejection) }).unwrap()
}

fn conductor_cfg(rejection: RejectionKind) -> ConductorConfig {
    ConductorConfig {
        block_size: 10,
        ttft_slo_s: 1.0,
        tbt_slo_s: 0.05,
        policy: PolicyKind::LoadBalance,
        rejection,
        cost: unit_costs(),
        ..Default::default()
    }
}

fn req(id: u64, hashes: &[u128], prompt_len: usize, now: f64, out: Option<usize>) -> ScheduleRequest<'_> {
    ScheduleRequest { request_id: id, block_hashes: hashes, prompt_len, now, expected_output_len: out }
}

const HASHES: [u128; 10] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];

#[test]
fn schedule_fetches_and_the_replica_counts_once_stored() {
    // On an idle-priced network (the contention-aware case is in link_tests.rs).
    let cfg =
        ConductorConfig { policy: PolicyKind::Mooncake, contention_aware: false, ..conductor_cfg(RejectionKind::None) };
    let c = Conductor::new(cfg).unwrap();
    c.add_prefill(2, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    c.on_blocks_stored(2, &HASHES, Tier::Dram).unwrap();
    // Busy 2 with a 1000-token request (1 s of queue) before 1 joins.
    assert_eq!(c.schedule(&req(99, &[], 1000, 0.0, Some(10))).unwrap().prefill, 2);
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    // 1: fetch 100 tokens (20 ms) + prefill 20 tokens (20 ms) = 40 ms; 2: 1 s + 20 ms.
    let d = c.schedule(&req(1, &HASHES, 120, 0.0, Some(10))).unwrap();
    assert_eq!((d.prefill, d.reused_blocks, d.fetch_blocks, d.fetch_from), (1, 10, 10, Some(2)));
    assert!(close(d.est_ttft_s, 0.04) && close(d.est_transfer_s, 0.02));
    // The fetched blocks are not on 1 yet: the index learns them when 1 reports them.
    let held = |c: &Conductor| c.index().match_prefix(&HASHES).iter().map(|m| (m.instance, m.dram)).collect::<Vec<_>>();
    assert_eq!(held(&c), vec![(2, 10)]);
    // The next request with that prompt runs after it on 1 (its pending prefix) and
    // fetches nothing.
    let d = c.schedule(&req(2, &HASHES, 120, 0.0, Some(10))).unwrap();
    assert_eq!((d.prefill, d.fetch_blocks, d.fetch_from), (1, 0, None));
    assert!(close(d.est_ttft_s, 0.04 + 0.02));
    c.on_blocks_stored(1, &HASHES, Tier::Dram).unwrap();
    assert_eq!(held(&c), vec![(1, 10), (2, 10)]);
    c.check_integrity().unwrap();
}

#[test]
fn queue_follows_progress_events() {
    let c = conductor(PolicyKind::LoadBalance, RejectionKind::None);
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    let d = c.schedule(&req(1, &[], 500, 0.0, Some(4))).unwrap();
    assert!(close(d.est_prefill_s, 0.5) && close(d.est_tbt_s, 0.011));
    let d2 = c.schedule(&req(2, &[], 300, 0.0, Some(4))).unwrap();
    assert!(close(d2.est_queue_s, 0.5) && close(d2.est_tbt_s, 0.012));
    c.on_prefill_started(1, Some(0.1)).unwrap();
    let s = c.snapshot(Some(0.3)).unwrap();
    assert!(close(s.prefill[0].queue_s, 0.3 + 0.3)); // 0.3 left of request 1, 0.3 queued
    assert_eq!((s.prefill[0].queued, s.prefill[0].running, s.decode[0].batch), (1, 1, 2));
    c.on_prefill_finished(1, Some(0.6)).unwrap();
    c.on_decode_started(1, Some(0.6)).unwrap();
    c.on_decode_finished(1, 7, Some(1.0)).unwrap();
    let s = c.snapshot(None).unwrap();
    assert_eq!((s.now, s.prefill[0].queued, s.decode[0].batch, s.requests), (1.0, 1, 1, 1));
    // Events out of order or for unknown requests change nothing.
    assert!(matches!(c.on_decode_finished(1, 7, None), Err(ConductorError::UnknownRequest(1))));
    c.on_decode_started(2, None).unwrap(); // implies prefill done
    assert!(matches!(c.on_prefill_started(2, None), Err(ConductorError::InvalidArgument(_))));
    assert!(c.on_prefill_finished(2, Some(f64::NAN)).is_err());
    c.check_integrity().unwrap();
    assert_eq!(c.snapshot(None).unwrap().prefill[0].queued, 0);
}

fn overloaded(r: Result<Decision, ConductorError>) -> (RejectReason, Option<Box<Decision>>) {
    match r {
        Err(ConductorError::Overloaded { reason, estimates, .. }) => (reason, estimates),
        other => panic!("expected Overloaded, got {other:?}"),
    }
}

#[test]
fn no_instances_is_overloaded() {
    let c = conductor(PolicyKind::Mooncake, RejectionKind::None);
    assert_eq!(overloaded(c.schedule(&req(1, &[], 10, 0.0, None))).0, RejectReason::NoPrefillInstance);
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    assert_eq!(overloaded(c.schedule(&req(1, &[], 10, 0.0, None))).0, RejectReason::NoDecodeInstance);
}

#[test]
fn early_rejection_and_rollback() {
    let c = conductor(PolicyKind::Mooncake, RejectionKind::Early);
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec { max_batch: 100, kv_capacity_tokens: 100_000 }).unwrap();
    c.on_blocks_stored(1, &HASHES[..2], Tier::Dram).unwrap();
    // TTFT: 1001 tokens -> 1.001 s > 1 s.
    let before = c.snapshot(None).unwrap();
    let (why, est) = overloaded(c.schedule(&req(1, &[], 1001, 5.0, None)));
    assert_eq!(why, RejectReason::TtftSlo);
    assert!(close(est.unwrap().est_ttft_s, 1.001));
    assert_eq!(c.snapshot(None).unwrap(), before);
    // TBT: 10 ms + 1 ms per sequence <= 50 ms -> at most 40 in the batch.
    for i in 0..40 {
        c.schedule(&req(i, &[], 1, 0.0, Some(10))).unwrap();
        c.on_prefill_finished(i, None).unwrap();
    }
    let before = c.snapshot(None).unwrap();
    let (why, est) = overloaded(c.schedule(&req(40, &HASHES[..2], 20, 0.0, Some(10))));
    assert_eq!(why, RejectReason::TbtSlo);
    assert!(close(est.unwrap().est_tbt_s, 0.051));
    assert_eq!(c.snapshot(None).unwrap(), before);
    assert!(c.index().match_prefix(&HASHES[..2]).len() == 1);
    // Same load under "none" is admitted.
    c.check_integrity().unwrap();
}

#[test]
fn predictive_sees_the_batch_drain() {
    for (kind, admitted) in [(RejectionKind::Early, false), (RejectionKind::Predictive, true)] {
        let c = conductor(PolicyKind::Mooncake, kind);
        c.add_prefill(1, PrefillSpec::default()).unwrap();
        c.add_decode(10, DecodeSpec::default()).unwrap();
        // 40 requests decoding 5 tokens each at <= 50 ms: all gone within 0.25 s.
        for i in 0..40 {
            c.schedule(&req(i, &[], 1, 0.0, Some(5))).unwrap();
            c.on_decode_started(i, Some(0.0)).unwrap();
        }
        // A 500-token prompt reaches decode at 0.5 s, when the batch is empty.
        let r = c.schedule(&req(100, &[], 500, 0.0, Some(5)));
        assert_eq!(r.is_ok(), admitted, "{kind:?}: {r:?}");
        if let Ok(d) = r {
            assert!(close(d.est_tbt_s, 0.011));
        }
        c.check_integrity().unwrap();
    }
}

#[test]
fn output_length_history_per_prefix() {
    let c = conductor(PolicyKind::LoadBalance, RejectionKind::None);
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    assert_eq!(c.predicted_output_len(Some(1)), 256.0);
    for i in 0..30 {
        c.schedule(&req(i, &HASHES[..1], 20, 0.0, None)).unwrap();
        c.on_decode_finished(i, 1000, None).unwrap();
    }
    c.schedule(&req(50, &[77], 20, 0.0, None)).unwrap();
    c.on_decode_finished(50, 10, None).unwrap();
    assert!((c.predicted_output_len(Some(1)) - 1000.0).abs() < 1.0);
    assert_eq!(c.predicted_output_len(Some(77)), 10.0);
    let g = c.predicted_output_len(Some(12345)); // unseen prefix: the global average
    assert!(g > 10.0 && g < 1000.0);
}

#[test]
fn replication_hint_for_hot_prefix_on_busy_instance() {
    let cfg = ConductorConfig {
        block_size: 10,
        ttft_slo_s: 1.0,
        policy: PolicyKind::LocalCacheAware,
        cost: unit_costs(),
        hot_busy_fraction: 0.05, // busy: more than 50 ms queued
        ..Default::default()
    };
    let c = Conductor::new(cfg).unwrap();
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c.add_prefill(2, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    c.on_blocks_stored(1, &HASHES, Tier::Dram).unwrap();
    // Each request costs 20 ms on 1 (prefix held) and 120 ms on 2: the first five all go
    // to 1, leaving 100 ms queued there.
    for i in 0..5 {
        let d = c.schedule(&req(i, &HASHES, 120, 0.0, Some(1))).unwrap();
        assert_eq!(d.prefill, 1, "request {i}: {d:?}");
    }
    let hints = c.replication_hints(Some(0.0)).unwrap();
    assert_eq!(hints.len(), 1);
    let h = &hints[0];
    assert_eq!((h.from_instance, h.to_instance, h.blocks.as_slice()), (1, 2, &HASHES[..]));
    assert!(close(h.hits, 5.0) && close(h.from_queue_s, 0.1) && close(h.to_queue_s, 0.0));
    // Once the replica exists there is nothing left to propose.
    c.on_blocks_stored(2, &HASHES, Tier::Dram).unwrap();
    assert!(c.replication_hints(Some(0.0)).unwrap().is_empty());
}

#[test]
fn bad_input_changes_nothing() {
    let mut cfg = ConductorConfig { ttft_slo_s: f64::NAN, ..Default::default() };
    assert!(matches!(Conductor::new(cfg.clone()), Err(ConductorError::InvalidConfig(_))));
    cfg.ttft_slo_s = 1.0;
    cfg.cost.prefill.c_new = -1.0;
    assert!(Conductor::new(cfg.clone()).is_err());
    cfg.cost.prefill.c_new = 0.0;
    cfg.balancing_threshold = 0.5;
    assert!(Conductor::new(cfg).is_err());
    let c = conductor(PolicyKind::Mooncake, RejectionKind::None);
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c.add_decode(2, DecodeSpec::default()).unwrap();
    assert!(matches!(c.add_decode(1, DecodeSpec::default()), Err(ConductorError::DuplicateInstance(1))));
    assert!(c.add_prefill(3, PrefillSpec { speed: -1.0 }).is_err());
    assert!(c.add_decode(3, DecodeSpec { max_batch: 0, kv_capacity_tokens: 1 }).is_err());
    assert!(matches!(c.remove_instance(9), Err(ConductorError::UnknownInstance(9))));
    assert!(matches!(c.on_blocks_stored(9, &HASHES, Tier::Dram), Err(ConductorError::UnknownInstance(9))));
    assert!(c.on_blocks_evicted(9, &HASHES, None).is_err());
    assert!(c.schedule(&req(1, &HASHES, 99, 0.0, None)).is_err()); // 10 blocks need 100 tokens
    assert!(c.schedule(&req(1, &[], 0, 0.0, None)).is_err());
    assert!(c.schedule(&req(1, &[], 5, f64::INFINITY, None)).is_err());
    c.schedule(&req(1, &[], 5, 0.0, None)).unwrap();
    assert!(matches!(c.schedule(&req(1, &[], 5, 0.0, None)), Err(ConductorError::DuplicateRequest(1))));
    assert_eq!(c.snapshot(None).unwrap().requests, 1);
    assert_eq!(c.remove_instance(1).unwrap(), vec![1]);
    assert_eq!(c.snapshot(None).unwrap().requests, 0);
    c.check_integrity().unwrap();
}

#[test]
fn shared_index_and_threads() {
    let index = Arc::new(BlockIndex::new());
    let c = Arc::new(
        Conductor::with_index(ConductorConfig { block_size: 10, ..Default::default() }, index.clone()).unwrap(),
    );
    for i in 0..4 {
        c.add_prefill(i, PrefillSpec::default()).unwrap();
        c.add_decode(100 + i, DecodeSpec::default()).unwrap();
    }
    index.insert(2, &HASHES, Tier::Dram).unwrap();
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                for i in 0..200u64 {
                    let rid = t * 1000 + i;
                    c.schedule(&req(rid, &HASHES[..(i % 10) as usize], 200, i as f64 * 0.01, Some(8))).unwrap();
                    if i % 2 == 0 {
                        c.on_decode_finished(rid, 8, None).unwrap();
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(c.snapshot(None).unwrap().requests, 400);
    c.check_integrity().unwrap();
}

#[test]
fn cost_fits_recover_the_models() {
    let truth = PrefillCostModel { c0: 0.004, c_new: 3e-5, c_new2: 2e-10, c_cross: 6e-10 };
    let samples: Vec<_> =
        [(512, 0), (1024, 0), (4096, 0), (8192, 0), (8192, 4096), (16384, 8192), (2048, 1024), (32768, 0)]
            .iter()
            .map(|&(n, p)| (n, p, truth.predict(n, p)))
            .collect();
    let fit = PrefillCostModel::fit(&samples).unwrap();
    for &(n, p, t) in &samples {
        assert!((fit.predict(n, p) - t).abs() < 1e-6 * t.max(1e-3), "{fit:?}");
    }
    assert!(PrefillCostModel::fit(&samples[..2]).is_err());
    assert!(PrefillCostModel::fit(&[(1, 0, f64::NAN)]).is_err());
    let d = DecodeCostModel { base_s: 0.01, per_seq_s: 1e-4, per_token_s: 2e-8 };
    let ds: Vec<_> = [(1, 1000.0), (8, 8000.0), (64, 1e5), (128, 5e5), (32, 1e6)]
        .iter()
        .map(|&(b, c)| (b, c, d.predict(b, c)))
        .collect();
    let f = DecodeCostModel::fit(&ds).unwrap();
    assert!(
        (f.base_s - 0.01).abs() < 1e-9 && (f.per_seq_s - 1e-4).abs() < 1e-10 && (f.per_token_s - 2e-8).abs() < 1e-13
    );
    let t = TransferCostModel::default();
    let ts: Vec<_> = [1e6, 1e7, 1e9].iter().map(|&b| (b, 0.002 + b / 25e9)).collect();
    let ft = t.fit(&ts).unwrap();
    assert!((ft.latency_s - 0.002).abs() < 1e-9 && (ft.network_bandwidth / 25e9 - 1.0).abs() < 1e-6);
    // A negative fitted term is dropped: data with t = 0.5 - tiny slope stays >= 0.
    let neg = PrefillCostModel::fit(&[(100, 0, 0.5), (200, 0, 0.49), (300, 0, 0.48), (400, 0, 0.47)]).unwrap();
    assert!(neg.c_new >= 0.0 && neg.c_new2 >= 0.0 && neg.c0 > 0.0);
}

// Issue 17 item 7: one impossible output length used to drive the estimate to 1.8e19 and
// make early/predictive admission reject every later request.
#[test]
fn an_impossible_output_length_cannot_poison_admission() {
    let cfg = ConductorConfig { max_output_len: 4096, ..conductor_cfg(RejectionKind::Early) };
    let c = Conductor::new(cfg).unwrap();
    c.add_prefill(1, PrefillSpec::default()).unwrap();
    c.add_decode(10, DecodeSpec::default()).unwrap();
    c.schedule(&req(1, &HASHES[..1], 20, 0.0, None)).unwrap();
    let err = c.on_decode_finished(1, usize::MAX, None).unwrap_err();
    assert!(matches!(&err, ConductorError::InvalidArgument(m) if m.contains("max_output_len")), "{err:?}");
    // The request is still registered, so a correct report (or a cancel) goes through.
    c.on_decode_finished(1, 8, None).unwrap();
    for i in 2..52 {
        c.schedule(&req(i, &HASHES[..1], 20, 0.0, None)).unwrap();
        c.cancel(i).unwrap();
    }
    assert!(c.predicted_output_len(Some(1)) <= 4096.0);
    // A caller's own expectation is bounded the same way.
    assert!(matches!(c.schedule(&req(99, &[], 20, 0.0, Some(4097))), Err(ConductorError::InvalidArgument(_))));
    // An estimator fed the bound itself never predicts past it, per family or globally.
    let mut e = OutputLenEstimator::new(256, 1.0, 4, 100);
    e.record(Some(7), usize::MAX);
    assert_eq!((e.predict(Some(7)), e.predict(None)), (100.0, 100.0));
    c.check_integrity().unwrap();
}

#[test]
fn config_refuses_unbounded_output_lengths() {
    let bad = ConductorConfig { max_output_len: 0, ..Default::default() };
    assert!(Conductor::new(bad).is_err());
    let bad = ConductorConfig { max_output_len: 10, default_output_len: 11, ..Default::default() };
    assert!(Conductor::new(bad).is_err());
}

#[test]
fn fits_without_information_are_refused() {
    assert!(matches!(PrefillCostModel::fit(&[]), Err(FitError::TooFewSamples { got: 0, .. })));
    assert!(matches!(DecodeCostModel::fit(&[]), Err(FitError::TooFewSamples { got: 0, .. })));
    assert!(TransferCostModel::default().fit(&[]).is_err());
    // Every sample 0 s: the fit would price every request at 0 s.
    let zeros = [(100, 0, 0.0), (200, 0, 0.0), (300, 50, 0.0), (400, 100, 0.0), (500, 0, 0.0)];
    assert!(matches!(PrefillCostModel::fit(&zeros), Err(FitError::Degenerate)));
}

// Tiers priced by their load cost: the same 10 blocks on the GPU cost nothing, in DRAM
// the device copy (when `dram_bandwidth` is finite), on SSD the read.
#[test]
fn ttft_optimal_prices_each_tier() {
    let mut c = unit_costs();
    c.transfer.dram_bandwidth = 4_000.0; // 100 tokens: 25 ms from DRAM, 50 ms from SSD
    let gpu = Candidate { gpu: 10, ..cand(1, 0.0, 0, 0) };
    let dram = cand(2, 0.0, 10, 0);
    let ssd = cand(3, 0.0, 0, 10);
    let m = [PrefixMatch { instance: 1, dram: 0, ssd: 0, gpu: 10 }, pm(2, 10, 0), pm(3, 0, 10)];
    let est = |cands: &[Candidate]| {
        let ch = run(PolicyKind::TtftOptimal, cands, &m, 2.0, &c);
        (cands[ch.idx].id, ch.transfer_s)
    };
    let (id, t) = est(&[dram, ssd]);
    assert_eq!(id, 2);
    assert!(close(t, 0.025), "{t}");
    let (id, t) = est(&[gpu, dram, ssd]);
    assert_eq!(id, 1);
    assert!(close(t, 0.0), "{t}");
    let (_, t) = est(&[ssd]);
    assert!(close(t, 0.05), "{t}");
    // the default (infinite DRAM bandwidth): DRAM hits are free, as before the gpu tier
    c.transfer.dram_bandwidth = f64::INFINITY;
    let ch = run(PolicyKind::TtftOptimal, &[dram], &m, 2.0, &c);
    assert!(close(ch.transfer_s, 0.0));
    assert!(c.transfer.validate().is_ok());
    c.transfer.dram_bandwidth = 0.0;
    assert!(c.transfer.validate().is_err());
}
