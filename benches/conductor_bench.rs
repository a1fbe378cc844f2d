//! `schedule` with 16 prefill + 16 decode instances, 64-block prompts and 1M blocks in
//! the index. Criterion reports means; `percentiles` then times every call of a long
//! run itself and prints p50 / p99 / p99.9 (the targets are percentiles).
//!
//! Steady state: about 512 requests in flight (each scheduled request finishes prefill
//! 48 calls and decode 512 calls later, outside the timed section), so queues and decode batches are
//! non-empty and the predictive admission scans real batches. The replica a fetch makes
//! is evicted when its request finishes (bounded DRAM), so replicas do not pile up.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion};
use mooncake_core::conductor::{
    Conductor, ConductorConfig, DecodeSpec, PolicyKind, PrefillSpec, RejectionKind, ScheduleRequest,
};
use mooncake_core::Tier;
use rand::{rngs::SmallRng, Rng, SeedableRng};

const INSTANCES: u64 = 16;
const BLOCKS: usize = 64;
const CHAINS: usize = 1_000_000 / BLOCKS; // 1M distinct blocks
const IN_FLIGHT: u64 = 512;
const PREFILL_LAG: u64 = 48;

fn chain_block(chain: usize, i: usize) -> u128 {
    ((chain as u128) << 64) | i as u128
}

struct Setup {
    c: Conductor,
    prompts: Vec<Vec<u128>>,
    next: u64,
    /// Per in-flight request: (prefill instance, fetched block range) of its replica.
    fetched: Vec<Option<(u64, usize, usize)>>,
}

fn setup(policy: PolicyKind, rejection: RejectionKind) -> Setup {
    // CONDUCTOR_BALANCING_THRESHOLD: Algorithm 1's threshold (default: the config's, 1.0
    // since issue 25; 2.0 before, which fetches less often, so each decision does less
    // index work: set it to compare the estimate's cost alone with an older build)
    let threshold = std::env::var("CONDUCTOR_BALANCING_THRESHOLD").ok().and_then(|v| v.parse().ok());
    let mut cfg = ConductorConfig { policy, rejection, ttft_slo_s: 1e9, tbt_slo_s: 1e9, ..Default::default() };
    if let Some(t) = threshold {
        cfg.balancing_threshold = t;
    }
    // CONDUCTOR_PREFETCH_STAGING_BYTES: prefetch at decision time with this much staging
    // memory per prefill instance (default: the config's, 0 = off)
    if let Some(b) = std::env::var("CONDUCTOR_PREFETCH_STAGING_BYTES").ok().and_then(|v| v.parse().ok()) {
        cfg.prefetch_staging_bytes = b;
    }
    let c = Conductor::new(cfg).expect("config");
    for i in 0..INSTANCES {
        c.add_prefill(i, PrefillSpec::default()).expect("add");
        c.add_decode(100 + i, DecodeSpec { max_batch: 256, kv_capacity_tokens: 8_000_000 }).expect("add");
    }
    let mut rng = SmallRng::seed_from_u64(1);
    let mut buf = Vec::with_capacity(BLOCKS);
    for chain in 0..CHAINS {
        buf.clear();
        buf.extend((0..BLOCKS).map(|i| chain_block(chain, i)));
        let home = rng.gen_range(0..INSTANCES);
        let tier = if rng.gen_bool(0.3) { Tier::Ssd } else { Tier::Dram };
        c.on_blocks_stored(home, &buf, tier).expect("store");
        if rng.gen_bool(0.5) {
            // A second replica of a prefix of the chain elsewhere.
            let n = rng.gen_range(1..BLOCKS);
            c.on_blocks_stored((home + 1 + rng.gen_range(0..INSTANCES - 1)) % INSTANCES, &buf[..n], Tier::Dram)
                .expect("store");
        }
    }
    // Prompts: a cached prefix of random length from a random chain, then new blocks.
    let prompts =
        (0..4096)
            .map(|p| {
                let chain = rng.gen_range(0..CHAINS);
                let cached = rng.gen_range(0..=BLOCKS);
                (0..BLOCKS)
                    .map(|i| {
                        if i < cached {
                            chain_block(chain, i)
                        } else {
                            (1u128 << 120) | ((p as u128) << 32) | i as u128
                        }
                    })
                    .collect()
            })
            .collect();
    Setup { c, prompts, next: 0, fetched: vec![None; IN_FLIGHT as usize] }
}

impl Setup {
    /// One timed `schedule`, then (untimed) the request from IN_FLIGHT calls ago finishes.
    #[inline]
    fn step(&mut self) -> Duration {
        let rid = self.next;
        self.next += 1;
        let hashes = &self.prompts[(rid as usize) % self.prompts.len()];
        let req = ScheduleRequest {
            request_id: rid,
            block_hashes: hashes,
            prompt_len: BLOCKS * 512 + 100,
            now: rid as f64 * 0.01,
            expected_output_len: None,
        };
        let t = Instant::now();
        let d = black_box(self.c.schedule(&req));
        let dt = t.elapsed();
        let d = match d {
            Ok(d) => d,
            Err(e) => panic!("schedule failed: {e:?}"),
        };
        // Prefill of the request from PREFILL_LAG calls ago finishes (so queues stay a
        // few requests deep per instance); decode of the one from IN_FLIGHT calls ago.
        if rid >= PREFILL_LAG {
            let _ = self.c.on_prefill_finished(rid - PREFILL_LAG, None);
        }
        // The replica a fetch made lives as long as its request (instances have finite
        // DRAM; without eviction every chain would end up replicated everywhere).
        let slot = (rid % IN_FLIGHT) as usize;
        if rid >= IN_FLIGHT {
            let old = rid - IN_FLIGHT;
            let _ = self.c.on_decode_finished(old, 200, None);
            if let Some((inst, a, b)) = self.fetched[slot].take() {
                let hs = &self.prompts[(old as usize) % self.prompts.len()][a..b];
                let _ = self.c.on_blocks_evicted(inst, hs, None);
            }
        }
        if d.fetch_blocks > 0 {
            self.fetched[slot] = Some((d.prefill, d.reused_blocks - d.fetch_blocks, d.reused_blocks));
        }
        dt
    }
}

const CASES: [(PolicyKind, RejectionKind); 4] = [
    (PolicyKind::LocalCacheAware, RejectionKind::None),
    (PolicyKind::Mooncake, RejectionKind::None),
    (PolicyKind::Mooncake, RejectionKind::Predictive),
    (PolicyKind::TtftOptimal, RejectionKind::Predictive),
];

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("conductor");
    g.sample_size(20).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    for (policy, rejection) in CASES {
        let mut s = setup(policy, rejection);
        for _ in 0..2 * IN_FLIGHT {
            s.step();
        }
        g.bench_function(format!("schedule/{}/{}", policy.name(), rejection.name()), |b| {
            b.iter_custom(|iters| (0..iters).map(|_| s.step()).sum())
        });
    }
    g.finish();
}

fn percentiles() {
    {
        // The prefix match alone (the index's share of a schedule call).
        let s = setup(PolicyKind::Mooncake, RejectionKind::None);
        let mut out = Vec::new();
        let mut v: Vec<Duration> = (0..200_000)
            .map(|i| {
                let t = Instant::now();
                s.c.index().match_prefix_into(&s.prompts[i % s.prompts.len()], &mut out);
                let dt = t.elapsed();
                black_box(&out);
                dt
            })
            .collect();
        v.sort_unstable();
        let q = |p: f64| v[((v.len() as f64 * p) as usize).min(v.len() - 1)].as_secs_f64() * 1e6;
        println!("percentiles match_prefix_into alone: p50 {:.2} us  p99 {:.2} us", q(0.5), q(0.99));
    }
    for (policy, rejection) in CASES {
        let mut s = setup(policy, rejection);
        for _ in 0..2 * IN_FLIGHT {
            s.step();
        }
        let mut v: Vec<Duration> = (0..200_000).map(|_| s.step()).collect();
        v.sort_unstable();
        let q = |p: f64| v[((v.len() as f64 * p) as usize).min(v.len() - 1)].as_secs_f64() * 1e6;
        println!(
            "percentiles schedule/{}/{}: p50 {:.2} us  p99 {:.2} us  p99.9 {:.2} us  ({} calls, 16+16 instances, 64-block prompts, {} blocks indexed)",
            policy.name(),
            rejection.name(),
            q(0.5),
            q(0.99),
            q(0.999),
            v.len(),
            s.c.index().len()
        );
    }
}

criterion_group!(benches, bench);

fn main() {
    // CONDUCTOR_PERCENTILES_ONLY=1 skips the criterion part.
    if std::env::var_os("CONDUCTOR_PERCENTILES_ONLY").is_none() {
        benches();
        criterion::Criterion::default().configure_from_args().final_summary();
    }
    percentiles();
}
