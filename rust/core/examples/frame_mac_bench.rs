//! Per-core cost of the candidate frame protections of the TCP data path, measured on
//! this machine before choosing one (issue 26, "the cost of security"):
//! AES-256-GCM seal (copy into a scratch buffer, encrypt and tag) through `ring` and
//! through `aws-lc-rs` (today's sealed frames: tcp/guard.rs), GMAC (AES-256-GCM with the bytes as associated data only, nothing encrypted) through
//! `ring` and through `aws-lc-rs` (today's integrity-only tags: tcp/guard.rs),
//! BLAKE3 keyed hash (the integrity-only tag before), and ChaCha20-Poly1305 seal (copy and encrypt).
//! Each candidate protects 64 KiB records, the way frames are cut, of a buffer of the
//! given size. Then the framing layer itself per wire protection (`FrameWriter` into
//! memory, `FrameReader` back into a destination the way the server lands a write:
//! staged, verified, copied), in process CPU-seconds per GB, each direction apart.
//! Run: `cargo run --release -p mooncake-core --example frame_mac_bench`.

use std::io::Read;
use std::time::Instant;

use mooncake_core::transfer::tcp::seal::{FrameKey, FrameReader, FrameWriter};
use mooncake_core::transfer::WireProtection;

use aws_lc_rs::aead as awslc;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, CHACHA20_POLY1305};

const RECORD: usize = 64 << 10;

fn nonce_bytes(seq: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    n
}

fn nonce(seq: u64) -> Nonce {
    Nonce::assume_unique_for_key(nonce_bytes(seq))
}

/// GB/s of `f` over `buf`, the best of five runs of at least 0.2 s each (the least
/// disturbed by other processes on a shared host).
fn rate(buf: &[u8], mut f: impl FnMut(&[u8]) -> u8) -> f64 {
    let mut best = 0f64;
    for _ in 0..5 {
        let (t, mut bytes, mut sink) = (Instant::now(), 0usize, 0u8);
        while t.elapsed().as_secs_f64() < 0.2 {
            sink ^= f(buf);
            bytes += buf.len();
        }
        std::hint::black_box(sink);
        best = best.max(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// CPU seconds of this process so far (every thread).
fn cpu_now() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// CPU-s per GB of sending and of receiving `size`-byte frames, the least of five runs.
fn framing_cost(size: usize, key: Option<FrameKey>) -> (f64, f64) {
    let payload: Vec<u8> = (0..size).map(|i| (i * 13 % 251) as u8).collect();
    let head = [7u8; 32];
    let mut dst = vec![0u8; size];
    let (mut send, mut recv) = (f64::MAX, f64::MAX);
    for _ in 0..5 {
        // A writer and a reader per run: both count records from 0.
        let mut w = FrameWriter::new(Vec::with_capacity(size + (size >> 10) + 64), key);
        let reps = ((256usize << 20) / size).max(4);
        let mut wires = Vec::with_capacity(reps);
        let c0 = cpu_now();
        for _ in 0..reps {
            w.send(&head, &payload).unwrap();
            wires.push(std::mem::take(&mut *w.get_mut()));
            w.get_mut().reserve(size + (size >> 10) + 64);
        }
        let c1 = cpu_now();
        let mut r = FrameReader::new(std::io::Cursor::new(Vec::new()), key);
        for wire in wires {
            *r.get_mut() = std::io::Cursor::new(wire);
            r.read_exact(&mut [0u8; 32]).unwrap();
            r.read_payload_verified(&mut dst).unwrap();
        }
        let c2 = cpu_now();
        let gb = (reps * size) as f64 / 1e9;
        send = send.min((c1 - c0) / gb);
        recv = recv.min((c2 - c1) / gb);
    }
    assert!(dst == payload);
    (send, recv)
}

fn main() {
    let key = [7u8; 32];
    let gcm = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &key).unwrap());
    let chacha = LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, &key).unwrap());
    let aws = awslc::LessSafeKey::new(awslc::UnboundKey::new(&awslc::AES_256_GCM, &key).unwrap());
    let mut scratch = vec![0u8; RECORD];
    let mut seq = 0u64;
    println!(
        "{:>9} {:>14} {:>14} {:>14} {:>14} {:>14} {:>14}",
        "size", "seal ring", "seal aws-lc", "gmac ring", "gmac aws-lc", "blake3 keyed", "chacha-poly"
    );
    for size in [64 << 10, 512 << 10, 4 << 20] {
        let buf: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        let mut seal = |c: &LessSafeKey, b: &[u8]| {
            let mut x = 0u8;
            for rec in b.chunks(RECORD) {
                let s = &mut scratch[..rec.len()];
                s.copy_from_slice(rec);
                seq += 1;
                x ^= c.seal_in_place_separate_tag(nonce(seq), Aad::empty(), s).unwrap().as_ref()[0];
            }
            x
        };
        let aes = rate(&buf, |b| seal(&gcm, b));
        let cha = rate(&buf, |b| seal(&chacha, b));
        let mut seq4 = 0u64;
        let aws_seal = rate(&buf, |b| {
            let mut x = 0u8;
            for rec in b.chunks(RECORD) {
                let s = &mut scratch[..rec.len()];
                s.copy_from_slice(rec);
                seq4 += 1;
                let n = awslc::Nonce::assume_unique_for_key(nonce_bytes(seq4));
                x ^= aws.seal_in_place_separate_tag(n, awslc::Aad::empty(), s).unwrap().as_ref()[0];
            }
            x
        });
        let mut seq2 = 0u64;
        let gmac = rate(&buf, |b| {
            let mut x = 0u8;
            for rec in b.chunks(RECORD) {
                seq2 += 1;
                x ^= gcm.seal_in_place_separate_tag(nonce(seq2), Aad::from(rec), &mut []).unwrap().as_ref()[0];
            }
            x
        });
        let mut seq3 = 0u64;
        let aws_gmac = rate(&buf, |b| {
            let mut x = 0u8;
            for rec in b.chunks(RECORD) {
                seq3 += 1;
                let n = awslc::Nonce::assume_unique_for_key(nonce_bytes(seq3));
                x ^= aws.seal_in_place_separate_tag(n, awslc::Aad::from(rec), &mut []).unwrap().as_ref()[0];
            }
            x
        });
        let b3 = rate(&buf, |b| {
            let mut x = 0u8;
            for rec in b.chunks(RECORD) {
                x ^= blake3::keyed_hash(&key, rec).as_bytes()[0];
            }
            x
        });
        println!(
            "{:>8}K {:>9.2} GB/s {:>9.2} GB/s {:>9.2} GB/s {:>9.2} GB/s {:>9.2} GB/s {:>9.2} GB/s",
            size >> 10,
            aes,
            aws_seal,
            gmac,
            aws_gmac,
            b3,
            cha
        );
    }
    println!(
        "\nframing layer, CPU-s/GB (send = FrameWriter into memory; receive = FrameReader staged, verified, copied):"
    );
    println!("{:>9} {:>22} {:>22} {:>22}", "size", "no token send/recv", "encrypted send/recv", "integrity send/recv");
    for size in [64 << 10, 512 << 10, 4 << 20] {
        let key = |protection| Some(FrameKey { key: [5u8; 32], protection });
        let cols =
            [None, key(WireProtection::Encrypted), key(WireProtection::Integrity)].map(|k| framing_cost(size, k));
        let cell = |(a, b): (f64, f64)| format!("{a:.3} / {b:.3}");
        println!("{:>8}K {:>22} {:>22} {:>22}", size >> 10, cell(cols[0]), cell(cols[1]), cell(cols[2]));
    }
}
