//! What sealing costs against what it protects: a memcpy of the same bytes (the floor
//! any path pays), the BLAKE3 keyed hash the transfer engine tags frames with, and a
//! sealed record (ring's AES-256-GCM, `mooncake_core::seal`, what the control plane
//! uses), at 64 KiB / 512 KiB / 1 MiB (a record's most).
//!
//! `cargo bench --bench seal`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mooncake_core::seal::{Opener, Sealer, HEADER_LEN};

fn sealing(c: &mut Criterion) {
    let key = [7u8; 32];
    let mut group = c.benchmark_group("seal");
    for size in [64usize << 10, 512 << 10, 1 << 20] {
        let data = vec![0x5Au8; size];
        let mut dst = vec![0u8; size];
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::new("memcpy", size), &data, |b, d| {
            b.iter(|| {
                dst.copy_from_slice(black_box(d));
                black_box(&dst);
            })
        });
        group.bench_with_input(BenchmarkId::new("blake3_keyed", size), &data, |b, d| {
            b.iter(|| black_box(blake3::keyed_hash(&key, black_box(d))))
        });
        let mut sealer = Sealer::new(&key).unwrap();
        group.bench_with_input(BenchmarkId::new("aes256gcm_seal", size), &data, |b, d| {
            b.iter(|| black_box(sealer.seal(black_box(d)).unwrap()))
        });
        // (each record opens once, in order: a fresh opener per iteration, outside the timing)
        let record = Sealer::new(&key).unwrap().seal(&data).unwrap();
        let header: [u8; HEADER_LEN] = record[..HEADER_LEN].try_into().unwrap();
        group.bench_with_input(BenchmarkId::new("aes256gcm_open", size), &record, |b, r| {
            b.iter_batched(
                || Opener::new(&key).unwrap(),
                |mut o| black_box(o.open(&header, &r[HEADER_LEN..]).unwrap()),
                criterion::BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, sealing);
criterion_main!(benches);
