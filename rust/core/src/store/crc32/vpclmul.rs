//! The 512-bit kernel: VPCLMULQDQ folds four 128-bit lanes per instruction, so each 64
//! bytes cost one load, one store and two carry-less multiplies (the 128-bit kernel
//! spends four of each): the checksum's share of a copy's instructions drops far enough
//! that the copy is bound by memory, not by the folding. Four 64-byte accumulators (256
//! bytes apart) keep enough multiplies in flight to cover their latency; the last
//! 64-byte lanes are folded into one, its four 128-bit lanes into one, and the 128-bit
//! kernel's `finish` takes the rest.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::clmul;

// (x^(2048+32) mod P)' << 1 and (x^(2048-32) mod P)' << 1: four 64-byte accumulators,
// 2048 bits apart (the tests recompute both, with the other constants).
pub(super) const K1_2048: i64 = 0x1_1542_778a;
pub(super) const K2_2048: i64 = 0x1_322d_1430;

/// The shortest input `fold` takes (its four accumulators).
pub(super) const MIN_LEN: usize = 256;

pub(super) fn available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        // the 256-bit kernel's features too: shorter inputs fall back to it
        is_x86_feature_detected!("avx512f") && super::vpclmul256::available()
    })
}

/// Reads 64 bytes at `src + at` and, when copying, stores them at `dst + at`
/// (non-temporally when `STREAM`).
///
/// # Safety
/// Inlined only into functions compiled with avx512f; `at + 64` bytes readable at `src`;
/// `dst` null or `at + 64` bytes writable there (and `dst + at` 64-aligned when `STREAM`).
#[inline(always)]
unsafe fn take<const STREAM: bool>(src: *const u8, dst: *mut u8, at: usize) -> __m512i {
    // SAFETY: the contract above: both ranges cover `at..at + 64`, unaligned loads and
    // stores except the streaming store, whose address the caller aligned.
    unsafe {
        let v = _mm512_loadu_si512(src.add(at) as *const _);
        if !dst.is_null() {
            if STREAM {
                _mm512_stream_si512(dst.add(at) as *mut _, v);
            } else {
                _mm512_storeu_si512(dst.add(at) as *mut _, v);
            }
        }
        v
    }
}

/// Each 128-bit lane of `acc` moved forward by the distance `keys` encode, plus `next`.
///
/// # Safety
/// Inlined only into functions compiled with avx512f and vpclmulqdq.
#[inline(always)]
unsafe fn fold64(acc: __m512i, next: __m512i, keys: __m512i) -> __m512i {
    // SAFETY: the caller's features (the contract above).
    unsafe {
        let lo = _mm512_clmulepi64_epi128(acc, keys, 0x00);
        let hi = _mm512_clmulepi64_epi128(acc, keys, 0x11);
        // next ^ lo ^ hi in one instruction (0x96: the three-input XOR's truth table)
        _mm512_ternarylogic_epi64(next, lo, hi, 0x96)
    }
}

/// CRC-32 of `len >= MIN_LEN` bytes at `src` continued from `crc`; when `dst` is not
/// null the bytes are also copied there (with non-temporal stores when `STREAM`).
///
/// # Safety
/// The CPU has avx512f, avx2, vpclmulqdq, pclmulqdq and sse4.1 ([`available`]); `src` readable
/// for `len`, `dst` null or writable for `len` and not overlapping `src`; with `STREAM`,
/// `dst` 64-aligned.
#[target_feature(enable = "avx512f", enable = "vpclmulqdq", enable = "pclmulqdq", enable = "sse4.1")]
pub(super) unsafe fn fold<const STREAM: bool>(crc: u32, src: *const u8, dst: *mut u8, len: usize) -> u32 {
    debug_assert!(len >= MIN_LEN);
    // SAFETY: every `take(.., at)` has `at + 64 <= len` (the loop bounds); `finish` gets
    // `at <= len`, the caller's ranges and features, and (with `STREAM`) `dst + at`
    // 64-aligned, so 16-aligned.
    unsafe {
        let mut z0 = take::<STREAM>(src, dst, 0);
        let mut z1 = take::<STREAM>(src, dst, 64);
        let mut z2 = take::<STREAM>(src, dst, 128);
        let mut z3 = take::<STREAM>(src, dst, 192);
        z0 = _mm512_xor_si512(z0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(!crc as i32)));
        let mut at = 256;
        let k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(K2_2048, K1_2048));
        while len - at >= 256 {
            z0 = fold64(z0, take::<STREAM>(src, dst, at), k2048);
            z1 = fold64(z1, take::<STREAM>(src, dst, at + 64), k2048);
            z2 = fold64(z2, take::<STREAM>(src, dst, at + 128), k2048);
            z3 = fold64(z3, take::<STREAM>(src, dst, at + 192), k2048);
            at += 256;
        }
        // one 64-byte accumulator from here: each lane 512 bits from its next
        let k512 = _mm512_broadcast_i32x4(_mm_set_epi64x(clmul::K2, clmul::K1));
        let mut x = fold64(z0, z1, k512);
        x = fold64(x, z2, k512);
        x = fold64(x, z3, k512);
        while len - at >= 64 {
            x = fold64(x, take::<STREAM>(src, dst, at), k512);
            at += 64;
        }
        // its four 128-bit lanes (lane 0 the earliest bytes) into one, 128 bits a step
        let k3k4 = _mm_set_epi64x(clmul::K4, clmul::K3);
        let mut y = clmul::fold16(_mm512_extracti32x4_epi32(x, 0), _mm512_extracti32x4_epi32(x, 1), k3k4);
        y = clmul::fold16(y, _mm512_extracti32x4_epi32(x, 2), k3k4);
        y = clmul::fold16(y, _mm512_extracti32x4_epi32(x, 3), k3k4);
        clmul::finish::<STREAM>(y, src, dst, at, len)
    }
}
