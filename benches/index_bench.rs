//! `match_prefix` of a 64-block prompt against 16 instances holding 1M blocks in all
//! (target: p50 <= 2 us), and index memory per entry at 10M entries (target <= 64 B).
//!
//! `cargo bench --bench index` — criterion timings, then per-call percentiles and the
//! memory figure printed at the end.

use std::hint::black_box;

use criterion::Criterion;
use mooncake_benches::latency_percentiles;
use mooncake_core::{BlockHash, BlockIndex, PrefixHasher, PrefixMatch, Tier};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const INSTANCES: u64 = 16;
const PROMPT_BLOCKS: usize = 64;

/// 1M blocks as 64-block chains; each chain lives on one instance, and a quarter of the
/// chains' first halves are replicated on a second instance (shared prefixes).
fn build(total_blocks: usize) -> (BlockIndex, Vec<Vec<BlockHash>>) {
    let hasher = PrefixHasher::new(16, 0, None, Default::default()).unwrap();
    let idx = BlockIndex::new();
    let mut rng = SmallRng::seed_from_u64(7);
    let mut chains = Vec::new();
    let mut entries = 0;
    while entries < total_blocks {
        let toks: Vec<u32> = (0..16 * PROMPT_BLOCKS).map(|_| rng.gen()).collect();
        let hs = hasher.hash_tokens(&toks, None);
        let owner = rng.gen_range(0..INSTANCES);
        idx.insert(owner, &hs, Tier::Dram).unwrap();
        entries += hs.len();
        if chains.len() % 4 == 0 {
            let other = (owner + 1 + rng.gen_range(0..INSTANCES - 1)) % INSTANCES;
            idx.insert(other, &hs[..PROMPT_BLOCKS / 2], Tier::Ssd).unwrap();
            entries += PROMPT_BLOCKS / 2;
        }
        chains.push(hs);
    }
    (idx, chains)
}

fn main() {
    let (idx, chains) = build(1_000_000);
    let mut c = Criterion::default().configure_from_args();
    let mut out: Vec<PrefixMatch> = Vec::new();
    let mut group = c.benchmark_group("match_prefix_64_blocks_1M_indexed");
    group.bench_function("same_prompt", |b| b.iter(|| idx.match_prefix_into(black_box(&chains[0]), &mut out)));
    let mut i = 0usize;
    group.bench_function("random_prompt", |b| {
        b.iter(|| {
            i = (i + 7919) % chains.len();
            idx.match_prefix_into(black_box(&chains[i]), &mut out)
        })
    });
    group.finish();
    c.final_summary();

    let n = chains.len();
    let random = latency_percentiles(200_000, |k| idx.match_prefix_into(&chains[(k * 7919) % n], &mut out));
    let same = latency_percentiles(200_000, |_| idx.match_prefix_into(&chains[0], &mut out));
    let s = idx.stats();
    println!("index: {} blocks, {} entries, {} instances", s.blocks, s.entries, s.instances);
    println!("match_prefix 64 blocks, random prompt: {random}");
    println!("match_prefix 64 blocks, same prompt:   {same}");
    drop(idx);

    // Memory at 10M (block, holder) entries: 8M blocks on one holder, 1M on two.
    let idx = BlockIndex::new();
    let mut rng = SmallRng::seed_from_u64(9);
    let mut batch = Vec::with_capacity(1024);
    for b in 0..9_000_000u64 {
        batch.push(((rng.gen::<u64>() as u128) << 64) | b as u128);
        if batch.len() == 1024 {
            idx.insert(b % INSTANCES, &batch, Tier::Dram).unwrap();
            if b < 1_000_000 {
                idx.insert((b + 1) % INSTANCES, &batch, Tier::Ssd).unwrap();
            }
            batch.clear();
        }
    }
    let s = idx.stats();
    println!(
        "index memory: {} entries over {} blocks, {:.1} MiB, {:.1} bytes/entry",
        s.entries,
        s.blocks,
        s.memory_bytes as f64 / (1 << 20) as f64,
        s.memory_bytes as f64 / s.entries as f64
    );
}
