//! Transfer engine: the local (memcpy) path through submit + wait, and the frame codec.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use mooncake_core::transfer::protocol::{decode_frame, encode, Msg};
use mooncake_core::transfer::{Engine, EngineConfig, Op, Request, Transports};

fn local_path(c: &mut Criterion) {
    let cfg =
        EngineConfig { name: "bench".into(), transports: Transports::parse(["local"]).unwrap(), ..Default::default() };
    let e = Engine::new(cfg, None).unwrap();
    let me = e.connect("bench", None).unwrap();
    let src = e.allocate(64 << 20, false).unwrap().id;
    let dst = e.allocate(64 << 20, false).unwrap().id;
    let mut g = c.benchmark_group("transfer_local");
    for (size, n) in [(64usize, 64usize), (64 << 10, 16), (4 << 20, 16)] {
        let reqs: Vec<Request> = (0..n)
            .map(|i| Request {
                op: Op::Write,
                local: src,
                local_offset: (i * size) as u64,
                peer: me.clone(),
                remote_region: dst,
                remote_offset: (i * size) as u64,
                length: size as u64,
            })
            .collect();
        g.throughput(Throughput::Bytes((size * n) as u64));
        g.bench_function(format!("submit_wait_{n}x{size}"), |b| {
            b.iter(|| {
                let batch = e.submit(reqs.clone(), Duration::from_secs(10)).unwrap();
                black_box(batch.wait(None));
            })
        });
    }
    g.finish();
}

fn codec(c: &mut Criterion) {
    let msg = Msg::WriteReq { id: 7, region: 3, offset: 1 << 20, data_len: 0 };
    let read = Msg::ReadReq { id: 9, region: 3, offset: 4096, len: 65536 };
    let mut g = c.benchmark_group("transfer_frame");
    g.bench_function("encode_read_req", |b| b.iter(|| black_box(encode(black_box(&read)))));
    let buf = encode(&msg);
    g.bench_function("decode_write_req", |b| b.iter(|| black_box(decode_frame(black_box(&buf)).unwrap())));
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
    targets = local_path, codec
}
criterion_main!(benches);
