//! Prefix hashing throughput (target: >= 2 GB/s of u32 tokens on one core).
//!
//! `cargo bench --bench hash`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mooncake_benches::random_tokens;
use mooncake_core::{HashAlgorithm, PrefixHasher};

fn hashing(c: &mut Criterion) {
    let tokens = random_tokens(16_384, 1);
    let mut group = c.benchmark_group("hash_16k_tokens");
    group.throughput(Throughput::Bytes((tokens.len() * 4) as u64));
    for alg in [HashAlgorithm::Xxh3, HashAlgorithm::Blake3] {
        for bs in [16usize, 64, 512] {
            let h = PrefixHasher::new(bs, 0, None, alg).unwrap();
            group.bench_with_input(BenchmarkId::new(alg.name(), bs), &tokens, |b, t| {
                b.iter(|| black_box(h.hash_tokens(black_box(t), None)))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, hashing);
criterion_main!(benches);
