//! The 128-bit kernel: PCLMULQDQ folding of 16-byte lanes (Intel, "Fast CRC Computation
//! for Generic Polynomials Using PCLMULQDQ", 2009: four, here eight, 128-bit lanes, then
//! Barrett reduction), each 16 bytes loaded once, stored to the destination and folded.
//! Its lane helpers and the final reduction also finish the 512-bit kernel's tail.

use std::arch::x86_64::*;
use std::sync::OnceLock;

// Folding constants of the reflected polynomial, each (x^n mod P) bit-reflected and
// shifted left by one (the tests recompute every one): for lanes D bits apart the pair
// is x^(D+32), x^(D-32). Eight lanes (D = 1024), four lanes (D = 512), one lane
// (D = 128), then x^64 for 64 -> 32 bits and P and mu for the Barrett reduction.
pub(super) const K1_8: i64 = 0x1_e88e_f372;
pub(super) const K2_8: i64 = 0x1_4a7f_e880;
pub(super) const K1: i64 = 0x1_5444_2bd4;
pub(super) const K2: i64 = 0x1_c6e4_1596;
pub(super) const K3: i64 = 0x1_7519_97d0;
pub(super) const K4: i64 = 0x0_ccaa_009e;
pub(super) const K5: i64 = 0x1_63cd_6124;
const P_X: i64 = 0x1_DB71_0641;
const U_PRIME: i64 = 0x1_F701_1641;

/// The shortest input `fold` takes (its first eight lanes).
pub(super) const MIN_LEN: usize = 128;

pub(super) fn available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("pclmulqdq") && is_x86_feature_detected!("sse4.1"))
}

/// Reads 16 bytes at `src + at` and, when copying, stores them at `dst + at`
/// (non-temporally when `STREAM`).
///
/// # Safety
/// `at + 16` bytes readable at `src`; `dst` null or `at + 16` bytes writable there (and
/// `dst + at` 16-aligned when `STREAM`); SSE2 (x86-64 baseline).
#[inline(always)]
pub(super) unsafe fn take<const STREAM: bool>(src: *const u8, dst: *mut u8, at: usize) -> __m128i {
    // SAFETY: the caller's contract above: both ranges cover `at..at + 16`, unaligned
    // loads and stores except the streaming store, whose address the caller aligned.
    unsafe {
        let v = _mm_loadu_si128(src.add(at) as *const __m128i);
        if !dst.is_null() {
            if STREAM {
                _mm_stream_si128(dst.add(at) as *mut __m128i, v);
            } else {
                _mm_storeu_si128(dst.add(at) as *mut __m128i, v);
            }
        }
        v
    }
}

/// `acc` moved forward by the distance `keys` encode, plus `next`.
///
/// # Safety
/// Only inlined into functions compiled with pclmulqdq.
#[inline(always)]
pub(super) unsafe fn fold16(acc: __m128i, next: __m128i, keys: __m128i) -> __m128i {
    // SAFETY: the caller is compiled with pclmulqdq (the contract above).
    unsafe {
        let lo = _mm_clmulepi64_si128(acc, keys, 0x00);
        let hi = _mm_clmulepi64_si128(acc, keys, 0x11);
        _mm_xor_si128(_mm_xor_si128(next, lo), hi)
    }
}

/// Folds the 16-byte lanes at `at..` into `x` (the state of bytes `..at`), reduces it to
/// the CRC and continues that over the last `< 16` bytes with the tables, copying as it
/// goes when `dst` is not null.
///
/// # Safety
/// Inlined only into functions compiled with pclmulqdq and sse4.1; `src` readable and
/// `dst` null or writable for `len` bytes, not overlapping; `at <= len`; with `STREAM`,
/// `dst + at` 16-aligned.
#[inline(always)]
pub(super) unsafe fn finish<const STREAM: bool>(
    mut x: __m128i,
    src: *const u8,
    dst: *mut u8,
    mut at: usize,
    len: usize,
) -> u32 {
    // SAFETY: each `take` has `at + 16 <= len`; the tail stays within `len`; the
    // features are the caller's (the contract above).
    unsafe {
        let k3k4 = _mm_set_epi64x(K4, K3);
        while len - at >= 16 {
            x = fold16(x, take::<STREAM>(src, dst, at), k3k4);
            at += 16;
        }
        // 128 -> 64 bits, 64 -> 32 bits, then Barrett reduction.
        let mask32 = _mm_set_epi32(0, 0, 0, !0);
        let x = _mm_xor_si128(_mm_clmulepi64_si128(x, k3k4, 0x10), _mm_srli_si128(x, 8));
        let x = _mm_xor_si128(
            _mm_clmulepi64_si128(_mm_and_si128(x, mask32), _mm_set_epi64x(0, K5), 0x00),
            _mm_srli_si128(x, 4),
        );
        let pu = _mm_set_epi64x(U_PRIME, P_X);
        let t1 = _mm_clmulepi64_si128(_mm_and_si128(x, mask32), pu, 0x10);
        let t2 = _mm_clmulepi64_si128(_mm_and_si128(t1, mask32), pu, 0x00);
        let c = !(_mm_extract_epi32(_mm_xor_si128(x, t2), 1) as u32);
        let rest = len - at;
        if rest == 0 {
            return c;
        }
        let tail = if dst.is_null() {
            std::slice::from_raw_parts(src.add(at), rest)
        } else {
            std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), rest);
            std::slice::from_raw_parts(dst.add(at), rest)
        };
        super::crc32_tables(c, tail)
    }
}

/// CRC-32 of `len >= MIN_LEN` bytes at `src` continued from `crc`; when `dst` is not
/// null the bytes are also copied there (with non-temporal stores when `STREAM`).
///
/// # Safety
/// The CPU has pclmulqdq and sse4.1; `src` readable for `len`, `dst` null or
/// writable for `len` and not overlapping `src`; with `STREAM`, `dst` 16-aligned.
#[target_feature(enable = "pclmulqdq", enable = "sse2", enable = "sse4.1")]
pub(super) unsafe fn fold<const STREAM: bool>(crc: u32, src: *const u8, dst: *mut u8, len: usize) -> u32 {
    debug_assert!(len >= MIN_LEN);
    // SAFETY: every `take(.., at)` below has `at + 16 <= len` (the loop bounds), and
    // `finish` gets `at <= len` with the caller's ranges and features.
    unsafe {
        let mut x3 = take::<STREAM>(src, dst, 0);
        let mut x2 = take::<STREAM>(src, dst, 16);
        let mut x1 = take::<STREAM>(src, dst, 32);
        let mut x0 = take::<STREAM>(src, dst, 48);
        x3 = _mm_xor_si128(x3, _mm_cvtsi32_si128(!crc as i32));
        let mut at = 64;
        let k1k2 = _mm_set_epi64x(K2, K1);
        if len >= 256 {
            // eight lanes while 128 bytes remain: twice the independent carry-less
            // multiplications in flight (each has a latency of several cycles)
            let mut y3 = take::<STREAM>(src, dst, 64);
            let mut y2 = take::<STREAM>(src, dst, 80);
            let mut y1 = take::<STREAM>(src, dst, 96);
            let mut y0 = take::<STREAM>(src, dst, 112);
            at = 128;
            let k8 = _mm_set_epi64x(K2_8, K1_8);
            while len - at >= 128 {
                x3 = fold16(x3, take::<STREAM>(src, dst, at), k8);
                x2 = fold16(x2, take::<STREAM>(src, dst, at + 16), k8);
                x1 = fold16(x1, take::<STREAM>(src, dst, at + 32), k8);
                x0 = fold16(x0, take::<STREAM>(src, dst, at + 48), k8);
                y3 = fold16(y3, take::<STREAM>(src, dst, at + 64), k8);
                y2 = fold16(y2, take::<STREAM>(src, dst, at + 80), k8);
                y1 = fold16(y1, take::<STREAM>(src, dst, at + 96), k8);
                y0 = fold16(y0, take::<STREAM>(src, dst, at + 112), k8);
                at += 128;
            }
            // the first four lanes are 64 bytes ahead of the last four: fold them in
            x3 = fold16(x3, y3, k1k2);
            x2 = fold16(x2, y2, k1k2);
            x1 = fold16(x1, y1, k1k2);
            x0 = fold16(x0, y0, k1k2);
        }
        while len - at >= 64 {
            x3 = fold16(x3, take::<STREAM>(src, dst, at), k1k2);
            x2 = fold16(x2, take::<STREAM>(src, dst, at + 16), k1k2);
            x1 = fold16(x1, take::<STREAM>(src, dst, at + 32), k1k2);
            x0 = fold16(x0, take::<STREAM>(src, dst, at + 48), k1k2);
            at += 64;
        }
        let k3k4 = _mm_set_epi64x(K4, K3);
        let mut x = fold16(x3, x2, k3k4);
        x = fold16(x, x1, k3k4);
        x = fold16(x, x0, k3k4);
        finish::<STREAM>(x, src, dst, at, len)
    }
}
