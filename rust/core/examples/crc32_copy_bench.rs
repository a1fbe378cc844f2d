//! The CRC-32 kernels against a plain copy of the same bytes (issue 23: the vLLM
//! connector's save copies each block into store slots with its checksum folded in).
//! Rows: `memcpy`; copy + CRC with ordinary and with non-temporal (streaming) stores;
//! CRC alone; each CRC row per kernel (`Clmul128`, the 128-bit PCLMULQDQ fold, and
//! `Vpclmul256` / `Vpclmul512`, the 256- / 512-bit VPCLMULQDQ ones, where the CPU has
//! them). Shapes: 64 segments
//! of 128 KiB scattered into slots, and one 8 MiB run. Destinations: warm (the same
//! bytes each round, written just before) and cold (the next 8 MiB of a 1 GiB arena
//! each round, faulted in and written, but long out of cache). The variants take turns within each
//! round, so a disturbance from other processes falls on all of them; each figure is the
//! median over the rounds of bytes / this thread's CPU time.
//! Run: `cargo run --release -p mooncake-core --example crc32_copy_bench [rounds]`.

use mooncake_core::store::crc32::{copy_crc32_using, crc32_using, store_fence, Crc32Kernel};

const SEG: usize = 128 << 10;
const SEGS: usize = 64;
const TOTAL: usize = SEG * SEGS; // 8 MiB
const ARENA: usize = 1 << 30; // over the 480 MiB L3 this VM reports

#[derive(Clone, Copy)]
enum Op {
    Memcpy,
    CopyCrc(Crc32Kernel, bool),
    Crc(Crc32Kernel),
}

impl Op {
    fn name(self) -> String {
        match self {
            Op::Memcpy => "memcpy".into(),
            Op::CopyCrc(k, false) => format!("copy+CRC {k:?}"),
            Op::CopyCrc(k, true) => format!("copy+CRC streaming {k:?}"),
            Op::Crc(k) => format!("CRC alone {k:?}"),
        }
    }
}

/// CPU seconds of this thread so far.
fn thread_now() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Runs `op` over `TOTAL` bytes: 64 segments (source 2 segments apart, destination
/// back to back) or one run, from `src` into `dst`; returns the checksum (kept live).
fn run(op: Op, segmented: bool, src: &[u8], dst: &mut [u8]) -> u32 {
    let (n, len, src_step) = if segmented { (SEGS, SEG, 2 * SEG) } else { (1, TOTAL, 0) };
    let mut c = 0u32;
    for i in 0..n {
        let from = &src[i * src_step..i * src_step + len];
        let to = &mut dst[i * len..(i + 1) * len];
        c ^= match op {
            Op::Memcpy => {
                to.copy_from_slice(from);
                to[0] as u32
            }
            // SAFETY: `from` and `to` are `len` bytes of two distinct allocations.
            Op::CopyCrc(k, streaming) => unsafe {
                copy_crc32_using(k, streaming, 0, from.as_ptr(), to.as_mut_ptr(), len)
            },
            Op::Crc(k) => crc32_using(k, 0, from),
        };
    }
    if let Op::CopyCrc(_, true) = op {
        store_fence();
    }
    c
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(30);
    let mut ops = vec![Op::Memcpy];
    let kernels: Vec<_> = [Crc32Kernel::Clmul128, Crc32Kernel::Vpclmul256, Crc32Kernel::Vpclmul512]
        .into_iter()
        .filter(|k| k.available())
        .collect();
    for streaming in [false, true] {
        ops.extend(kernels.iter().map(|&k| Op::CopyCrc(k, streaming)));
    }
    ops.extend(kernels.iter().map(|&k| Op::Crc(k)));
    println!("best kernel here: {:?}; {rounds} rounds", Crc32Kernel::best());

    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let src: Vec<u8> = (0..2 * TOTAL)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let mut warm = vec![1u8; TOTAL];
    let mut arena = vec![1u8; ARENA];
    let mut at = 0usize;
    // (op index, segmented, cold) -> GB/s per round
    let mut rates = vec![vec![Vec::new(); 4]; ops.len()];
    let mut sink = 0u32;
    for _ in 0..rounds {
        for (i, &op) in ops.iter().enumerate() {
            for (j, (segmented, cold)) in
                [(true, false), (true, true), (false, false), (false, true)].into_iter().enumerate()
            {
                if matches!(op, Op::Crc(_)) && cold {
                    continue; // nothing is written
                }
                let dst: &mut [u8] = if cold {
                    at = (at + TOTAL) % ARENA;
                    &mut arena[at..at + TOTAL]
                } else {
                    run(op, segmented, &src, &mut warm); // written just before
                    &mut warm
                };
                let t = thread_now();
                sink ^= run(op, segmented, &src, dst);
                rates[i][j].push(TOTAL as f64 / (thread_now() - t) / 1e9);
            }
        }
    }
    // the folding's own speed: CRC alone over 256 KiB that stay in L2 (no memory traffic)
    let small = &src[..256 << 10];
    let in_l2: Vec<(Crc32Kernel, f64)> = kernels
        .iter()
        .map(|&k| {
            let mut r = Vec::new();
            for _ in 0..rounds * 10 {
                let t = thread_now();
                for _ in 0..8 {
                    sink ^= crc32_using(k, sink, small);
                }
                r.push(8.0 * small.len() as f64 / (thread_now() - t) / 1e9);
            }
            (k, median(r))
        })
        .collect();
    std::hint::black_box(sink);
    println!("| GB/s (median) | 64 x 128 KiB, warm | 64 x 128 KiB, cold | 8 MiB, warm | 8 MiB, cold |");
    println!("| --- | --- | --- | --- | --- |");
    for (i, op) in ops.iter().enumerate() {
        let cells: Vec<String> = rates[i]
            .iter()
            .map(|r| if r.is_empty() { "-".into() } else { format!("{:.1}", median(r.clone())) })
            .collect();
        println!("| {} | {} |", op.name(), cells.join(" | "));
    }
    for (k, r) in in_l2 {
        println!("CRC alone {k:?}, 256 KiB in L2: {r:.1} GB/s");
    }
}
