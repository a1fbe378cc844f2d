//! Property tests: policy optimality, rejection iff an estimate exceeds its SLO, and
//! random event sequences that must keep every invariant (and never panic).

use proptest::prelude::*;

use super::policy::{self, estimate_for, Candidate, PolicyInput};
use super::*;
use crate::index::{best_of, PrefixMatch, Tier};

fn costs() -> impl Strategy<Value = CostModels> {
    (1e-6..1e-3f64, 0.0..1e-8f64, 0.0..1e-8f64, 1e3..1e6f64, 1e3..1e6f64, 0.0..0.05f64).prop_map(
        |(c_new, c_new2, c_cross, net, ssd, lat)| CostModels {
            prefill: PrefillCostModel { c0: 0.001, c_new, c_new2, c_cross },
            transfer: TransferCostModel {
                bytes_per_token: 1.0,
                network_bandwidth: net,
                ssd_bandwidth: ssd,
                latency_s: lat,
                dram_bandwidth: f64::INFINITY,
            },
            decode: DecodeCostModel::default(),
        },
    )
}

/// Whether any candidate of the drawn ones has staging room (prefetch on).
fn cands_can_prefetch(locals: &[(f64, usize, usize, f64, f64)]) -> bool {
    locals.iter().any(|l| l.4 > 0.0)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Under "mooncake" (and the other minimising policies) the chosen instance's
    /// estimated TTFT — queue + transfer + prefill of the option the policy takes there
    /// (`estimate_for`) — is no higher than any other instance's.
    #[test]
    fn chosen_instance_has_the_lowest_estimated_ttft(
        locals in prop::collection::vec((0.0..2.0f64, 0usize..12, 0usize..12, 0.5..2.0f64, prop::sample::select(vec![0.0, 60.0, 1e9])), 1..8),
        extra in prop::collection::vec((0usize..12, 0usize..12), 0..3),
        threshold in 1.0..4.0f64,
        tail in 1usize..50,
        cost in costs(),
    ) {
        let bs = 10;
        // staging room per candidate: none (prefetch off), some fetches fit (60 bytes: 6
        // blocks at 1 byte a token), every fetch fits
        let prefetch = cands_can_prefetch(&locals);
        let cands: Vec<Candidate> = locals.iter().enumerate()
            .map(|(i, &(q, d, s, speed, stage))| Candidate { id: i as u64, queue_s: q, speed, dram: d, ssd: s, gpu: 0, stage_free_bytes: stage })
            .collect();
        let mut matches: Vec<PrefixMatch> = cands.iter().filter(|c| c.local() > 0)
            .map(|c| PrefixMatch { instance: c.id, dram: c.dram, ssd: c.ssd, gpu: c.gpu }).collect();
        matches.extend(extra.iter().enumerate().filter(|(_, &(d, s))| d + s > 0)
            .map(|(i, &(d, s))| PrefixMatch { instance: 100 + i as u64, dram: d, ssd: s, gpu: 0 }));
        let n_blocks = matches.iter().map(|m| m.total()).max().unwrap_or(0);
        let input = PolicyInput {
            prompt_len: n_blocks * bs + tail, block_size: bs, cands: &cands, matches: &matches,
            best: best_of(&matches), cost: &cost, balancing_threshold: threshold, now: 0.0, links: None,
            prefetch,
        };
        for kind in [PolicyKind::Mooncake, PolicyKind::TtftOptimal, PolicyKind::LocalCacheAware] {
            let mut rng = 0;
            let chosen = policy::choose(kind, &input, &mut rng).unwrap();
            prop_assert_eq!(chosen, estimate_for(kind, &input, chosen.idx));
            for i in 0..cands.len() {
                let other = estimate_for(kind, &input, i);
                // with prefetch, estimates equal up to rounding are ties (the shorter queue wins)
                let slack = if prefetch { 1e-9 * other.ttft() + 1e-12 } else { 0.0 };
                prop_assert!(chosen.ttft() <= other.ttft() + slack, "{:?}: {} chose {:?} over {:?}", kind, i, chosen, other);
                if prefetch && kind == PolicyKind::Mooncake && (chosen.ttft() - other.ttft()).abs() <= slack {
                    prop_assert!(chosen.queue_s <= other.queue_s, "a tie goes to the shorter queue: {:?} over {:?}", chosen, other);
                }
                prop_assert!(other.reused_blocks <= n_blocks && other.fetch_blocks <= other.reused_blocks);
            }
        }
        // ttft_optimal never estimates worse than recomputing or using the local prefix.
        let mut rng = 0;
        let t = policy::choose(PolicyKind::TtftOptimal, &input, &mut rng).unwrap();
        for (i, c) in cands.iter().enumerate() {
            prop_assert!(t.ttft() <= input.local_choice(i).ttft() + cost.transfer.local_ssd(c.ssd * bs) + 1e-12);
        }
    }

    /// With rejection on, `schedule` rejects for an SLO if and only if the TTFT or TBT
    /// estimate of its decision exceeds that SLO (or no decode instance has room);
    /// `preview` agrees with it; a rejection changes nothing.
    #[test]
    fn rejected_iff_an_estimate_exceeds_its_slo(
        predictive in any::<bool>(),
        n_prefill in 1u64..4, n_decode in 1u64..4,
        ttft_slo in 0.05..2.0f64, tbt_slo in 0.013..0.03f64,
        reqs in prop::collection::vec((0u64..4, 0usize..8, 1usize..3000, 1usize..400, 0.0..0.5f64, any::<bool>()), 1..40),
    ) {
        let cfg = ConductorConfig {
            block_size: 16, ttft_slo_s: ttft_slo, tbt_slo_s: tbt_slo,
            rejection: if predictive { RejectionKind::Predictive } else { RejectionKind::Early },
            ..Default::default()
        };
        let c = Conductor::new(cfg).unwrap();
        for i in 0..n_prefill { c.add_prefill(i, PrefillSpec::default()).unwrap(); }
        for i in 0..n_decode { c.add_decode(10 + i, DecodeSpec { max_batch: 8, kv_capacity_tokens: 20_000 }).unwrap(); }
        let mut now = 0.0;
        for (rid, &(fam, nb, extra, out, dt, start)) in reqs.iter().enumerate() {
            now += dt;
            let hashes: Vec<u128> = (0..nb as u128).map(|b| fam as u128 * 1000 + b).collect();
            let r = ScheduleRequest { request_id: rid as u64, block_hashes: &hashes, prompt_len: nb * 16 + extra, now, expected_output_len: Some(out) };
            let before = c.snapshot(None).unwrap();
            let preview = c.preview(&r);
            match c.schedule(&r) {
                Ok(d) => {
                    prop_assert!(d.est_ttft_s <= ttft_slo && d.est_tbt_s <= tbt_slo, "{:?}", d);
                    prop_assert_eq!(d.retry_after_s, 0.0);
                    prop_assert_eq!(preview, Ok(d));
                    c.on_blocks_stored(d.prefill, &hashes, Tier::Dram).unwrap();
                    if start { c.on_prefill_started(rid as u64, Some(now)).unwrap(); }
                }
                Err(ConductorError::Overloaded { reason, estimates, .. }) => {
                    let e = estimates.expect("SLO rejections carry their estimates");
                    // issue 26: every estimate is finite ("predicted TBT inf"), and so is the wait
                    prop_assert!(e.est_ttft_s.is_finite() && e.est_tbt_s.is_finite(), "{:?}", e);
                    prop_assert!(e.retry_after_s.is_finite() && e.retry_after_s > 0.0, "{:?}", e);
                    match reason {
                        RejectReason::TtftSlo => {
                            prop_assert!(e.est_ttft_s > ttft_slo);
                            // the queue's drain, at least the excess (no calibration here: scale 1)
                            let wait = e.est_queue_s.max(e.est_ttft_s - ttft_slo);
                            prop_assert!((e.retry_after_s - wait).abs() < 1e-9, "{:?}", e);
                        }
                        RejectReason::DecodeCapacity => prop_assert!(e.est_ttft_s <= ttft_slo),
                        RejectReason::TbtSlo => prop_assert!(e.est_ttft_s <= ttft_slo && e.est_tbt_s > tbt_slo),
                        other => prop_assert!(false, "unexpected {:?}", other),
                    }
                    let preview_rejected = matches!(preview, Err(ConductorError::Overloaded { .. }));
                    prop_assert!(preview_rejected);
                    prop_assert_eq!(c.snapshot(None).unwrap(), before);
                }
                Err(e) => prop_assert!(false, "{}", e),
            }
        }
        prop_assert!(c.check_integrity().is_ok());
    }
}

#[derive(Debug, Clone)]
enum Op {
    AddPrefill(u64),
    AddDecode(u64, usize),
    Remove(u64),
    Schedule(u64, u64, usize, usize, f64, Option<usize>),
    PrefillStarted(u64, Option<f64>),
    PrefillFinished(u64, Option<f64>),
    DecodeStarted(u64, Option<f64>),
    DecodeFinished(u64, usize),
    Cancel(u64),
    Stored(u64, u64, usize, bool),
    Evicted(u64, u64, usize),
    Hints,
}

fn op() -> impl Strategy<Value = Op> {
    let t = prop_oneof![Just(None), (0.0..100.0f64).prop_map(Some), Just(Some(f64::NAN))];
    prop_oneof![
        (0u64..8).prop_map(Op::AddPrefill),
        (0u64..8, 1usize..4).prop_map(|(i, b)| Op::AddDecode(i, b)),
        (0u64..9).prop_map(Op::Remove),
        (0u64..20, 0u64..3, 0usize..6, 0usize..40, -1.0..100.0f64, prop::option::of(0usize..100))
            .prop_map(|(r, f, n, e, now, o)| Op::Schedule(r, f, n, e, now, o)),
        (0u64..20, t.clone()).prop_map(|(r, t)| Op::PrefillStarted(r, t)),
        (0u64..20, t.clone()).prop_map(|(r, t)| Op::PrefillFinished(r, t)),
        (0u64..20, t).prop_map(|(r, t)| Op::DecodeStarted(r, t)),
        (0u64..20, 0usize..100).prop_map(|(r, n)| Op::DecodeFinished(r, n)),
        (0u64..20).prop_map(Op::Cancel),
        (0u64..9, 0u64..3, 0usize..6, any::<bool>()).prop_map(|(i, f, n, s)| Op::Stored(i, f, n, s)),
        (0u64..9, 0u64..3, 0usize..6).prop_map(|(i, f, n)| Op::Evicted(i, f, n)),
        Just(Op::Hints),
    ]
}

fn fam(f: u64, n: usize) -> Vec<u128> {
    (0..n as u128).map(|b| f as u128 * 1000 + b).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Any sequence of registry, scheduling, progress and cache events keeps every
    /// invariant; a call that fails leaves the state exactly as it was.
    #[test]
    fn random_event_sequences_keep_invariants(
        ops in prop::collection::vec(op(), 1..80),
        policy in prop::sample::select(vec!["random", "load_balance", "local_cache_aware", "mooncake", "ttft_optimal"]),
        rejection in prop::sample::select(vec!["none", "early", "predictive"]),
        // prefetch off, room for a few blocks (327,680 bytes a token, 4 a block), unbounded
        staging in prop::sample::select(vec![0.0, 4e6, 1e15]),
    ) {
        let cfg = ConductorConfig {
            block_size: 4, ttft_slo_s: 0.5, tbt_slo_s: 0.02,
            policy: PolicyKind::parse(policy).unwrap(), rejection: RejectionKind::parse(rejection).unwrap(),
            hot_min_hits: 1.0, hot_busy_fraction: 0.0, hot_capacity: 4, prefetch_staging_bytes: staging,
            ..Default::default()
        };
        let c = Conductor::new(cfg).unwrap();
        for op in ops {
            let before = c.snapshot(None).unwrap();
            let failed = match op.clone() {
                Op::AddPrefill(i) => c.add_prefill(i, PrefillSpec::default()).is_err(),
                Op::AddDecode(i, b) => c.add_decode(i, DecodeSpec { max_batch: b, kv_capacity_tokens: 200 }).is_err(),
                Op::Remove(i) => c.remove_instance(i).is_err(),
                Op::Schedule(r, f, n, e, now, o) => {
                    let h = fam(f, n);
                    let req = ScheduleRequest { request_id: r, block_hashes: &h, prompt_len: n * 4 + e, now, expected_output_len: o };
                    c.schedule(&req).is_err()
                }
                Op::PrefillStarted(r, t) => c.on_prefill_started(r, t).is_err(),
                Op::PrefillFinished(r, t) => c.on_prefill_finished(r, t).is_err(),
                Op::DecodeStarted(r, t) => c.on_decode_started(r, t).is_err(),
                Op::DecodeFinished(r, n) => c.on_decode_finished(r, n, None).is_err(),
                Op::Cancel(r) => c.cancel(r).is_err(),
                Op::Stored(i, f, n, s) => c.on_blocks_stored(i, &fam(f, n), if s { Tier::Ssd } else { Tier::Dram }).is_err(),
                Op::Evicted(i, f, n) => c.on_blocks_evicted(i, &fam(f, n), None).is_err(),
                Op::Hints => c.replication_hints(None).is_err(),
            };
            if failed {
                prop_assert_eq!(c.snapshot(None).unwrap(), before, "{:?} failed but changed the state", op);
            }
            prop_assert!(c.check_integrity().is_ok(), "{:?}: {:?}", op, c.check_integrity());
        }
    }
}
