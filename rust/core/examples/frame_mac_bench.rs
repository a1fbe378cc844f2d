//! Per-core cost of the candidate frame protections of the TCP data path, measured on
//! this machine before choosing one (issue 26, "the cost of security"):
//! AES-256-GCM seal (copy into a scratch buffer, encrypt and tag: today's sealed frames),
//! GMAC (AES-256-GCM with the bytes as associated data only, nothing encrypted),
//! BLAKE3 keyed hash, and ChaCha20-Poly1305 seal (copy and encrypt).
//! Each candidate protects 64 KiB records, the way frames are cut, of a buffer of the
//! given size. Run: `cargo run --release -p mooncake-core --example frame_mac_bench`.

use std::time::Instant;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, CHACHA20_POLY1305};

const RECORD: usize = 64 << 10;

fn nonce(seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    Nonce::assume_unique_for_key(n)
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

fn main() {
    let key = [7u8; 32];
    let gcm = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &key).unwrap());
    let chacha = LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, &key).unwrap());
    let mut scratch = vec![0u8; RECORD];
    let mut seq = 0u64;
    println!("{:>9} {:>14} {:>14} {:>14} {:>14}", "size", "aes-gcm seal", "gmac (aad)", "blake3 keyed", "chacha-poly");
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
        let mut seq2 = 0u64;
        let gmac = rate(&buf, |b| {
            let mut x = 0u8;
            for rec in b.chunks(RECORD) {
                seq2 += 1;
                x ^= gcm.seal_in_place_separate_tag(nonce(seq2), Aad::from(rec), &mut []).unwrap().as_ref()[0];
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
        println!("{:>8}K {:>11.2} GB/s {:>9.2} GB/s {:>9.2} GB/s {:>9.2} GB/s", size >> 10, aes, gmac, b3, cha);
    }
}
