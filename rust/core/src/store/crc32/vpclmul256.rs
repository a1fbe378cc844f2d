//! The 256-bit kernel: VPCLMULQDQ on 32-byte registers (AVX2), two 128-bit lanes per
//! instruction, for CPUs with VPCLMULQDQ and no AVX-512 (and where the 512-bit kernel's
//! wider registers do not pay). Four 32-byte accumulators, 128 bytes apart; then as the
//! 512-bit kernel: one accumulator, its two lanes into one, the 128-bit `finish`.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::clmul;

// (x^(256+32) mod P)' << 1 and (x^(256-32) mod P)' << 1: one 32-byte accumulator, each
// lane 256 bits from its next (the tests recompute both).
pub(super) const K1_256: i64 = 0x0_f1da_05aa;
pub(super) const K2_256: i64 = 0x1_5a54_6366;

/// The shortest input `fold` takes (its four accumulators).
pub(super) const MIN_LEN: usize = 128;

pub(super) fn available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("vpclmulqdq") && clmul::available()
    })
}

/// Reads 32 bytes at `src + at` and, when copying, stores them at `dst + at`
/// (non-temporally when `STREAM`).
///
/// # Safety
/// Inlined only into functions compiled with avx2; `at + 32` bytes readable at `src`;
/// `dst` null or `at + 32` bytes writable there (and `dst + at` 32-aligned when `STREAM`).
#[inline(always)]
unsafe fn take<const STREAM: bool>(src: *const u8, dst: *mut u8, at: usize) -> __m256i {
    // SAFETY: the contract above: both ranges cover `at..at + 32`, unaligned loads and
    // stores except the streaming store, whose address the caller aligned.
    unsafe {
        let v = _mm256_loadu_si256(src.add(at) as *const __m256i);
        if !dst.is_null() {
            if STREAM {
                _mm256_stream_si256(dst.add(at) as *mut __m256i, v);
            } else {
                _mm256_storeu_si256(dst.add(at) as *mut __m256i, v);
            }
        }
        v
    }
}

/// Each 128-bit lane of `acc` moved forward by the distance `keys` encode, plus `next`.
///
/// # Safety
/// Inlined only into functions compiled with avx2 and vpclmulqdq.
#[inline(always)]
unsafe fn fold32(acc: __m256i, next: __m256i, keys: __m256i) -> __m256i {
    // SAFETY: the caller's features (the contract above).
    unsafe {
        let lo = _mm256_clmulepi64_epi128(acc, keys, 0x00);
        let hi = _mm256_clmulepi64_epi128(acc, keys, 0x11);
        _mm256_xor_si256(_mm256_xor_si256(next, lo), hi)
    }
}

/// CRC-32 of `len >= MIN_LEN` bytes at `src` continued from `crc`; when `dst` is not
/// null the bytes are also copied there (with non-temporal stores when `STREAM`).
///
/// # Safety
/// The CPU has avx2, vpclmulqdq, pclmulqdq and sse4.1 ([`available`]); `src` readable
/// for `len`, `dst` null or writable for `len` and not overlapping `src`; with `STREAM`,
/// `dst` 32-aligned.
#[target_feature(enable = "avx2", enable = "vpclmulqdq", enable = "pclmulqdq", enable = "sse4.1")]
pub(super) unsafe fn fold<const STREAM: bool>(crc: u32, src: *const u8, dst: *mut u8, len: usize) -> u32 {
    debug_assert!(len >= MIN_LEN);
    // SAFETY: every `take(.., at)` has `at + 32 <= len` (the loop bounds); `finish` gets
    // `at <= len`, the caller's ranges and features, and (with `STREAM`) `dst + at`
    // 32-aligned, so 16-aligned.
    unsafe {
        let mut y0 = take::<STREAM>(src, dst, 0);
        let mut y1 = take::<STREAM>(src, dst, 32);
        let mut y2 = take::<STREAM>(src, dst, 64);
        let mut y3 = take::<STREAM>(src, dst, 96);
        y0 = _mm256_xor_si256(y0, _mm256_zextsi128_si256(_mm_cvtsi32_si128(!crc as i32)));
        let mut at = 128;
        // four accumulators 1024 bits apart: the 128-bit kernel's eight-lane constants
        let k1024 = _mm256_broadcastsi128_si256(_mm_set_epi64x(clmul::K2_8, clmul::K1_8));
        while len - at >= 128 {
            y0 = fold32(y0, take::<STREAM>(src, dst, at), k1024);
            y1 = fold32(y1, take::<STREAM>(src, dst, at + 32), k1024);
            y2 = fold32(y2, take::<STREAM>(src, dst, at + 64), k1024);
            y3 = fold32(y3, take::<STREAM>(src, dst, at + 96), k1024);
            at += 128;
        }
        let k256 = _mm256_broadcastsi128_si256(_mm_set_epi64x(K2_256, K1_256));
        let mut x = fold32(y0, y1, k256);
        x = fold32(x, y2, k256);
        x = fold32(x, y3, k256);
        while len - at >= 32 {
            x = fold32(x, take::<STREAM>(src, dst, at), k256);
            at += 32;
        }
        let k3k4 = _mm_set_epi64x(clmul::K4, clmul::K3);
        let y = clmul::fold16(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1), k3k4);
        clmul::finish::<STREAM>(y, src, dst, at, len)
    }
}
