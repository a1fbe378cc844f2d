//! Store throughput: 1 KiB put+get pairs (DRAM only), the per-operation overhead.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use mooncake_core::store::{Store, StoreConfig};

fn store(slots: usize, eviction: &str) -> Store {
    Store::open(StoreConfig {
        block_bytes: 1024,
        dram_bytes: slots * 4096,
        eviction: eviction.into(),
        max_events: 0,
        ..Default::default()
    })
    .expect("store")
}

fn put_get_pairs(c: &mut Criterion) {
    let mut g = c.benchmark_group("store_1k");
    const N: u64 = 10_000;
    g.throughput(Throughput::Elements(N));
    let data = vec![7u8; 1024];
    for eviction in ["lru", "s3fifo", "prefix"] {
        // capacity below the working set: every put past the first 4096 evicts
        let s = store(4096, eviction);
        let mut next: u128 = 0;
        g.bench_function(format!("put_get_pairs/{eviction}"), |b| {
            b.iter(|| {
                for _ in 0..N {
                    next += 1;
                    black_box(s.put(next, &data).expect("put"));
                    black_box(s.get(next, true).expect("get").is_some());
                }
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = put_get_pairs
}
criterion_main!(benches);
