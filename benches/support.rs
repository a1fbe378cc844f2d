//! Shared helpers for the criterion benches (workload generators).

use rand::{rngs::SmallRng, Rng, SeedableRng};

/// `n` pseudo-random tokens from a fixed seed (benches must be repeatable).
pub fn random_tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(0..128_000)).collect()
}
