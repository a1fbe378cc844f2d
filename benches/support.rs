//! Shared helpers for the criterion benches (workload generators, percentiles).

use std::time::Instant;

use rand::{rngs::SmallRng, Rng, SeedableRng};

/// `n` pseudo-random tokens from a fixed seed (benches must be repeatable).
pub fn random_tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(0..128_000)).collect()
}

/// Per-call latency percentiles in nanoseconds, from `samples` timed calls of `f`
/// (criterion reports means; the targets are p50/p99).
pub fn latency_percentiles(samples: usize, mut f: impl FnMut(usize)) -> Percentiles {
    let mut ns: Vec<u64> = Vec::with_capacity(samples);
    for i in 0..samples {
        let t = Instant::now();
        f(i);
        ns.push(t.elapsed().as_nanos() as u64);
    }
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize];
    Percentiles { p50: at(0.50), p90: at(0.90), p99: at(0.99), max: *ns.last().unwrap_or(&0) }
}

#[derive(Debug, Clone, Copy)]
pub struct Percentiles {
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub max: u64,
}

impl std::fmt::Display for Percentiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "p50 {} ns, p90 {} ns, p99 {} ns, max {} ns", self.p50, self.p90, self.p99, self.max)
    }
}
