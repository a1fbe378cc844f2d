//! CRC-32 (the IEEE polynomial of zlib, gzip and Python's `zlib.crc32`), optionally
//! fused with a copy: [`copy_crc32`] reads each 16 bytes once, stores them to the
//! destination and folds them into the checksum, so a block copied into (or out of) the
//! store gets its checksum for the price of the copy. On x86-64 with PCLMULQDQ the
//! checksum is carry-less-multiply folding (Intel, "Fast CRC Computation for Generic
//! Polynomials Using PCLMULQDQ", 2009: four 128-bit lanes, then Barrett reduction);
//! elsewhere (and for short inputs and tails) slicing-by-8 tables.
//!
//! [`copy_crc32_streaming`] is the same with non-temporal stores, for a destination that
//! will not be read soon (a slot of the store being filled): the stores go to memory
//! without first reading each destination line into the cache (a cold destination costs
//! one memory pass instead of two) and without evicting what the caller works on.
//!
//! Values follow zlib's convention: `crc32(crc32(0, a), b) == crc32(0, a ++ b)`.

const POLY: u32 = 0xEDB8_8320; // reflected 0x04C11DB7

const fn make_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut s = 1;
    while s < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = t[s - 1][i];
            t[s][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            i += 1;
        }
        s += 1;
    }
    t
}

static TABLES: [[u32; 256]; 8] = make_tables();

/// The portable update (slicing-by-8), zlib's convention.
pub fn crc32_tables(crc: u32, data: &[u8]) -> u32 {
    let t = &TABLES;
    let mut c = !crc;
    let mut chunks = data.chunks_exact(8);
    for ch in &mut chunks {
        let lo = u32::from_le_bytes([ch[0], ch[1], ch[2], ch[3]]) ^ c;
        let hi = u32::from_le_bytes([ch[4], ch[5], ch[6], ch[7]]);
        c = t[7][(lo & 0xff) as usize]
            ^ t[6][((lo >> 8) & 0xff) as usize]
            ^ t[5][((lo >> 16) & 0xff) as usize]
            ^ t[4][(lo >> 24) as usize]
            ^ t[3][(hi & 0xff) as usize]
            ^ t[2][((hi >> 8) & 0xff) as usize]
            ^ t[1][((hi >> 16) & 0xff) as usize]
            ^ t[0][(hi >> 24) as usize];
    }
    for &b in chunks.remainder() {
        c = t[0][((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// CRC-32 of `data` continued from `crc` (0 to start).
pub fn crc32(crc: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if data.len() >= 128 && clmul::available() {
        // SAFETY: the CPU has the features `fold` is compiled for (checked just above);
        // `data` is readable for its length and no destination is written.
        return unsafe { clmul::fold::<false>(crc, data.as_ptr(), std::ptr::null_mut(), data.len()) };
    }
    crc32_tables(crc, data)
}

/// Copies `len` bytes from `src` to `dst` and returns the CRC-32 of those bytes continued
/// from `crc`.
///
/// # Safety
/// `src` must be readable and `dst` writable for `len` bytes, and the two ranges must
/// not overlap (each 16 bytes are stored before the next are read).
pub unsafe fn copy_crc32(crc: u32, src: *const u8, dst: *mut u8, len: usize) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if len >= 128 && clmul::available() {
        // SAFETY: features checked; the caller's contract covers both ranges.
        return unsafe { clmul::fold::<false>(crc, src, dst, len) };
    }
    // SAFETY: the caller's contract: both ranges valid for `len`, no overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len);
        crc32_tables(crc, std::slice::from_raw_parts(dst, len))
    }
}

/// [`copy_crc32`] with non-temporal stores (the destination bypasses the cache). Call
/// [`store_fence`] after the last of a batch of these and before anything that makes the
/// bytes visible to another thread or process (the stores are weakly ordered).
///
/// # Safety
/// As [`copy_crc32`].
pub unsafe fn copy_crc32_streaming(crc: u32, src: *const u8, dst: *mut u8, len: usize) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if clmul::available() {
        // streaming stores need 16-byte aligned destinations: the bytes before the first
        // aligned address go the ordinary way
        let head = dst.align_offset(16).min(len);
        if len - head >= 128 {
            // SAFETY: `head <= len`, so both parts stay inside the caller's ranges; the
            // features are checked; `dst + head` is 16-aligned.
            unsafe {
                let c = if head == 0 { crc } else { copy_crc32(crc, src, dst, head) };
                return clmul::fold::<true>(c, src.add(head), dst.add(head), len - head);
            }
        }
    }
    // SAFETY: the caller's contract.
    unsafe { copy_crc32(crc, src, dst, len) }
}

/// Orders every non-temporal store made before it ([`copy_crc32_streaming`]) before every
/// store after it.
pub fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no operands and is part of the x86-64 baseline (SSE).
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

#[cfg(target_arch = "x86_64")]
mod clmul {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    // Folding constants of the reflected polynomial: x^(4*128+32), x^(4*128-32) mod P
    // (four lanes), x^(128+32), x^(128-32) (one lane), x^64 mod P, then P and mu for the
    // Barrett reduction (all bit-reflected, shifted left by one).
    // The same two for eight lanes (1024 bits apart): (x^(1024+32) mod P)' << 1 and
    // (x^(1024-32) mod P)' << 1, computed as the others are (the test recomputes all).
    const K1_8: i64 = 0x1_e88e_f372;
    const K2_8: i64 = 0x1_4a7f_e880;
    const K1: i64 = 0x1_5444_2bd4;
    const K2: i64 = 0x1_c6e4_1596;
    const K3: i64 = 0x1_7519_97d0;
    const K4: i64 = 0x0_ccaa_009e;
    const K5: i64 = 0x1_63cd_6124;
    const P_X: i64 = 0x1_DB71_0641;
    const U_PRIME: i64 = 0x1_F701_1641;

    pub fn available() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("pclmulqdq") && is_x86_feature_detected!("sse4.1"))
    }

    /// Reads 16 bytes at `src + at` and, when copying, stores them at `dst + at`
    /// (non-temporally when `STREAM`).
    #[inline(always)]
    unsafe fn take<const STREAM: bool>(src: *const u8, dst: *mut u8, at: usize) -> __m128i {
        // SAFETY: the caller (fold) keeps `at + 16 <= len`; unaligned loads and stores,
        // except streaming stores, for which fold's caller gave a 16-aligned `dst` (and
        // `at` is a multiple of 16).
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

    #[inline(always)]
    unsafe fn fold16(acc: __m128i, next: __m128i, keys: __m128i) -> __m128i {
        // SAFETY: only called from `fold`, compiled with pclmulqdq.
        unsafe {
            let lo = _mm_clmulepi64_si128(acc, keys, 0x00);
            let hi = _mm_clmulepi64_si128(acc, keys, 0x11);
            _mm_xor_si128(_mm_xor_si128(next, lo), hi)
        }
    }

    /// CRC-32 of `len >= 128` bytes at `src` continued from `crc`; when `dst` is not
    /// null the bytes are also copied there (with non-temporal stores when `STREAM`).
    ///
    /// # Safety
    /// The CPU has pclmulqdq and sse4.1; `src` readable for `len`, `dst` null or
    /// writable for `len` and not overlapping `src`; with `STREAM`, `dst` 16-aligned.
    #[target_feature(enable = "pclmulqdq", enable = "sse2", enable = "sse4.1")]
    pub unsafe fn fold<const STREAM: bool>(crc: u32, src: *const u8, dst: *mut u8, len: usize) -> u32 {
        debug_assert!(len >= 128);
        // SAFETY: every `take(.., at)` below has `at + 16 <= len` (the loop bounds), and
        // the tail is copied and hashed within `len`.
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bit by bit, straight from the definition: the reference the fast paths answer to.
    fn reference(crc: u32, data: &[u8]) -> u32 {
        let mut c = !crc;
        for &b in data {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            }
        }
        !c
    }

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// (x^n mod P)' << 1: how every folding constant above is made.
    fn fold_constant(n: u32) -> i64 {
        let mut r: u64 = 1;
        for _ in 0..n {
            r <<= 1;
            if r & (1 << 32) != 0 {
                r ^= 0x1_04C1_1DB7;
            }
        }
        ((r as u32).reverse_bits() as i64) << 1
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn folding_constants_are_powers_of_x_mod_p() {
        assert_eq!(fold_constant(1024 + 32), 0x1_e88e_f372);
        assert_eq!(fold_constant(1024 - 32), 0x1_4a7f_e880);
        assert_eq!(fold_constant(512 + 32), 0x1_5444_2bd4);
        assert_eq!(fold_constant(512 - 32), 0x1_c6e4_1596);
        assert_eq!(fold_constant(128 + 32), 0x1_7519_97d0);
        assert_eq!(fold_constant(128 - 32), 0x0_ccaa_009e);
        assert_eq!(fold_constant(64), 0x1_63cd_6124);
    }

    #[test]
    fn known_values() {
        assert_eq!(crc32(0, b""), 0);
        assert_eq!(crc32(0, b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(0, &[0u8; 4096]), reference(0, &[0u8; 4096]));
    }

    #[test]
    fn every_length_and_start_value_matches_the_reference() {
        for n in (0..300).chain([511, 512, 513, 4095, 4096, 65536 + 17]) {
            let data = bytes(n, n as u64 + 1);
            for start in [0u32, 1, 0xFFFF_FFFF, 0x1234_5678] {
                let want = reference(start, &data);
                assert_eq!(crc32(start, &data), want, "len {n} start {start:#x}");
                assert_eq!(crc32_tables(start, &data), want, "tables, len {n}");
                let mut out = vec![0u8; n];
                // SAFETY: both vectors hold n bytes and are distinct allocations.
                let got = unsafe { copy_crc32(start, data.as_ptr(), out.as_mut_ptr(), n) };
                assert_eq!(got, want, "copy, len {n}");
                assert_eq!(out, data, "copy, len {n}");
                // streaming, at every destination alignment (the unaligned head goes the
                // ordinary way)
                for shift in [0usize, 1, 7, 15] {
                    let mut out = vec![0u8; n + 16];
                    // SAFETY: `out` holds n + 16 >= shift + n bytes; distinct allocations.
                    let got =
                        unsafe { copy_crc32_streaming(start, data.as_ptr(), out.as_mut_ptr().add(shift), n) };
                    store_fence();
                    assert_eq!(got, want, "streaming copy, len {n} shift {shift}");
                    assert_eq!(&out[shift..shift + n], &data[..], "streaming copy, len {n} shift {shift}");
                    assert!(out[..shift].iter().chain(&out[shift + n..]).all(|&b| b == 0), "wrote outside");
                }
            }
        }
    }

    #[test]
    fn continuing_equals_one_pass() {
        let data = bytes(10_000, 7);
        for cut in [0, 1, 127, 128, 1000, 9999, 10_000] {
            assert_eq!(crc32(crc32(0, &data[..cut]), &data[cut..]), crc32(0, &data));
        }
    }
}
